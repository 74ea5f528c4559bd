"""Prefetching a stale copy's new files (the asynchronous mode's default): once a Spark task's
subtasks are done, a thread of its Python worker waits for every subtask's acknowledgement of
the checkpoint in flight and fetches into the process's file cache the files those
acknowledgements name for each subtask of which the worker holds an older live copy. It
changes no copy: if Spark later moves such a subtask here, its task restores (RocksDB) or
catches up (heap) on its path as before, but takes the new files from the cache instead of
fetching them from the store at its latency.

Why not catch the copies up instead (:mod:`keyedstate.runtime.live_copies`, what the
synchronous mode does between batches): in the asynchronous mode the next batch's tasks start
as soon as the last ones return, so no worker is idle, and a catch-up (or a RocksDB restore)
in the background takes its CPU from them; a prefetch is GETs, and only of the files a restore
here would fetch (docs/spark.md, "State locality").

Correctness does not depend on it: the cache is keyed by each file's checksum and size, and a
restore verifies what it takes. The thread never touches :data:`~keyedstate.runtime.
live_copies.LIVE` (it reads the copies' tokens when it starts, in the task's thread), so the
next task does not wait for it: it is only asked to stop, between subtasks, when the next
prefetch starts. Nothing on a local disk (no cache to fill).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from keyedstate.runtime.live_copies import LIVE, acknowledged
from keyedstate.storage.checkpoint_storage import CheckpointStorage

logger = logging.getLogger(__name__)


@dataclass
class _Prefetch:
    thread: threading.Thread
    stop: threading.Event


_current: _Prefetch | None = None


def prefetch_in_background(job_id: str, start_id: str, storage: CheckpointStorage,
                           checkpoint_id: int, parallelism: int) -> None:
    """Start fetching, in a daemon thread, the files of checkpoint ``checkpoint_id`` in flight
    (of ``parallelism`` subtasks) that this worker would need to bring its copies of
    ``job_id``'s subtasks, made by the start ``start_id``, to it: once every subtask has
    acknowledged its upload, for each copy whose token is not its subtask's ack's, the ack's
    files the file cache lacks. The previous prefetch, if any, is asked to stop. Returns at
    once; never raises."""
    global _current
    stop_prefetch()
    if storage.cache is None:
        return
    # Read here, in the task's thread: the thread itself never looks at LIVE.
    tokens = {key[1]: live.token for key, live in LIVE.items()
              if key[0] == job_id and live.start_id == start_id
              and live.parallelism == parallelism}
    if not tokens:
        return
    stop = threading.Event()
    thread = threading.Thread(target=_prefetch_when_acknowledged,
                              args=(storage, checkpoint_id, parallelism, tokens, stop),
                              name=f"keyedstate-prefetch-{checkpoint_id}", daemon=True)
    _current = _Prefetch(thread, stop)
    thread.start()


def stop_prefetch() -> None:
    """Ask the prefetch thread, if one runs, to stop after the subtask it fetches for (not
    waited for: it changes nothing a task reads but the content-addressed file cache)."""
    global _current
    if _current is not None:
        _current.stop.set()
        _current = None


def wait_for_prefetch(timeout_s: float | None = None) -> None:
    """Wait for the current prefetch thread to end (tests)."""
    current = _current
    if current is not None:
        current.thread.join(timeout_s)


def _prefetch_when_acknowledged(storage: CheckpointStorage, checkpoint_id: int,
                                parallelism: int, tokens: dict[int, str],
                                stop: threading.Event) -> None:
    try:
        target = acknowledged(storage, checkpoint_id, parallelism, stop)
        if target is None:
            return
        for index, token in sorted(tokens.items()):
            if stop.is_set():
                return
            if index >= len(target.tokens) or token == target.tokens[index]:
                continue  # the copy is at it already (the subtask this worker just ran)
            fetched = storage.prefetch([stream for handle in target.handles[index]
                                        for stream in handle.streams()])
            logger.info("prefetched %d bytes of subtask %d's checkpoint %d", fetched, index,
                        checkpoint_id)
    except Exception:  # noqa: BLE001 - a background thread reports and ends, never raises
        logger.warning("prefetching the files of checkpoint %d failed", checkpoint_id,
                       exc_info=True)
