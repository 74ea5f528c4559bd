"""The live copies a Python worker keeps between batches: each subtask's state backend, left
open after its snapshot, for the next batch of that subtask that Spark runs in this worker
(Flink's task-local state, kept in memory). A copy belongs to one start of one job (its
checkpoint storage and :attr:`~keyedstate.runtime.startup.JobStart.start_id`): a later start of
the job (a restart in the same Spark session, whose definition may have changed) never sees it,
and restores from the snapshot as a new session would. Within its start, a copy is reused only
if its token is the one the batch's plan records for its subtask (the last completed
checkpoint's, or in the asynchronous mode the checkpoint in flight's); else it catches up or is
closed (:func:`keyedstate.runtime.subtask._restore`).

Bounded: at most :data:`MAX_LIVE` copies per worker (least recently used closed first), copies
of other jobs idle for :data:`LIVE_IDLE_S` closed; a worker that exits normally closes them
all. Every close goes through :func:`close_live` (it thaws what ``runtime.gc_freeze`` froze).

Catching up in the background (:func:`catch_up_in_background`): Spark does not keep a subtask
in the worker that ran it last, so a worker holds copies of subtasks that other workers have
moved on since. Once a Spark task's subtasks are done, a thread waits for the checkpoint they
wrote and brings the worker's other copies of the job to it with
``KeyedStateBackend.catch_up`` (or, given a restorer, restores those that can't: RocksDB),
while the worker is idle; a later task of one of those subtasks in this worker then reuses its
copy instead of catching up on the batch's critical path. The next task stops the thread
first (:func:`stop_background_catch_up`), waiting for the copy it is changing: no task ever
sees a copy half caught up, and a copy whose catch-up failed is closed.

What the thread waits for depends on the mode. The synchronous mode: the checkpoint's
``_metadata`` (the driver commits it right after the batch's last task); its handles and
tokens. The asynchronous mode (``in_flight``): the checkpoint completes only beside the next
batch's tasks, which are planned on it still in flight, so the thread waits instead for the
acknowledgement of every subtask of it (:func:`~keyedstate.runtime.uploads.read_ack`, one GET
per missing one a poll) and brings each copy to its subtask's ack: its handle, its token. An
ack that reports a failed upload, or one never written, stops it touching anything: the
checkpoint will fail.

Why a copy brought to a checkpoint in flight is safe: a copy is reused only if its token is
the one the batch's plan records for its subtask, and a batch planned on checkpoint N in
flight carries N's tokens, the acks' (``RestoreSource.in_flight``). If N completes, that copy
is exactly N's state, as a copy caught up from the ack on the batch's path would be
(``runtime.subtask._restore``). If N fails, every batch after the last completed checkpoint
is discarded and planned again on an older checkpoint, whose tokens differ: the copy no longer
matches and is caught up from, or closed for, that checkpoint, never used as it is.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from keyedstate.backends.base.backend import KeyedStateBackend
from keyedstate.checkpoint.properties import tokens_of
from keyedstate.errors import NoCheckpointError
from keyedstate.runtime.gc_freeze import thaw
from keyedstate.runtime.uploads import read_ack, wait_for_subtask
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata, KeyedStateHandle, SnapshotFormat
from keyedstate.storage.transfer import parallel_map

logger = logging.getLogger(__name__)


@dataclass
class LiveCopy:
    backend: KeyedStateBackend
    #: the token of the snapshot the backend's state is (the committed checkpoint's, to reuse)
    token: str
    parallelism: int
    #: the start of the job that made it (:attr:`~keyedstate.runtime.startup.JobStart.
    #: start_id`): only that start uses it
    start_id: str
    #: ``time.monotonic()`` when it was last kept
    last_used: float = 0.0
    #: seconds spent catching it up in the background since it was last kept
    caught_up_s: float = 0.0


#: Live state per (job, subtask) in this Python worker, least recently used first. One thread
#: at a time touches it, so no lock is needed: a Spark Python worker runs one task at a time,
#: and the background catch-up runs between tasks and is stopped (joined) before a task looks
#: (:func:`stop_background_catch_up`). A copy is reused only if its token is the committed one.
LIVE: OrderedDict[tuple[str, int], LiveCopy] = OrderedDict()
#: At most this many live copies per Python worker (or twice the subtasks of one Spark task,
#: if more: a worker may run either of two tasks' groups from one batch to the next): beyond
#: it the least recently used is closed (its local directory goes with it). A worker serves
#: whichever subtasks Spark gives it, of any number of jobs over its life; only the latest few
#: are likely to come back.
MAX_LIVE = 8
#: A live copy of another job unused this long is closed: that job stopped, or runs elsewhere.
LIVE_IDLE_S = 300.0


def close_live(live: LiveCopy) -> None:
    """Close ``live``'s backend; never raises."""
    try:
        live.backend.close()
    except Exception:  # noqa: BLE001 - closing a cached copy must never fail a task
        pass
    thaw()  # its frozen objects (runtime.gc_freeze) are the collector's again


def _close_kept(key: tuple[str, int]) -> None:
    """Close the kept copy ``key`` once this process's uploads of its subtask are done
    (:mod:`keyedstate.runtime.uploads`: a RocksDB snapshot's files lie in the copy's
    directory)."""
    wait_for_subtask(*key)
    close_live(LIVE.pop(key))


def take_live(job_id: str, index: int, start_id: str) -> LiveCopy | None:
    """Remove and return this worker's copy of subtask ``index`` of ``job_id`` made by the
    start ``start_id``, if any (the caller reuses, catches up or closes it). Copies of the
    job made by another start are closed (never used again: that start's definition may
    differ from this one's), and so are copies of other jobs idle for :data:`LIVE_IDLE_S`."""
    _close_idle_live(job_id)
    for key in [k for k, v in LIVE.items() if k[0] == job_id and v.start_id != start_id]:
        _close_kept(key)
    return LIVE.pop((job_id, index), None)


def keep_live(key: tuple[str, int], live: LiveCopy, group: int = 1) -> None:
    """Cache ``live`` for the next batch of its subtask, within :data:`MAX_LIVE` (or twice
    ``group``, the most subtasks one Spark task runs)."""
    live.last_used = time.monotonic()
    LIVE[key] = live
    LIVE.move_to_end(key)
    while len(LIVE) > max(MAX_LIVE, 2 * group):
        _close_kept(next(iter(LIVE)))


def _close_idle_live(job_id: str) -> None:
    """Close the live copies of jobs other than ``job_id`` unused for :data:`LIVE_IDLE_S`."""
    now = time.monotonic()
    for key in [k for k, v in LIVE.items()
                if k[0] != job_id and now - v.last_used > LIVE_IDLE_S]:
        _close_kept(key)


def release_live(job_id: str, start_id: str) -> None:
    """Close this process's live copies of ``job_id``'s subtasks made by the start
    ``start_id`` (a job that runs its subtasks in its own process,
    :class:`~keyedstate.runtime.local.LocalJob`, closing; a later start's copies stay)."""
    stop_background_catch_up()
    for key in [k for k, v in LIVE.items() if k[0] == job_id and v.start_id == start_id]:
        _close_kept(key)


@atexit.register
def close_all_live() -> None:
    """A worker that exits normally closes its copies (a killed one can't: its directory is
    removed by the next process, see :mod:`keyedstate.backends.base.working_dirs`)."""
    stop_background_catch_up()
    while LIVE:
        _close_kept(next(iter(LIVE)))  # after its uploads: their acknowledgements get written


# -- catching up in the background -----------------------------------------------------------

#: How long the background thread waits for the checkpoint to be committed, or acknowledged
#: by every subtask (a failed batch's never is; the next task stops the thread sooner anyway).
COMMIT_WAIT_S = 60.0
#: Polls of ``_metadata`` (or of the acks still missing): every 50 ms at first (the driver
#: commits right after the last task; the uploads end soon after it), slowing to once a second.
_POLL_S, _MAX_POLL_S = 0.05, 1.0


@dataclass
class _Background:
    thread: threading.Thread
    stop: threading.Event


_background: _Background | None = None


#: Restores subtask ``index``'s backend from checkpoint ``checkpoint_id`` of the job at the
#: same parallelism, given the handles to restore from (a committed checkpoint's, or the
#: subtask's acknowledged one of a checkpoint in flight): a copy that can't catch up is
#: replaced with one restored in the background (``runtime.subtask.restorer``)
Restorer = Callable[[int, int, Sequence[KeyedStateHandle]], KeyedStateBackend]


@dataclass(frozen=True)
class CopyTarget:
    """The checkpoint the copies are brought to: per subtask index, the token a copy at it
    has and the handles to catch up or restore from."""

    checkpoint_id: int
    parallelism: int
    tokens: list[str]
    handles: list[Sequence[KeyedStateHandle]]


def catch_up_in_background(job_id: str, start_id: str, storage: CheckpointStorage,
                           checkpoint_id: int, restore: Restorer | None = None,
                           in_flight: int | None = None) -> None:
    """Start bringing this worker's copies of ``job_id``'s subtasks made by the start
    ``start_id`` to checkpoint ``checkpoint_id`` (the one the task that just ended wrote,
    in that start), in a daemon thread, once the driver has committed it, or, given
    ``in_flight`` (the asynchronous mode: the checkpoint's parallelism), once each of its
    ``in_flight`` subtasks has acknowledged its upload: each copy catches up
    (``KeyedStateBackend.catch_up``), or, when its backend can't (RocksDB) and ``restore`` is
    given, is closed and replaced with a backend ``restore`` builds from the checkpoint.
    Copies already at it (the task's own) are left alone; see the module docstring. Returns
    at once; never raises."""
    global _background
    stop_background_catch_up()
    if not any(key[0] == job_id and live.start_id == start_id
               and (restore is not None or _catches_up(live)) for key, live in LIVE.items()):
        return  # nothing it could do: a copy that can't catch up is restored when needed
    stop = threading.Event()
    thread = threading.Thread(target=_catch_up_when_ready,
                              args=(job_id, start_id, storage, checkpoint_id, in_flight,
                                    restore, stop),
                              name=f"keyedstate-catch-up-{checkpoint_id}", daemon=True)
    _background = _Background(thread, stop)
    thread.start()


def _catches_up(live: LiveCopy) -> bool:
    """Whether ``live``'s backend has a catch-up path (overrides the contract's default, which
    always declines)."""
    return type(live.backend).catch_up is not KeyedStateBackend.catch_up


def stop_background_catch_up() -> None:
    """Stop the background catch-up, if one runs, and wait for the copy it is changing to be
    done (caught up, or closed): call before anything touches :data:`LIVE`."""
    global _background
    if _background is None:
        return
    _background.stop.set()
    _background.thread.join()
    _background = None


def _catch_up_when_ready(job_id: str, start_id: str, storage: CheckpointStorage,
                         checkpoint_id: int, in_flight: int | None, restore: Restorer | None,
                         stop: threading.Event) -> None:
    try:
        target = _committed(storage, checkpoint_id, stop) if in_flight is None \
            else acknowledged(storage, checkpoint_id, in_flight, stop)
        if target is not None:
            _bring_copies_to(target, job_id, start_id, storage, restore, stop)
    except Exception:  # noqa: BLE001 - a background thread reports and ends, never raises
        logger.warning("catching live copies up with checkpoint %d failed", checkpoint_id,
                       exc_info=True)


def _bring_copies_to(target: CopyTarget, job_id: str, start_id: str,
                     storage: CheckpointStorage, restore: Restorer | None,
                     stop: threading.Event) -> None:
    """Catch up (or restore) each of this worker's copies of the job's start ``start_id``
    that is at the target's parallelism but not at its token, until ``stop``."""
    # The most recently used first: the likeliest to be needed next.
    for key in [k for k in reversed(LIVE) if k[0] == job_id]:
        live, index = LIVE.get(key), key[1]
        if stop.is_set():
            return
        if live is None or live.start_id != start_id or live.parallelism != target.parallelism \
                or index >= len(target.tokens) or live.token == target.tokens[index]:
            continue
        if not _catches_up(live) and restore is None:
            continue
        # An upload of the copy still running in this process (the asynchronous mode) reads
        # what the catch-up changes or the close deletes (runtime.uploads).
        wait_for_subtask(job_id, index)
        if _catches_up(live):
            _catch_up(key, live, target, storage)
        elif restore is not None:
            _restore(key, live, target, restore)


def _committed(storage: CheckpointStorage, checkpoint_id: int, stop: threading.Event
               ) -> CopyTarget | None:
    """Checkpoint ``checkpoint_id`` once committed (when native and with its subtasks'
    tokens); None if not, if stopped, or if :data:`COMMIT_WAIT_S` passed first."""
    metadata = _committed_metadata(storage, checkpoint_id, stop)
    tokens = None if metadata is None else tokens_of(metadata.properties)
    if metadata is None or metadata.format is not SnapshotFormat.NATIVE or tokens is None:
        return None
    return CopyTarget(checkpoint_id, metadata.parallelism, tokens,
                      [metadata.handles] * len(tokens))


def _committed_metadata(storage: CheckpointStorage, checkpoint_id: int,
                        stop: threading.Event) -> CheckpointMetadata | None:
    """Checkpoint ``checkpoint_id``'s metadata once committed; None if stopped or
    :data:`COMMIT_WAIT_S` passed first."""
    relative = storage.metadata_path(checkpoint_id)
    deadline, poll = time.monotonic() + COMMIT_WAIT_S, _POLL_S
    while True:
        try:  # one read per poll: _metadata is written atomically, so it is there whole or not
            return storage.read_metadata(relative)
        except NoCheckpointError:
            pass
        if stop.wait(poll) or time.monotonic() > deadline:
            return None
        poll = min(poll * 1.25, _MAX_POLL_S)


def acknowledged(storage: CheckpointStorage, checkpoint_id: int, parallelism: int,
                 stop: threading.Event) -> CopyTarget | None:
    """Checkpoint ``checkpoint_id`` in flight once each of its ``parallelism`` subtasks has
    acknowledged its upload: their tokens and handles. None if an ack reports a failed upload
    (the checkpoint will fail), if stopped, or if :data:`COMMIT_WAIT_S` passed first. One GET
    per missing ack a poll, in parallel (the storage's small-request threads), ``stop``
    checked between polls: the next task's :func:`stop_background_catch_up` waits at most
    one round of requests."""
    acks: dict[int, tuple[str, KeyedStateHandle]] = {}
    deadline, poll = time.monotonic() + COMMIT_WAIT_S, _POLL_S
    while True:
        missing = [i for i in range(parallelism) if i not in acks]
        found = parallel_map(lambda i: read_ack(storage, checkpoint_id, i), missing,
                             storage.request_threads)
        if stop.is_set():
            return None
        for index, ack in zip(missing, found):
            if ack is None:
                continue
            if ack.error is not None or ack.handle is None:
                logger.info("subtask %d's upload of checkpoint %d failed: its copies here "
                            "are left as they are", index, checkpoint_id)
                return None
            acks[index] = (ack.token, ack.handle)
        if len(acks) == parallelism:
            ordered = [acks[i] for i in range(parallelism)]
            return CopyTarget(checkpoint_id, parallelism, [token for token, _ in ordered],
                              [[handle] for _, handle in ordered])
        if stop.wait(poll) or time.monotonic() > deadline:
            return None
        poll = min(poll * 1.25, _MAX_POLL_S)


def _catch_up(key: tuple[str, int], live: LiveCopy, target: CopyTarget,
              storage: CheckpointStorage) -> None:
    """Bring ``live`` to the target checkpoint, or close it if it can't (another chain, a
    full snapshot since) or fails half way (a storage error: never used again)."""
    started = time.perf_counter()
    try:
        caught_up = live.backend.catch_up(target.handles[key[1]], storage)
    except Exception:  # noqa: BLE001 - the copy is dropped, the next task restores
        logger.warning("catching subtask %d up with checkpoint %d in the background failed; "
                       "its copy is closed", key[1], target.checkpoint_id, exc_info=True)
        caught_up = False
    if caught_up:
        live.token = target.tokens[key[1]]
        live.caught_up_s += time.perf_counter() - started
        logger.info("caught subtask %d up with checkpoint %d in the background in %.3f s",
                    key[1], target.checkpoint_id, time.perf_counter() - started)
    else:
        LIVE.pop(key, None)
        close_live(live)


def _restore(key: tuple[str, int], live: LiveCopy, target: CopyTarget, restore: Restorer
             ) -> None:
    """Replace ``live`` (closed first: its memory and files go before the new copy's come)
    with subtask ``key[1]``'s backend restored from the target checkpoint; if that fails, the
    worker has no copy, and the subtask's next task here restores on its path as without
    this."""
    LIVE.pop(key, None)
    close_live(live)
    started = time.perf_counter()
    try:
        backend = restore(key[1], target.checkpoint_id, target.handles[key[1]])
    except Exception:  # noqa: BLE001 - no copy: the next task restores
        logger.warning("restoring subtask %d from checkpoint %d in the background failed",
                       key[1], target.checkpoint_id, exc_info=True)
        return
    LIVE[key] = LiveCopy(backend, target.tokens[key[1]], target.parallelism, live.start_id,
                         last_used=live.last_used,
                         caught_up_s=time.perf_counter() - started)
    logger.info("restored subtask %d from checkpoint %d in the background in %.3f s", key[1],
                target.checkpoint_id, time.perf_counter() - started)
