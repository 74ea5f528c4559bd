"""The uploader of a Python process: the asynchronous phase of its subtasks' snapshots.

In the asynchronous mode (``keyedstate.checkpointing.async-upload``; docs/checkpoints.md, "The
asynchronous phase") a subtask ends its task after the synchronous phase of its snapshot and
hands the :class:`~keyedstate.backends.base.backend.SnapshotResult` to :func:`submit`, with
its batch's staged output encoded (:class:`StagedFile`). One thread per process runs the
uploads in the order handed (first in, first out: a subtask's checkpoints upload in order;
the transfer pool inside ``materialize`` stays their only parallelism): the snapshot's files
and, beside them on a thread of their own, the staged ones; once both are written, the
subtask's acknowledgement,
:func:`~keyedstate.storage.layout.ack_file` (a :class:`~keyedstate.runtime.wire.SubtaskAck`:
the handle once the files are durable, or the failure as text): the driver's only way to learn
that the files are durable, since the task has ended.

In the process: :func:`wait_for` (a subtask's next batch waits for its own previous upload
before its synchronous phase, so its incremental snapshot may build on it) and
:func:`wait_for_job` (a job discarding, stopping or closing waits for every upload of its own
this process still runs, so that nothing writes for it afterwards). :func:`read_ack` reads an
acknowledgement back (the driver; a subtask restoring from a checkpoint in flight).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Sequence

from keyedstate.backends.base.backend import SnapshotResult
from keyedstate.errors import CheckpointError
from keyedstate.runtime.wire import WIRE_VERSION, SubtaskAck, decode_ack, encode_ack
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle
from keyedstate.storage.layout import ABORTED_MARKER_FILE, ack_file, checkpoint_dir_name
from keyedstate.storage.transfer import parallel_map

log = logging.getLogger("keyedstate")


@dataclass(frozen=True)
class StagedFile:
    """A subtask's staged output file, encoded in its task and written by the uploader."""

    #: its path below the checkpoint storage's root
    relative: str
    data: bytes


@dataclass
class Upload:
    """One snapshot handed to the uploader: subtask ``index`` of checkpoint
    ``checkpoint_id`` of the job ``job_id``."""

    job_id: str
    checkpoint_id: int
    index: int
    token: str
    storage: CheckpointStorage
    #: the snapshot to materialize (dropped once done: it holds the frozen state)
    result: SnapshotResult | None
    #: the batch's staged output, written after the snapshot's files (dropped once done)
    staged: Sequence[StagedFile] = ()
    done: threading.Event = field(default_factory=threading.Event)
    #: the handle, once the files are durable and the ack written
    handle: KeyedStateHandle | None = None
    #: what failed: the upload, or writing its acknowledgement
    error: BaseException | None = None

    def wait(self) -> KeyedStateHandle:
        """The handle once the upload and its acknowledgement are written; raises
        :class:`~keyedstate.errors.CheckpointError` naming the subtask and checkpoint if either
        failed."""
        self.done.wait()
        if self.error is not None or self.handle is None:
            raise CheckpointError(
                f"the upload of subtask {self.index} of checkpoint {self.checkpoint_id} "
                f"failed: {self.error!r}") from self.error
        return self.handle


class _Uploader:
    """The process's upload thread and the uploads it knows (the last one per subtask, and
    every one not done)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.queue: queue.Queue[Upload] = queue.Queue()
        self.lock = threading.Lock()
        #: (job, subtask) -> its uploads not yet forgotten, oldest first
        self.uploads: dict[tuple[str, int], list[Upload]] = {}
        #: writes an upload's staged output beside its snapshot's files (:func:`_upload`)
        self.staging = ThreadPoolExecutor(1, thread_name_prefix="keyedstate-staging")
        self.thread = threading.Thread(target=self._run, name="keyedstate-uploader",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            _upload(self.queue.get())

    def add(self, upload: Upload) -> None:
        with self.lock:
            mine = self.uploads.setdefault((upload.job_id, upload.index), [])
            # Done uploads older than the newest are of no use: only the newest is waited for.
            mine[:] = [u for u in mine if not u.done.is_set()] + [upload]
        self.queue.put(upload)

    def of(self, job_id: str, index: int | None = None) -> list[Upload]:
        with self.lock:
            return [u for (job, i), ups in self.uploads.items() for u in ups
                    if job == job_id and (index is None or i == index)]


_uploader: _Uploader | None = None
_uploader_lock = threading.Lock()


def _the_uploader() -> _Uploader:
    """This process's uploader (a forked process starts its own: threads do not fork)."""
    global _uploader
    with _uploader_lock:
        if _uploader is None or _uploader.pid != os.getpid():
            _uploader = _Uploader()
        return _uploader


def _upload(upload: Upload) -> None:
    """Materialize ``upload``'s snapshot, then write its acknowledgement (the failure's, if
    it failed); never raises (what failed is the upload's ``error``)."""
    started = time.perf_counter()
    result, upload.result = upload.result, None
    staged, upload.staged = upload.staged, ()
    try:
        assert result is not None, "an upload runs once"
        storage = upload.storage
        # The staged output is written beside the snapshot's files, not after them (one
        # round trip less before the acknowledgement, which waits for both). Its own thread:
        # materialize's transfers use the pool, and a call from a pool thread runs inline.
        staging = _the_uploader().staging.submit(
            parallel_map, lambda f: _write_staged(storage, f), staged,
            storage.request_threads) if staged else None
        try:
            handle: KeyedStateHandle | None = result.materialize()
        finally:  # no write left running behind the acknowledgement, whatever failed
            if staging is not None:
                wait([staging])
        # After it: exactly one of materialize and discard runs, whatever fails.
        if staging is not None:
            staging.result()
        ack = SubtaskAck(version=WIRE_VERSION, checkpoint_id=upload.checkpoint_id,
                         subtask=upload.index, token=upload.token, handle=handle,
                         async_s=time.perf_counter() - started)
    except BaseException as exc:  # noqa: BLE001 - reported through the ack and the upload
        upload.error = exc
        handle = None
        ack = SubtaskAck(version=WIRE_VERSION, checkpoint_id=upload.checkpoint_id,
                         subtask=upload.index, token=upload.token, handle=None,
                         async_s=time.perf_counter() - started,
                         error=f"{type(exc).__name__}: {exc}")
    try:
        upload.storage.write(ack_file(upload.checkpoint_id, upload.index), encode_ack(ack))
        upload.handle = handle
    except BaseException as exc:  # noqa: BLE001 - the driver finds no ack: the checkpoint fails
        log.warning("subtask %d of checkpoint %d: writing its acknowledgement failed: %s",
                    upload.index, upload.checkpoint_id, exc)
        upload.error = upload.error or exc
    finally:
        upload.done.set()


def _write_staged(storage: CheckpointStorage, staged: StagedFile) -> None:
    path = storage.path(staged.relative)

    def write() -> None:
        storage.ensure_parent(path)
        storage.fs.pipe_file(path, staged.data)

    storage.call(f"staging output {storage.url_of(staged.relative)}", write)


def submit(*, job_id: str, checkpoint_id: int, index: int, token: str,
           storage: CheckpointStorage, result: SnapshotResult,
           staged: Sequence[StagedFile] = ()) -> Upload:
    """Hand ``result`` (subtask ``index``'s snapshot of checkpoint ``checkpoint_id``) and
    the batch's ``staged`` output to this process's uploader; returns at once."""
    upload = Upload(job_id, checkpoint_id, index, token, storage, result, staged)
    _the_uploader().add(upload)
    return upload


def wait_for(job_id: str, index: int, checkpoint_id: int) -> KeyedStateHandle | None:
    """Wait for this process's upload of subtask ``index`` of ``checkpoint_id``; its handle,
    or None when this process has no such upload (another process made it). Raises
    :class:`~keyedstate.errors.CheckpointError` if it failed."""
    for upload in _the_uploader().of(job_id, index):
        if upload.checkpoint_id == checkpoint_id:
            return upload.wait()
    return None


def wait_for_subtask(job_id: str, index: int) -> None:
    """Wait until this process runs no upload of subtask ``index`` of ``job_id`` (before its
    live copy closes: a RocksDB snapshot's files go with the copy's directory)."""
    for upload in _the_uploader().of(job_id, index):
        upload.done.wait()


def wait_for_checkpoint(job_id: str, checkpoint_id: int) -> None:
    """Wait until this process runs no upload of ``job_id``'s ``checkpoint_id`` any more."""
    for upload in _the_uploader().of(job_id):
        if upload.checkpoint_id == checkpoint_id:
            upload.done.wait()


def wait_for_job(job_id: str) -> None:
    """Wait until this process runs no upload of ``job_id`` any more (failed ones included)."""
    for upload in _the_uploader().of(job_id):
        upload.done.wait()


#: Polls of acknowledgements written by other processes: every 20 ms at first (the uploads of
#: a small batch end right after its tasks), slowing to once a second.
_POLL_S, _MAX_POLL_S = 0.02, 1.0


def await_acks(storage: CheckpointStorage, checkpoint_id: int, subtasks: Sequence[int],
               timeout_s: float) -> None:
    """Wait until every acknowledgement of ``subtasks`` of ``checkpoint_id`` is written (by
    any process; one listing of the checkpoint's folder a poll). Raises
    :class:`~keyedstate.errors.CheckpointError` at once if the checkpoint was aborted (its
    tombstone is written: the driver gave it up and deleted its acknowledgements, say a
    completion that failed beside the batch whose subtasks wait here), else naming the
    missing ones after ``timeout_s`` (``execution.checkpointing.timeout``)."""
    deadline = time.monotonic() + timeout_s
    folder = checkpoint_dir_name(checkpoint_id)
    wanted = {ack_file(checkpoint_id, i): i for i in subtasks}
    delay = _POLL_S
    while True:
        written = set(storage.list_files(folder))
        missing = sorted(i for path, i in wanted.items() if path not in written)
        if not missing:
            return
        if f"{folder}/{ABORTED_MARKER_FILE}" in written:
            raise CheckpointError(
                f"checkpoint {checkpoint_id} was aborted while subtasks {missing} waited for "
                f"their acknowledgements: they will never come")
        if time.monotonic() >= deadline:
            raise CheckpointError(
                f"checkpoint {checkpoint_id}: subtasks {missing} did not acknowledge their "
                f"uploads within {timeout_s:.0f} s (execution.checkpointing.timeout; a "
                f"worker lost, or its uploads slower than that)")
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, _MAX_POLL_S)


def fetch_acks(storage: CheckpointStorage, checkpoint_id: int, subtasks: Sequence[int],
               timeout_s: float) -> list[SubtaskAck | None]:
    """The acknowledgements of ``subtasks`` of ``checkpoint_id``, in their order, written by any
    process: read at once, one GET each in parallel (the storage's small-request threads: the
    uploads have usually ended, and a listing first would be one more round trip); those not
    written yet are polled for (:func:`await_acks`, raising after ``timeout_s``) and read
    then. None for one that vanished in between (the caller reports it missing)."""
    def read(index: int) -> SubtaskAck | None:
        return read_ack(storage, checkpoint_id, index)

    acks = parallel_map(read, subtasks, storage.request_threads)
    missing = [i for i, ack in zip(subtasks, acks) if ack is None]
    if not missing:
        return acks
    await_acks(storage, checkpoint_id, missing, timeout_s)
    found = dict(zip(missing, parallel_map(read, missing, storage.request_threads)))
    return [ack if ack is not None else found[i] for i, ack in zip(subtasks, acks)]


def read_ack(storage: CheckpointStorage, checkpoint_id: int, index: int) -> SubtaskAck | None:
    """Subtask ``index``'s acknowledgement of ``checkpoint_id`` (None: not written). One
    request: a GET answered "not found" costs what a HEAD does, so none is asked first."""
    relative = ack_file(checkpoint_id, index)
    try:
        data = storage.read(relative)
    except FileNotFoundError:
        return None
    return decode_ack(data, storage.url_of(relative))
