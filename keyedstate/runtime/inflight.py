"""The checkpoints in flight of the asynchronous mode: batches whose tasks ended, whose files
are still being uploaded (docs/checkpoints.md, "The asynchronous phase").

The loop (:mod:`keyedstate.runtime.loop`) adds an :class:`InFlight` after each batch's tasks
and completes them in order, oldest first (:meth:`InFlightCheckpoints.complete_oldest`), on a
thread of its own beside the next batch's tasks (:class:`Beside`, its outcome a
:class:`Completion`): wait for every subtask's acknowledgement
(:mod:`keyedstate.runtime.uploads`), put the handles into the reports, complete the
checkpoint as the synchronous mode does (:func:`~keyedstate.runtime.batch.complete_batch`)
and drop its acknowledgements (those of the checkpoint the next batch restores from one batch
later). What the job
returns to when one fails is a :class:`Committed` point: the last completed checkpoint's (or
the job's start's) restore source, watermark, batch id and drain flag.

A loop that may end without completing its checkpoints in flight (the driver's copy in a Spark
Connect server, whose process ends with the query) records each in storage
(:func:`record_flight`, a :class:`~keyedstate.runtime.wire.FlightRecord`); another process of
the job reads the records back (:func:`recorded_flights`) and completes them
(:meth:`~keyedstate.runtime.async_loop.AsyncBatchLoop._take_over_in_flight`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, Mapping, Sequence, TypeVar

import msgspec

from keyedstate.checkpoint.cleanup import Cleaner
from keyedstate.checkpoint.coordinator import (
    CheckpointCoordinator,
    CompletedCheckpoint,
    PendingCheckpoint,
)
from keyedstate.checkpoint.properties import BATCH_ID, DRAINED, MIN_WATERMARK, WATERMARK
from keyedstate.checkpoint.stats import BatchStats
from keyedstate.config import JobConfig
from keyedstate.errors import CheckpointError, CheckpointProtocolError
from keyedstate.runtime.batch import complete_batch
from keyedstate.runtime.subtask import RestoreSource
from keyedstate.runtime.uploads import wait_for_job
from keyedstate.runtime.wire import (
    WIRE_VERSION,
    FlightRecord,
    SubtaskAck,
    SubtaskReport,
    decode_flight,
    encode_flight,
)
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import (
    ABORTED_MARKER_FILE,
    ack_file,
    acks_dir,
    checkpoint_dir_name,
    flight_record_file,
    staging_dir,
)

log = logging.getLogger("keyedstate")

#: what an engine's sink commit gets along with a checkpoint's output
#: (``BatchLoop._commit_output``): the Spark session on Spark, None on the local runtime
ContextT = TypeVar("ContextT")


@dataclass(frozen=True)
class Committed:
    """Where the job stands at its last completed checkpoint (or its start): what a failure
    in flight sets the loop back to."""

    base: RestoreSource | None
    share_restored_files: bool
    watermark: int
    last_batch_id: int
    drained: bool

    @classmethod
    def at(cls, storage: CheckpointStorage, completed: CompletedCheckpoint) -> Committed:
        """Where the job stands at the job's own ``completed`` checkpoint."""
        props = completed.metadata.properties
        return cls(RestoreSource.of(storage, completed.metadata, own=True), True,
                   int(props.get(WATERMARK, MIN_WATERMARK)), int(props.get(BATCH_ID, -1)),
                   props.get(DRAINED) == "true")


@dataclass
class InFlight(Generic[ContextT]):
    """One batch whose tasks ended and whose checkpoint is not complete yet."""

    pending: PendingCheckpoint
    batch_id: int
    #: the subtasks' reports, in subtask order, without handles
    reports: list[SubtaskReport]
    drain: bool
    #: the watermark the batch started with (its checkpoint records the one after it)
    watermark: int
    #: what the engine's sink commit needs (``BatchLoop._commit_output``)
    context: ContextT
    #: ``perf_counter`` at the batch's start; the Spark tasks used
    started: float
    tasks: int | None
    #: whether its record is in storage (:func:`record_flight`)
    recorded: bool = False
    #: whether its output's commit may have happened (tried, or adopted from another process):
    #: its commit marker is then asked for first
    may_be_committed: bool = False

    @property
    def checkpoint_id(self) -> int:
        return self.pending.checkpoint_id

    def record(self, start_id: str) -> FlightRecord:
        """What another process needs to complete this checkpoint (of the job's start
        ``start_id``): all but the engine's context."""
        pending = self.pending
        return FlightRecord(
            version=WIRE_VERSION, start_id=start_id, checkpoint_id=pending.checkpoint_id,
            timestamp_ms=pending.timestamp_ms, properties=dict(pending.properties),
            batch_id=self.batch_id, drain=self.drain, watermark=self.watermark,
            reports=list(self.reports),
            started_s=time.time() - (time.perf_counter() - self.started), tasks=self.tasks)

    @classmethod
    def of_record(cls, record: FlightRecord, pending: PendingCheckpoint,
                  context: ContextT) -> InFlight[ContextT]:
        """The checkpoint ``record`` describes, adopted as ``pending``, its sinks committing
        with ``context``."""
        started = time.perf_counter() - max(0.0, time.time() - record.started_s)
        return cls(pending, record.batch_id, list(record.reports), record.drain,
                   record.watermark, context, started, record.tasks, recorded=True,
                   may_be_committed=True)


@dataclass
class Completion:
    """What completing checkpoints in flight did (:meth:`~keyedstate.runtime.async_loop.
    AsyncBatchLoop._completion`): the statistics of the batches whose output it committed, in
    order, and where it stopped, if it did (at most one of the two is set)."""

    done: list[BatchStats] = field(default_factory=list)
    #: the oldest checkpoint in flight failed to complete: every one in flight is discarded
    failed: BaseException | None = None
    #: a completed checkpoint's sink commit failed: it stays first, committed next time
    commit_failed: BaseException | None = None


class Beside:
    """``work`` (completing checkpoints in flight) run on a thread of its own, made by
    ``thread`` (the engine's kind), while the batch thread runs a batch's tasks:
    :meth:`start` starts it, :meth:`join` waits for it and returns its :class:`Completion`."""

    def __init__(self, work: Callable[[], Completion],
                 thread: Callable[[Callable[[], None]], threading.Thread]) -> None:
        self._work = work
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self.thread = thread(self._run)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            self._completion = self._work()
        except BaseException as exc:  # noqa: BLE001 - raised on the batch thread by join()
            self._error = exc

    def join(self) -> Completion:
        """Wait for the work to end; its completion (what the work raised, if anything,
        is raised here)."""
        self.thread.join()
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion


def record_flight(storage: CheckpointStorage, flight: InFlight, start_id: str) -> None:
    """Write ``flight``'s record (:func:`~keyedstate.storage.layout.flight_record_file`,
    beside its acknowledgements: deleted with them once it completes, or with ``chk-<N>/``
    when it is aborted)."""
    storage.write(flight_record_file(flight.checkpoint_id),
                  encode_flight(flight.record(start_id)))
    flight.recorded = True


def recorded_flights(storage: CheckpointStorage, start_id: str, after: int
                     ) -> list[FlightRecord]:
    """The checkpoints in flight that the job's start ``start_id`` recorded above checkpoint
    ``after`` (the latest completed one, 0: none), oldest first: those whose ``chk-<N>/`` holds
    a record and neither a ``_metadata`` (completed) nor the tombstone of an abort. Records of
    another start are leftovers of a crash (recovery deletes them)."""
    records = []
    for checkpoint_id in storage.checkpoint_dir_ids():
        if checkpoint_id <= after:
            continue
        relative = flight_record_file(checkpoint_id)
        if not storage.exists(relative) or storage.exists(storage.metadata_path(checkpoint_id)) \
                or storage.exists(f"{checkpoint_dir_name(checkpoint_id)}/{ABORTED_MARKER_FILE}"):
            continue
        record = decode_flight(storage.read(relative), storage.url_of(relative))
        if record.start_id == start_id and record.checkpoint_id == checkpoint_id:
            records.append(record)
    return records


def ordered_reports(reports: Sequence[SubtaskReport], parallelism: int, batch_id: int
                    ) -> list[SubtaskReport]:
    """``reports`` in subtask order; :class:`CheckpointProtocolError` unless exactly one per
    subtask."""
    ordered = sorted(reports, key=lambda r: r.subtask)
    if [r.subtask for r in ordered] != list(range(parallelism)):
        raise CheckpointProtocolError(
            f"batch {batch_id}: expected one result per subtask 0..{parallelism - 1}, "
            f"got {[r.subtask for r in ordered]}")
    return ordered


def acknowledged_reports(flight: InFlight, acks: Sequence[SubtaskAck | None]
                         ) -> list[SubtaskReport]:
    """``flight``'s reports with each subtask's handle and upload figures from its
    acknowledgement in ``acks`` (in subtask order, None: not written). Raises
    :class:`CheckpointError` for a missing or failed one, or one of another snapshot than
    the report's."""
    reports = []
    for report, ack in zip(flight.reports, acks):
        if ack is None or ack.handle is None:
            why = "is missing" if ack is None else f"says the upload failed: {ack.error}"
            raise CheckpointError(
                f"checkpoint {flight.checkpoint_id} (batch {flight.batch_id}): the "
                f"acknowledgement of subtask {report.subtask} {why}")
        if ack.token != report.token or ack.checkpoint_id != flight.checkpoint_id:
            raise CheckpointProtocolError(
                f"checkpoint {flight.checkpoint_id}: subtask {report.subtask}'s "
                f"acknowledgement is of another snapshot (token {ack.token}, checkpoint "
                f"{ack.checkpoint_id}) than its report (token {report.token})")
        handle = ack.handle
        figures = msgspec.structs.replace(
            report.figures, async_s=ack.async_s, incremental_bytes=handle.incremental_size,
            full_bytes=handle.full_size)
        reports.append(msgspec.structs.replace(report, handle=handle, figures=figures))
    return reports


class InFlightCheckpoints(Generic[ContextT]):
    """The loop's checkpoints in flight, oldest first (at most
    ``keyedstate.checkpointing.max-concurrent-checkpoints`` between batches)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self._flights: deque[InFlight[ContextT]] = deque()
        #: completed checkpoints whose acknowledgements are not deleted yet (``keep_acks``)
        self._kept_acks: list[InFlight[ContextT]] = []

    def __len__(self) -> int:
        return len(self._flights)

    def __iter__(self) -> Iterator[InFlight[ContextT]]:
        return iter(self._flights)

    def add(self, flight: InFlight[ContextT]) -> None:
        self._flights.append(flight)

    def complete_oldest(self, coordinator: CheckpointCoordinator, *,
                        acks: Callable[[InFlight[ContextT]], Sequence[SubtaskAck | None]],
                        config: JobConfig,
                        key_columns: Sequence[str], lineage: Mapping[str, str], function: str,
                        extra: Mapping[str, str], keep_acks: bool = False,
                        cleaner: Cleaner | None = None
                        ) -> tuple[InFlight[ContextT], CompletedCheckpoint,
                                   list[SubtaskReport]]:
        """Complete the oldest checkpoint in flight: its ``acks`` once written (the engine's
        way: waiting for its uploads, reading them), complete it (``_metadata``, registry,
        subsumption) and drop its acknowledgements; those kept before
        (:meth:`delete_kept_acks`) are deleted beside the reading, and are gone before the
        subsumption.
        ``keep_acks``: keep its own until then instead, because a batch running meanwhile may
        restore from them (its plan's restore source is this checkpoint in flight). Returns
        it, the completed checkpoint and its reports with handles. On failure it stays the
        oldest in flight (the caller discards). ``cleaner``: where the deletion of its own
        goes, off the caller's path (None: on it)."""
        flight = self._flights[0]
        storage = coordinator.storage
        # The kept ones go beside the reading of this checkpoint's, and are gone before the
        # completion subsumes their checkpoint (its folder holds them): deleted beside or
        # after the subsumption, they would be deleted twice (a bulk delete of files gone
        # fails and is tried file by file), or a local disk's two recursive deletes of one
        # folder could each find a file gone half-way and leave the folder behind.
        deleting = threading.Thread(target=self.delete_kept_acks, args=(storage,),
                                    name="keyedstate-acks", daemon=True)
        deleting.start()
        try:
            reports = acknowledged_reports(flight, acks(flight))
        finally:
            deleting.join()
        completed, ordered, _ = complete_batch(
            coordinator, flight.pending, reports, parallelism=config.parallelism,
            batch_id=flight.batch_id, watermark=flight.watermark,
            watermark_delay_ms=config.watermark_delay_ms, drain=flight.drain,
            key_columns=key_columns, lineage=lineage, config=config, function=function,
            extra=extra)
        self._flights.popleft()
        if keep_acks:
            self._kept_acks.append(flight)
        else:
            _delete_acks(storage, [flight], cleaner)
        return flight, completed, ordered

    def delete_kept_acks(self, storage: CheckpointStorage, cleaner: Cleaner | None = None
                         ) -> None:
        """Delete the acknowledgements of the completed checkpoints whose
        :meth:`complete_oldest` kept them: no batch planned since restores from them (handed
        to ``cleaner`` if given)."""
        kept, self._kept_acks = self._kept_acks, []
        _delete_acks(storage, kept, cleaner)

    def discard(self, coordinator: CheckpointCoordinator, reason: str) -> list[int]:
        """Abort every checkpoint in flight, once this process's uploads of the job ended
        (nothing writes for them afterwards), and delete their batches' staged output;
        returns their batch ids."""
        wait_for_job(self.job_id)
        discarded = []
        storage = coordinator.storage
        for flight in self._flights:
            discarded.append(flight.batch_id)
            if not flight.pending.is_aborted and not flight.pending.is_completed:
                coordinator.abort(flight.pending, reason)
            try:
                storage.delete_dir(staging_dir(flight.batch_id))
            except OSError as exc:
                log.warning("could not delete the staged output of discarded batch %d: %s; "
                            "`keyedstate gc` will find it", flight.batch_id, exc)
        self._flights.clear()
        return discarded


def _delete_acks(storage: CheckpointStorage, flights: Sequence[InFlight],
                 cleaner: Cleaner | None = None) -> None:
    """Delete the acknowledgements (and flight records) of completed ``flights``, on
    ``cleaner`` if given. Away from a local disk the files are known: one bulk delete, no
    listing first. A failure is logged: the checkpoints are complete, and ``keyedstate gc``
    finds the leftovers."""
    if not flights:
        return
    if cleaner is not None:
        flights = list(flights)
        cleaner.submit(f"the acknowledgements of checkpoints "
                       f"{[f.checkpoint_id for f in flights]}",
                       lambda: _delete_acks(storage, flights))
        return
    known = []
    for flight in flights:
        known += [ack_file(flight.checkpoint_id, r.subtask) for r in flight.reports]
        if flight.recorded:
            known.append(flight_record_file(flight.checkpoint_id))
    try:
        if storage.is_local:
            for flight in flights:
                storage.delete_dir(acks_dir(flight.checkpoint_id))
        else:
            storage.delete_many(known)
    except OSError as exc:
        log.warning("could not delete the acknowledgements of checkpoints %s: %s",
                    [f.checkpoint_id for f in flights], exc)


def adopt_recorded(storage: CheckpointStorage, start_id: str, context: ContextT, *,
                   backend: str, parallelism: int, max_parallelism: int, key_types: Sequence[str],
                   num_retained: int
                   ) -> tuple[CheckpointCoordinator, list[InFlight[ContextT]]] | None:
    """The checkpoints in flight that the job's start ``start_id`` recorded in ``storage``
    (:func:`recorded_flights`, above the latest completed one), adopted by a coordinator
    recovered from storage (the loop that recorded them completed and subsumed checkpoints
    meanwhile): their ``chk-<N>/`` and every shared file kept (their uploads may still run),
    each adopted as pending (:meth:`~keyedstate.checkpoint.coordinator.
    CheckpointCoordinator.adopt`); their sinks commit with ``context``. None when none is
    recorded (nothing is read further or changed)."""
    completed = storage.checkpoint_ids()
    records = recorded_flights(storage, start_id, completed[-1] if completed else 0)
    if not records:
        return None
    coordinator = CheckpointCoordinator.recover(
        storage, backend=backend, parallelism=parallelism, max_parallelism=max_parallelism,
        key_types=key_types, num_retained=num_retained, cleanup_orphans=False,
        in_flight={r.checkpoint_id for r in records})
    return coordinator, [
        InFlight.of_record(r, coordinator.adopt(r.checkpoint_id, r.timestamp_ms, r.properties),
                           context)
        for r in records]
