"""Clean-up after the commit point: deletions and listings that may fail without harm.

Once a checkpoint's ``_metadata`` is durable it is complete; what follows (subsuming older
checkpoints, dropping files nobody references, an aborted checkpoint's leftovers) only frees
space. So a failure here is logged, never raised: ``keyedstate gc`` finds what is left
(docs/checkpoints.md, "The commit protocol"). The coordinator calls these with its storage.

A :class:`Cleaner` runs such clean-ups off the caller's path, as Flink's
``CheckpointsCleaner`` discards on the JobManager's I/O executor: on an object store each is a
round trip or two that nothing after it waits for.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Iterable

from keyedstate.checkpoint.pending import CompletedCheckpoint
from keyedstate.checkpoint.properties import CLAIMED_FROM
from keyedstate.checkpoint.restore_modes import dispose_claimed_snapshot
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import SHARED_DIR, checkpoint_dir_name, shared_file_prefix

logger = logging.getLogger(__name__)


def written_for(storage: CheckpointStorage, checkpoint_id: int) -> list[str]:
    """Shared files whose name says they were written for ``checkpoint_id`` (one prefix
    listing; a failure is logged, since only clean-up depends on it)."""
    prefix = shared_file_prefix(checkpoint_id)
    try:
        if any(c in storage.root for c in "*?["):  # glob would misread the root
            return [p for p in storage.list_files(SHARED_DIR) if p.startswith(prefix)]
        root = storage.root.rstrip("/") + "/"
        found = storage.fs.glob(storage.path(prefix) + "*")
    except OSError as exc:
        logger.warning("could not list %s*: %s; `keyedstate gc` will find what is left",
                       storage.url_of(prefix), exc)
        return []
    return sorted(p[len(root):] for p in found if p.startswith(root))


def list_quietly(storage: CheckpointStorage, relative: str) -> list[str] | None:
    """Every file below ``relative`` (None: the listing failed, logged)."""
    try:
        return storage.list_files(relative)
    except OSError as exc:
        logger.warning("could not list %s: %s", storage.url_of(relative), exc)
        return None


def delete_quietly(storage: CheckpointStorage, paths: Iterable[str], why: str) -> bool:
    """Delete ``paths``, in one bulk request where the store has one; a failure is
    logged (then each file is tried on its own), since only clean-up depends on it.
    Whether every one is gone."""
    paths = list(paths)
    try:
        storage.delete_many(paths)
        return True
    except OSError:
        pass
    done = True
    for path in paths:
        try:
            storage.delete([path])
        except OSError as exc:
            done = False
            logger.warning("could not delete %s (%s): %s; `keyedstate gc` will find it",
                           storage.url_of(path), why, exc)
    return done


def delete_dir_quietly(storage: CheckpointStorage, relative: str) -> None:
    """Delete the folder ``relative``; a failure is logged."""
    try:
        storage.delete_dir(relative)
    except OSError as exc:
        logger.warning("could not delete %s: %s; `keyedstate gc` will find it",
                       storage.url_of(relative), exc)


def discard_completed(storage: CheckpointStorage, checkpoint: CompletedCheckpoint, *,
                      folder: bool = True) -> bool:
    """Discard a subsumed checkpoint: its claimed snapshot, then its ``_metadata``, then
    (``folder``) its ``chk-<M>/``. Whether its ``_metadata`` is gone; failures are
    logged."""
    # CLAIM restore mode: a checkpoint imported from a claimed snapshot takes the snapshot
    # with it, before its own _metadata goes (a crash in between repeats this on recover).
    claimed = checkpoint.metadata.properties.get(CLAIMED_FROM)
    if claimed:
        try:
            dispose_claimed_snapshot(claimed, storage)
        except Exception as exc:  # the checkpoint that subsumed it is complete: log only
            logger.warning("could not delete the claimed snapshot %s (subsumed with "
                           "checkpoint %d): %s; delete it by hand", claimed,
                           checkpoint.checkpoint_id, exc)
    gone = delete_quietly(storage, [checkpoint.metadata_path],
                          f"subsumed checkpoint {checkpoint.checkpoint_id}")
    if folder:
        delete_dir_quietly(storage, checkpoint_dir_name(checkpoint.checkpoint_id))
    return gone


class Cleaner:
    """Clean-ups handed off the caller's path (:meth:`submit`), run one after another in the
    order handed, on a daemon thread that ends when none is left; a failure is logged, never
    raised (``keyedstate gc`` finds what is left). :meth:`wait` returns once every clean-up
    handed before it ended: a job waits there before it counts as stopped, so that nothing
    deletes for it afterwards. A crash loses the ones not run yet, as it would lose them on
    the caller's path."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: deque[tuple[str, Callable[[], None]]] = deque()
        self._thread: threading.Thread | None = None

    def __reduce__(self) -> tuple[type[Cleaner], tuple[()]]:
        """A copy in another process (a driver shipped to a Spark Connect server) starts with
        nothing handed: clean-ups run where they were handed."""
        return (Cleaner, ())

    def submit(self, what: str, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` (``what`` it cleans, for the log) after those handed before."""
        with self._lock:
            self._pending.append((what, cleanup))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="keyedstate-cleaner",
                                                daemon=True)
                self._thread.start()

    def wait(self) -> None:
        """Return once every clean-up handed so far has ended."""
        while True:
            with self._lock:
                thread = self._thread
            if thread is None or thread is threading.current_thread():
                return
            thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
                what, cleanup = self._pending.popleft()
            try:
                cleanup()
            except Exception as exc:  # noqa: BLE001 - only space depends on it
                logger.warning("could not clean up %s: %s; `keyedstate gc` will find what is "
                               "left", what, exc)
