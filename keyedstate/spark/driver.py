"""The driver: a keyed job over a Structured Streaming query, one checkpoint per micro-batch.

``key_by(df, "user_id").process(MyFunction(), output_schema=...).sink(ParquetSink(...))
.start(config)`` runs ``MyFunction`` over every micro-batch of ``df`` with keyedstate keeping
its state. Per batch (``foreachBatch``), the driver is the checkpoint coordinator and the
Spark engine of the batch loop (:class:`~keyedstate.runtime.loop.BatchLoop` owns steps 2-4;
the driver executes the plan and commits to the sinks):

1. If the batch is already covered by a completed checkpoint (a replay after a driver crash),
   re-commit its sinks from the staged output and return.
2. Trigger checkpoint N; for a function with a local aggregation, aggregate the rows per key
   in the JVM first (:mod:`keyedstate.spark.local_aggregation`); route every row to subtask ``key_group * p // maxP`` with a JVM
   expression (the key group is Spark's ``pmod(xxhash64(keys), maxP)``, see
   :mod:`keyedstate.keys`) and ``repartitionById``; run every subtask with ``mapInArrow``
   (:mod:`keyedstate.runtime.subtask`), which stages output and snapshots state.
3. All p handles in: complete checkpoint N (``_metadata`` written atomically, recording the
   batch id, the new watermark, the staged outputs and each subtask's snapshot token).
4. Commit the sinks, then mark the batch's sinks committed and drop the staged files.

A crash before step 3 leaves the checkpoint incomplete: the batch is re-run from the previous
checkpoint (task retries, killed executors and speculative attempts re-run from committed state
too). A crash between 3 and 4 is repaired by step 1 on restart.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Mapping

import pyarrow as pa

from keyedstate.backends import load_backend
from keyedstate.checkpoint.properties import BATCH_ID, STAGED
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.checkpoint.savepoint import check_savepoint_target
from keyedstate.checkpoint.stats import BatchStats, history_of
from keyedstate.config import (
    LATE_EVENTS_TAG,
    JobConfig,
)
from keyedstate.errors import (
    BatchFailedError,
    CheckpointDiscardedError,
    CheckpointProtocolError,
    ConfigurationError,
    JobDrainedError,
    KeyedStateError,
    NoCheckpointError,
)
from keyedstate.runtime.batch import MAIN_OUTPUT, staged_outputs
from keyedstate.runtime.failures import (
    batch_failure,
    discard_for_client,
    find_task_failure,
    for_spark,
)
from keyedstate.runtime.inflight import InFlight
from keyedstate.runtime.local_aggregation import check_local_aggregation
from keyedstate.runtime.loop import write_savepoint
from keyedstate.runtime.subtask import BatchPlan
from keyedstate.runtime.uploads import fetch_acks
from keyedstate.runtime.wire import REPORT_DDL, SubtaskAck
from keyedstate.spark.carry import carry
from keyedstate.spark.connect import is_connect, task_slots, unsupported
from keyedstate.spark.driver_start import SparkJobStart
from keyedstate.spark.local_aggregation import aggregate_and_route, check_event_time
from keyedstate.spark.offsets import (
    OFFSETS,
    PROP_FORK_BATCH_ID,
    PROP_PARENT_QUERY_ID,
    PROP_QUERY_ID,
)
from keyedstate.spark.query import StopGate
from keyedstate.spark.routing import route
from keyedstate.spark.schema import spark_type_ddl, to_arrow_schema
from keyedstate.spark.tasks import run_subtask
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import SnapshotFormat
from keyedstate.storage.layout import (
    COMMITS_DIR,
)

if TYPE_CHECKING:  # the job (api) builds its driver
    from pyspark.sql import DataFrame, Row

    from keyedstate.spark.api import KeyedProcessJob
    from keyedstate.spark.pyspark_types import Session

log = logging.getLogger("keyedstate")


class KeyedJobDriver(SparkJobStart):
    """The per-batch driver logic (the ``foreachBatch`` function) and the coordinator: the
    Spark engine of the batch loop (:class:`~keyedstate.runtime.loop.BatchLoop`), which
    executes a plan with ``mapInArrow`` and commits output to the job's sinks; its start-up
    (:meth:`_open`) is :class:`~keyedstate.spark.driver_start.SparkJobStart`'s."""

    def __init__(self, job: KeyedProcessJob, config: JobConfig,
                 spark_checkpoint_location: str | None = None) -> None:
        self.job = job
        self.config = config
        self.function = job.function
        self.key_columns = list(job.stream.key_columns)
        self.output_schema = job.output_schema
        self.side_outputs = dict(job.side_outputs)
        #: where Spark keeps the source offsets: batch ids are comparable only within it
        self.spark_checkpoint_location = spark_checkpoint_location or ""
        self.storage = CheckpointStorage(config.checkpoint_dir, config.storage_options,
                                         config.transfer_options())
        self.backend = load_backend(config.backend, **config.backend_options)
        self.max_parallelism = config.effective_max_parallelism
        df = job.stream.dataframe()
        #: the job runs over Spark Connect: its batches run in the server's copy of this
        #: driver (:attr:`shipped` there), this one is the client's
        self.connect = is_connect(df.sparkSession)
        #: the input's Spark schema (late rows have it): kept, so that the driver needs no
        #: DataFrame once shipped to a Spark Connect server (:meth:`__getstate__`)
        self.input_schema = df.schema
        types = {f.name: f.dataType for f in df.schema.fields}
        self.key_types = [spark_type_ddl(types[c]) for c in job.stream.key_columns]
        if config.watermark_column and config.watermark_column not in types:
            raise ConfigurationError(
                f"watermark column {config.watermark_column!r} is not in the DataFrame; its "
                f"columns are {df.columns}"
            )
        #: the function's local aggregation: the rows are aggregated per key in the JVM before
        #: they are routed (keyedstate.spark.local_aggregation); checked before anything is
        #: restored or written
        self.local_aggregation = check_local_aggregation(
            job.function, to_arrow_schema(df.schema), job.stream.key_columns,
            watermark_column=config.watermark_column, late_events=config.late_events)
        check_event_time(df.schema, config.watermark_column, self.local_aggregation)
        self.stats: list[BatchStats] = []
        self.listeners: list[Callable[[BatchStats], None]] = []
        self.drained = False
        #: held while a batch runs and while a savepoint duplicates the latest checkpoint, so
        #: that no checkpoint completes (and subsumes it) meanwhile; re-entrant, so that a
        #: listener (called at the end of a batch) may take a savepoint
        self._lock = threading.RLock()
        #: what stopped the query: the error of the batch that failed, for the query's methods
        #: to raise (:class:`~keyedstate.spark.query.KeyedQuery`)
        self.failure: KeyedStateError | None = None
        #: every batch passes it first: a stop waits there for no batch to run keyedstate work
        self.gate = StopGate()
        #: the checkpoint whose output is being committed (under the lock), None otherwise: a
        #: savepoint taken from inside that commit (a sink's, on the batch thread) carries the
        #: output rather than commit it again under the running commit
        self._committing: int | None = None
        #: this copy runs the batches in a Spark Connect server (:meth:`__setstate__`)
        self.shipped = False
        self._open()
        latest = self.coordinator.latest_completed
        #: the latest checkpoint when the job started: later ones are this run's batches
        self.started_after = -1 if latest is None else latest.checkpoint_id

    def __getstate__(self) -> dict[str, Any]:
        """The driver as Spark Connect ships it to the server's ``foreachBatch`` process
        (:mod:`keyedstate.spark.connect`): the coordinator's state as start-up left it, the
        job without its DataFrame (:meth:`KeyedProcessJob.without_dataframe`), and a new
        lock, stop gate and statistics there (:meth:`__setstate__`). The client's listeners
        stay behind."""
        state = dict(self.__dict__)
        for local in ("_lock", "gate", "listeners", "failure", "stats"):
            del state[local]
        state["job"] = self.job.without_dataframe()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self.gate = StopGate()
        self.listeners = []
        self.failure = None
        self.stats = []
        self.shipped = True

    # -- one batch -----------------------------------------------------------------------------

    def process_batch(self, df: DataFrame, batch_id: int) -> None:
        """The ``foreachBatch`` function (steps in the module docstring). A batch passes the
        stop gate first (:class:`~keyedstate.spark.query.StopGate`: while the query stops, it
        is not run). A failure is kept in :attr:`failure` and goes to Spark as a short error:
        Spark's own exception is no place for a user's traceback."""
        self.gate.enter(batch_id)
        try:
            with self._lock:
                self._process_batch(df, batch_id)
        except Exception as exc:
            cut_off = self.gate.cut_off(batch_id)
            if cut_off is not None:
                raise cut_off from None
            self.failure = batch_failure(exc, batch_id)
            if self.shipped:
                raise _for_connect_client(self.failure, exc) from None
            raise for_spark(self.failure) from None

    def _process_batch(self, df: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        # Step 1. A replay of a batch a completed checkpoint already covers.
        if batch_id <= self.last_batch_id:
            latest = self.coordinator.latest_completed
            if latest is not None and latest.metadata.properties.get(BATCH_ID) == str(batch_id):
                self._commit_sinks(df.sparkSession, latest)
            log.info("batch %s is covered by checkpoint state; skipped", batch_id)
            self._record(BatchStats(batch_id, -1, skipped_replay=True))
            return
        if self.drained:
            raise JobDrainedError("the job was stopped with drain; it takes no more batches")
        self._check_continuity(batch_id)
        self._run_with_retries(df, batch_id, started)

    def _check_continuity(self, batch_id: int) -> None:
        """Step 1b. Refuse a batch that follows batches no checkpoint covers. Spark records a
        batch as done only after this function returned, that is after its checkpoint
        committed, so ids after the restored checkpoint's batch arrive in order; a gap means
        that newer checkpoints were deleted or are unreadable and recovery fell back to an
        older one (or, with none left, to the snapshot the job started from or to empty
        state). Processing the batch would silently leave the gap's input out of the state.
        A job whose state does not continue Spark's batch ids (a new job, or one restored
        from a snapshot taken with other source offsets) has no sink-commit markers yet."""
        if batch_id <= self.last_batch_id + 1:
            return
        if self.last_batch_id < 0 and not self.storage.list_files(COMMITS_DIR):
            return
        latest = self.coordinator.latest_completed
        state = (f"that of batch {self.last_batch_id}" if self.last_batch_id >= 0
                 else "empty or the restored snapshot's")
        where = f" (checkpoint {latest.checkpoint_id})" if latest is not None else ""
        notes = "; ".join(self.coordinator.recovery_notes)
        raise CheckpointProtocolError(
            f"batch {batch_id} can't be processed: the job's state is {state}{where}, but "
            f"Spark recorded batches up to {batch_id - 1} as done, so their input would be "
            f"missing from the state. Checkpoints of {self.config.checkpoint_dir} committed "
            f"after it were deleted or are unreadable"
            + (f" ({notes})" if notes else "")
            + ". Nothing was changed. Put the missing checkpoint back, or restore the job from "
            "a savepoint into a new checkpoint directory with a Spark checkpoint location "
            "that replays from the savepoint's batch"
        )

    def _run_with_retries(self, df: DataFrame, batch_id: int, started: float, *,
                          drain: bool = False) -> None:
        """Run the batch through the loop (:meth:`~keyedstate.runtime.loop.BatchLoop.
        _run_batch`) and record its statistics.

        Step A. Checkpoint the batch. When that fails on transient storage errors
            (throttling, timeouts, 5xx that outlasted the per-call retries), the checkpoint
            was aborted (nothing it wrote is referenced): run the batch again from the last
            committed checkpoint, up to
            ``execution.checkpointing.tolerable-failed-checkpoints`` times.
        Step B. The checkpoint is complete: the batch is never run again. Only its sink
            commit is retried on transient errors; if that still fails, or a listener raises,
            the error ends the batch without Spark marking it done, and the replay after a
            restart commits the output (step 1 of the module docstring).
        """
        if self.config.async_upload:
            # The batch's checkpoint stays in flight; the batches completed meanwhile are
            # recorded as each completes (_completed).
            self._run_batch_async(df, batch_id, started=started, drain=drain,
                                  context=df.sparkSession)
            return
        self._record(self._run_batch(df, batch_id, started=started, drain=drain,
                                     context=df.sparkSession))

    def _tolerable_failures(self) -> int:
        return self.config.tolerable_failed_checkpoints

    def _no_async_upload(self) -> str | None:
        return None

    def _records_in_flight(self) -> bool:
        # The copy in a Spark Connect server: its process ends with the query (Spark ends
        # it), so the client completes what it left in flight (flush).
        return self.shipped

    def _completed(self, stats: BatchStats) -> None:
        self._record(stats)

    def _completion_thread(self, run: Callable[[], None], context: Session
                           ) -> threading.Thread:
        # Spark's inheritable thread: the batch thread's job properties (the query's job
        # group, its SQL execution) and Spark Connect's tags go with it, so that a sink's
        # Spark job runs as one of the batch's.
        from pyspark import InheritableThread

        # (typed for the classic session only; under Spark Connect it takes Connect's)
        return InheritableThread(run, session=context,  # type: ignore[arg-type]
                                 name="keyedstate-completion", daemon=True)

    def _acknowledgements(self, flight: InFlight[Session]) -> list[SubtaskAck | None]:
        """The subtasks' Python workers upload in their own processes: read their
        acknowledgements, polling for those not written yet
        (``execution.checkpointing.timeout``)."""
        return fetch_acks(self.storage, flight.checkpoint_id, range(self.config.parallelism),
                          self.config.checkpoint_timeout.total_seconds())

    def flush(self) -> None:
        """Complete the checkpoints in flight (the asynchronous mode) and commit their
        output, recording their statistics; the query has stopped, or a batch holds the lock.
        Raises :class:`~keyedstate.errors.CheckpointDiscardedError` if one fails (the
        batches after the last completed checkpoint are then to be run again: a restart
        rewinds Spark's log to it, :meth:`~keyedstate.spark.query_log.QueryLog.rewind`).

        The client's driver of a Spark Connect job completes those the server's copy recorded
        and left when the query stopped
        (:meth:`~keyedstate.runtime.async_loop.AsyncBatchLoop._take_over_in_flight`), its sinks
        committing here, with this client's session; refused
        (:class:`~keyedstate.errors.SparkConnectUnsupportedError`) while the query runs. Not
        when Spark's log shows a batch planned and not done (:meth:`_unfinished_batch`: the
        stop cut a batch off, and the server's copy may still be at work on it for a moment):
        the checkpoints in flight are then left to the restart, which rewinds Spark's log and
        runs their batches again (logged)."""
        with self._lock:
            if self.connect and not self.shipped:
                if not self.config.async_upload:
                    return
                query = self.gate.query
                if query is not None and query.isActive:
                    raise unsupported("flush() of a running job",
                                      "Stop the job: stop() completes the checkpoints in "
                                      "flight once the query stopped.")
                unfinished = self._unfinished_batch()
                if unfinished is not None:
                    log.warning(
                        "batch %d was cut off by the stop (it began after the stop gate "
                        "looked; the Spark Connect server's copy of the driver can't be held "
                        "at the client's gate), so the checkpoints that copy left in flight "
                        "are not completed here: the restart rewinds Spark's log to the last "
                        "completed checkpoint and runs their batches again", unfinished)
                    return
                self._take_over_in_flight(self.job.stream.dataframe().sparkSession)
            else:
                self._complete_in_flight(0)

    def _unfinished_batch(self) -> int | None:
        """The last batch Spark's log says was planned and not done, None if there is none
        (or no log)."""
        if not self.spark_checkpoint_location:
            return None
        offsets = self.query_log.offset_log()
        planned = offsets.batches(OFFSETS)
        return planned[-1] if planned and planned[-1] > offsets.last_committed() else None

    def _tasks(self, batch: DataFrame) -> int:
        return self.spark_tasks(batch.sparkSession)

    def _execute(self, plan: BatchPlan, batch: DataFrame) -> list[Row]:
        """Route the batch's rows and run every subtask in Spark tasks (``mapInArrow``)."""
        return (self._route(batch, plan.tasks)
                .mapInArrow(partial(run_subtask, plan), REPORT_DDL).collect())

    def _failure(self, exc: Exception, batch_id: int) -> BaseException | None:
        """A Spark task's failure inside ``exc`` as the :class:`BatchFailedError` it was."""
        if isinstance(exc, BatchFailedError):
            return None
        cause = _batch_failure(exc)
        return None if cause is None else BatchFailedError(cause)

    def _checkpoint_properties(self) -> Mapping[str, str]:
        # The query the batch id belongs to: names the sinks' output, checked at restart.
        return self.query_log.properties()

    def _late_schema(self) -> pa.Schema:
        return to_arrow_schema(self.input_schema)

    def spark_tasks(self, spark: Session) -> int:
        """How many Spark tasks run this batch's subtasks: ``keyedstate.spark.tasks``, else
        the cluster's task slots now (executors may come and go; under Spark Connect only
        when the session sets ``spark.default.parallelism``, else the parallelism), never more
        than the parallelism."""
        slots = self.config.spark_tasks or task_slots(spark)
        # Unknown (Spark Connect has no SparkContext to ask): one task per subtask; Spark
        # queues the tasks that find no free slot.
        return self.config.parallelism if slots is None else min(self.config.parallelism, slots)

    def _route(self, df: DataFrame, spark_tasks: int) -> DataFrame:
        """The batch's rows routed to their subtasks' Spark tasks; with a local aggregation,
        aggregated per key first (at the watermark the batch starts with;
        ``aggregate_and_route`` in the plan of ``keyedstate.local-aggregation.plan``)."""
        if self.local_aggregation is not None:
            return aggregate_and_route(
                df, self.job.stream.key_columns, self.local_aggregation, self.config.parallelism,
                self.max_parallelism, spark_tasks, watermark=self.watermark,
                watermark_column=self.config.watermark_column,
                plan=self.config.local_aggregation_plan)
        return route(df, self.job.stream.key_columns, self.config.parallelism,
                     self.max_parallelism, spark_tasks)

    def _commit_output(self, spark: Session, storage: CheckpointStorage,
                       props: Mapping[str, str]) -> None:
        """Hand every output staged in ``storage`` (``props[STAGED]``) to its sinks, under
        the batch id and query id ``props`` record."""
        batch_id = int(props[BATCH_ID])
        staged = json.loads(props.get(STAGED, "{}"))
        schemas = {MAIN_OUTPUT: self.job.output_schema, **self.job.side_outputs}
        if LATE_EVENTS_TAG in staged or LATE_EVENTS_TAG in self.job.sinks:
            # A late-events sink also commits batches without late rows (no files).
            schemas[LATE_EVENTS_TAG] = self._late_schema()
        outputs = staged_outputs(storage, props, schemas, lineage=props.get(PROP_QUERY_ID, ""),
                                 parent_lineage=props.get(PROP_PARENT_QUERY_ID, ""),
                                 fork_batch_id=int(props.get(PROP_FORK_BATCH_ID, -1)))
        for output, sinks in self.job.sinks.items():
            for sink in sinks:
                sink.commit(spark, batch_id, outputs[output])

    def _record(self, stats: BatchStats) -> None:
        self.stats.append(stats)
        log.info("keyedstate batch %s: %s", stats.batch_id, stats)
        for listener in self.listeners:
            listener(stats)

    # -- stop ----------------------------------------------------------------------------------

    def savepoint(self, target: str,
                  format: SnapshotFormat | str = SnapshotFormat.NATIVE) -> str:
        """A savepoint of the last committed state, the latest completed checkpoint, in
        ``target``; returns the path or URL of its ``_metadata``. The job keeps running.

        Step 1. Refuse a ``target`` holding a savepoint (:class:`SnapshotExistsError`) before
            anything is written.
        Step 2. Under the batch lock (a batch in flight finishes first, and no checkpoint
            completes and subsumes the latest meanwhile): commit the latest checkpoint's
            output if that has not happened yet (idempotent), so that the savepoint's batch
            is complete in state and in output. Called from inside that commit (a sink's
            ``commit`` on the batch thread: the lock is re-entrant), the commit is left to
            finish on its own and the savepoint carries the output instead, as one of a
            stopped driver does: a second commit would delete the staged files under the
            first.
        Step 3. Duplicate the checkpoint's files (native, see
            :func:`~keyedstate.checkpoint.savepoint.write_native_savepoint`) or rewrite them
            (canonical), and carry Spark's offset log up to its batch
            (:mod:`keyedstate.spark.carry`): a job restored from it in any Spark checkpoint
            location resumes its source exactly after that batch.
        """
        fmt = SnapshotFormat(str(format).lower())
        # Step 1.
        check_savepoint_target(CheckpointStorage(target, self.config.storage_options))
        # A sink's commit on the thread completing checkpoints beside a batch's tasks works
        # for the batch thread, which holds the lock and waits for it before it touches the
        # coordinator again: taking the lock there would wait for ever.
        with nullcontext() if self._on_completion_thread() else self._lock:
            latest = self.coordinator.latest_completed
            if latest is None:
                raise NoCheckpointError(
                    "no checkpoint completed yet: nothing to take a savepoint of; wait for the "
                    "first batch"
                )
            # Step 2.
            committing = self._committing == latest.checkpoint_id
            if int(latest.metadata.properties.get(BATCH_ID, -1)) >= 0 and not committing:
                self._commit_with_retries(self.job.stream.dataframe().sparkSession, latest)
            # Step 3.
            source = ResolvedSnapshot(self.storage, latest.metadata_path, latest.metadata)
            attach = carry(source, self.config.storage_options,
                           committed=None if committing else True)
            return write_savepoint(source, target, self.config.storage_options, fmt, attach)

    def recorded_stats(self) -> list[BatchStats]:
        """The statistics of this run's batches as its checkpoints recorded them (the latest
        checkpoint's history, :func:`~keyedstate.checkpoint.stats.history_of`: its last 100
        checkpoints), oldest first: what a Spark Connect client knows of the batches the
        server ran. Batches that were skipped as replays completed no checkpoint and are not
        in it."""
        for _ in range(3):  # a checkpoint may be subsumed between listing and reading it
            ids = self.storage.checkpoint_ids()
            if not ids:
                return []
            try:
                metadata = self.storage.read_metadata(self.storage.metadata_path(ids[-1]))
            except NoCheckpointError:
                continue
            return [BatchStats.from_checkpoint(row) for row in history_of(metadata)
                    if row.checkpoint_id > self.started_after]
        return []

    def offline_savepoint(self, target: str,
                          format: SnapshotFormat | str = SnapshotFormat.NATIVE) -> str:
        """A savepoint of the job's latest checkpoint as its storage holds it, taken with the
        query stopped (Spark Connect, where the coordinator that ran the batches is in the
        server), as ``keyedstate savepoint create`` does: it carries Spark's offset log up to
        its batch and that batch's output unless the commit marker says the sinks committed
        it (the job restored from it commits it first). Returns its ``_metadata`` path."""
        fmt = SnapshotFormat(str(format).lower())
        ids = self.storage.checkpoint_ids()
        if not ids:
            raise NoCheckpointError(
                f"no checkpoint completed in {self.config.checkpoint_dir}: nothing to take a "
                f"savepoint of")
        relative = self.storage.metadata_path(ids[-1])
        source = ResolvedSnapshot(self.storage, relative, self.storage.read_metadata(relative))
        attach = carry(source, self.config.storage_options)
        return write_savepoint(source, target, self.config.storage_options, fmt, attach)

    def drain(self, spark: Session) -> None:
        """Flink's ``stop --drain``: watermark to +infinity, fire every timer, checkpoint.

        The drain is a batch of its own, as Spark's no-data batches are: it takes the next
        batch id ``D``, its output is committed under ``D``, and ``D`` is recorded in Spark's
        offset log as a done batch that read nothing (its offsets are the previous batch's,
        replacing a plan Spark made for ``D`` and never ran). So a job restored from the
        drained state, in this Spark checkpoint location or with the log a savepoint carries,
        resumes at ``D + 1`` with nothing skipped or read twice.
        """
        empty = spark.createDataFrame([], self.input_schema)
        with self._lock:
            batch_id = self.last_batch_id + 1
            offsets = self.query_log.offset_log() if self.spark_checkpoint_location else None
            if offsets is None or self.last_batch_id not in offsets.batches(OFFSETS):
                # Nothing to resume after: the drained job never ran a batch in this location.
                log.warning("drain: %s has no batch %d to follow; a job restored from the "
                            "drained state starts its source afresh",
                            self.spark_checkpoint_location or "the job", self.last_batch_id)
                offsets = None
            self._run_with_retries(empty, batch_id, time.perf_counter(), drain=True)
            if offsets is not None:
                offsets.record_no_data_batch(batch_id)


def _for_connect_client(failure: KeyedStateError, exc: BaseException) -> KeyedStateError:
    """What the shipped driver raises for ``failure`` in a Spark Connect server: Spark hands
    the client the error's text only, from which
    :func:`keyedstate.spark.connect.remote_failure` rebuilds it. A subtask's failure carries
    its data line (so the client gets the key and the user's traceback), and so do
    checkpoints in flight discarded (the discarded batches, even when a subtask's failure
    revealed it); a keyedstate error of the driver goes as itself (its type and first line
    are rebuilt)."""
    if isinstance(failure, CheckpointDiscardedError):
        return discard_for_client(failure)
    task = find_task_failure(exc)
    if task is not None:
        return BatchFailedError(f"{failure}\n{task.encode()}", batch_id=task.batch_id,
                                subtask=task.subtask, key=task.key)
    return failure


def _batch_failure(exc: BaseException) -> str | None:
    """The message of a Spark task's failure inside ``exc``, if there is one."""
    task = find_task_failure(exc)
    return None if task is None else task.describe()
