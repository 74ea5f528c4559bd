"""The batch loop: one engine-independent protocol for every micro-batch of a keyed job.

:class:`BatchLoop` owns what a job carries from batch to batch (the watermark, what the next
batch restores from, the last batch id, whether the job drained) and the steps of one batch.
An engine (:class:`~keyedstate.spark.driver.KeyedJobDriver`,
:class:`~keyedstate.runtime.local.LocalJob`) subclasses it and supplies only how a plan is
executed (:meth:`BatchLoop._execute`) and how output reaches its consumers
(:meth:`BatchLoop._commit_output`), plus small hooks (Spark tasks, failure translation,
extra checkpoint properties, tolerated transient failures).

One batch (:meth:`BatchLoop._run_batch`):

1. Trigger checkpoint N.
2. Plan the batch (:meth:`BatchLoop._plan`: what every subtask gets).
3. Execute the plan (the engine) and decode the subtasks' reports
   (:func:`~keyedstate.runtime.wire.decode_reports`).
4. Complete checkpoint N (:func:`~keyedstate.runtime.batch.complete_batch`); on any failure
   before, abort it: the job stays at its last checkpoint. A failure on transient storage
   errors runs the batch again from there, up to the engine's tolerated failures.
5. Advance: the watermark, the restore base, the last batch id, the drain flag.
6. Commit the output (the engine), unless its commit marker says that happened; then write
   the marker and drop the staged files. The checkpoint is complete: the batch is never run
   again, only this step is retried on transient errors.
7. The batch's statistics (:func:`~keyedstate.runtime.batch.batch_stats`).

A crash before step 4 leaves the checkpoint incomplete (the batch is re-run from the previous
one); a crash between 4 and 6 is repaired by committing again (idempotent by batch id).

The asynchronous mode (``keyedstate.checkpointing.async-upload``; docs/checkpoints.md, "The
asynchronous phase") reuses these steps in :class:`~keyedstate.runtime.async_loop.
AsyncBatchLoop`, which the engines subclass.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Generic, Mapping, TypeVar

import pyarrow as pa

from keyedstate.backends.base.backend import StateBackend
from keyedstate.checkpoint.cleanup import Cleaner
from keyedstate.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from keyedstate.checkpoint.properties import BATCH_ID, RESTORED_FROM
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.checkpoint.savepoint import Attach, write_native_savepoint
from keyedstate.checkpoint.stats import BatchStats
from keyedstate.config import JobConfig
from keyedstate.errors import ConfigurationError, TransientStorageError
from keyedstate.runtime.batch import (
    ResumePoint,
    batch_stats,
    complete_batch,
    mark_output_committed,
    output_pending,
    resume_point,
    side_output_schemas,
)
from keyedstate.runtime.failures import find_task_failure
from keyedstate.runtime.function import KeyedProcessFunction
from keyedstate.runtime.identity import function_name
from keyedstate.runtime.inflight import (
    ContextT,
)
from keyedstate.runtime.startup import JobStart, start_configured_job
from keyedstate.runtime.subtask import BatchPlan, RestoreSource
from keyedstate.runtime.wire import SubtaskReport, decode_reports
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import SnapshotFormat

log = logging.getLogger("keyedstate")

#: what an engine's batch is: a pyarrow Table on the local runtime, a DataFrame on Spark
BatchT = TypeVar("BatchT")


class BatchLoop(ABC, Generic[BatchT, ContextT]):
    """The protocol of a keyed job's batches (module docstring); an engine subclasses it.

    Before :meth:`_start`, the engine sets :attr:`config`, :attr:`storage`, :attr:`backend`,
    :attr:`function`, :attr:`key_columns`, :attr:`key_types`, :attr:`output_schema`,
    :attr:`side_outputs` and :attr:`lineage`; :meth:`_start` sets the rest."""

    config: JobConfig
    storage: CheckpointStorage
    backend: StateBackend
    function: KeyedProcessFunction
    key_columns: list[str]
    key_types: list[str]
    output_schema: pa.Schema
    side_outputs: dict[str, pa.Schema]
    #: where the job's lineage started (recorded in every checkpoint)
    lineage: dict[str, str]
    coordinator: CheckpointCoordinator
    max_parallelism: int
    #: this start of the job (:attr:`~keyedstate.runtime.startup.JobStart.start_id`)
    start_id: str
    #: what the next batch's subtasks restore from (None: empty state)
    base: RestoreSource | None
    #: False while the job depends on a snapshot it did not claim
    share_restored_files: bool
    #: the event-time watermark the next batch starts with
    watermark: int
    #: the batch id the job's state covers (-1: none)
    last_batch_id: int
    drained: bool = False
    #: the checkpoint whose output is being committed (step 6), None otherwise
    _committing: int | None = None

    # -- start-up ------------------------------------------------------------------------------

    def _start(self, on_restore: Callable[[ResolvedSnapshot], Mapping[str, str]]) -> JobStart:
        """The job start-up (:func:`~keyedstate.runtime.startup.start_configured_job`, with
        the engine's ``on_restore`` steps on a snapshot a new job starts from), then what the
        first batch resumes from (:func:`~keyedstate.runtime.batch.resume_point`). An engine
        without the asynchronous mode refuses it first, before anything is read or written."""
        unsupported = self._no_async_upload() if self.config.async_upload else None
        if unsupported is not None:
            raise ConfigurationError(
                f"keyedstate.checkpointing.async-upload: true is not built for {unsupported} "
                f"yet; set it to false (docs/checkpoints.md, \"The asynchronous phase\")")
        start = start_configured_job(self.storage, self.config, backend=self.backend.name,
                                     key_types=self.key_types, on_restore=on_restore,
                                     function=self.function, key_columns=self.key_columns)
        self.max_parallelism = start.max_parallelism
        self.coordinator = start.coordinator
        self.start_id = start.start_id
        point = resume_point(start, self.config)
        # A restart keeps the lineage its checkpoints record, whatever restore path it has.
        self.lineage[RESTORED_FROM] = point.restored_from
        self.base = point.base
        self.share_restored_files = point.share_restored_files
        self.watermark = point.watermark
        self.last_batch_id = self._resumed_batch_id(start, point)
        return start

    def _resumed_batch_id(self, start: JobStart, point: ResumePoint) -> int:
        """The batch id the started job's state covers: the recovered or restored one's."""
        return point.batch_id

    # -- what an engine supplies ---------------------------------------------------------------

    @abstractmethod
    def _execute(self, plan: BatchPlan, batch: BatchT) -> list[Any]:
        """Run every subtask of ``plan`` over the engine's ``batch``; one result row each
        (:data:`~keyedstate.runtime.wire.REPORT_SCHEMA`)."""

    @abstractmethod
    def _commit_output(self, context: ContextT, storage: CheckpointStorage,
                       props: Mapping[str, str]) -> None:
        """Hand the output a checkpoint (its ``props``) staged in ``storage`` to its
        consumers; idempotent by batch id. ``context``: what the engine passed along."""

    @abstractmethod
    def _late_schema(self) -> pa.Schema:
        """The schema of late rows (the input's)."""

    def _tasks(self, batch: BatchT) -> int | None:
        """The Spark tasks that run the batch's subtasks (None: one per subtask)."""
        return None

    def _failure(self, exc: Exception, batch_id: int) -> BaseException | None:
        """What a failed batch raises instead of ``exc`` (None: ``exc`` itself)."""
        return None

    def _checkpoint_properties(self) -> Mapping[str, str]:
        """Properties every checkpoint of the engine records besides the loop's."""
        return {}

    def _tolerable_failures(self) -> int:
        """How often a batch failing on transient storage errors is run again."""
        return 0

    def _cleaner(self) -> Cleaner | None:
        """Where the clean-ups after a commit go off the batch's path (None: they run on it;
        the asynchronous mode has one, :mod:`keyedstate.runtime.async_loop`)."""
        return None

    def _no_async_upload(self) -> str | None:
        """Why the engine can't run the asynchronous mode (docs/checkpoints.md), None if it
        can."""
        return type(self).__name__

    # -- one batch -----------------------------------------------------------------------------

    def _plan(self, batch_id: int, checkpoint_id: int, *, drain: bool = False,
              spark_tasks: int | None = None) -> BatchPlan:
        """Step 2: what every subtask of batch ``batch_id`` gets."""
        cfg = self.config
        return BatchPlan(
            job_id=self.storage.url, start_id=self.start_id, batch_id=batch_id,
            checkpoint_id=checkpoint_id, parallelism=cfg.parallelism, spark_tasks=spark_tasks,
            max_parallelism=self.max_parallelism, key_columns=self.key_columns,
            key_types=self.key_types, backend=self.backend, storage=self.storage,
            function=self.function, output_schema=self.output_schema,
            side_output_schemas=side_output_schemas(self.side_outputs, cfg.late_events,
                                                    self._late_schema()),
            watermark=self.watermark, watermark_column=cfg.watermark_column,
            late_events=cfg.late_events, restore=self.base,
            share_restored_files=self.share_restored_files, drain=drain,
            local_dir=cfg.local_dir, drop_states=cfg.drop_states,
            background_catch_up=cfg.catches_up_in_background,
            background_restore=cfg.background_restore,
            background_prefetch=cfg.prefetches_in_background, async_upload=cfg.async_upload,
            ack_timeout_s=cfg.checkpoint_timeout.total_seconds())

    def _run_batch(self, batch: BatchT, batch_id: int, *, started: float, drain: bool = False,
                   context: ContextT) -> BatchStats:
        """Steps 1-7 of batch ``batch_id`` over the engine's ``batch`` (``started``: its
        ``perf_counter`` start); returns its statistics. ``context`` goes to
        :meth:`_commit_output`."""
        tolerable = self._tolerable_failures()
        for attempt in range(1, tolerable + 2):
            try:
                completed, reports, tasks = self._checkpoint(batch, batch_id, drain=drain)
                break
            except Exception as exc:
                if attempt > tolerable or not is_transient_failure(exc):
                    raise
                delay = self.storage.transfer.backoff(attempt)
                task = find_task_failure(exc)
                log.warning("batch %s: checkpoint failed on transient storage errors (%s); "
                            "running the batch again in %.1f s (attempt %d of %d)", batch_id,
                            (task.describe() if task is not None else None) or exc, delay,
                            attempt + 1, tolerable + 1)
                time.sleep(delay)
        # Step 6. The checkpoint is complete: from here on only the commit is retried.
        self._commit_with_retries(context, completed, fresh=True)
        # Step 7.
        stats = self._stats(batch_id, completed, reports, started)
        stats.attempts = attempt
        stats.spark_tasks = tasks or 0
        return stats

    def _checkpoint(self, batch: BatchT, batch_id: int, *, drain: bool = False
                    ) -> tuple[CompletedCheckpoint, list[SubtaskReport], int | None]:
        """Steps 1-5: returns the completed checkpoint, the subtasks' reports in subtask
        order and the Spark tasks used. A failure aborts the checkpoint (the loop's state is
        then as before the call)."""
        # Step 1. Trigger.
        pending = self.coordinator.trigger({BATCH_ID: str(batch_id)})
        # Step 2. Plan.
        tasks = self._tasks(batch)
        plan = self._plan(batch_id, pending.checkpoint_id, drain=drain, spark_tasks=tasks)
        try:
            # Step 3. Execute.
            reports = decode_reports(self._execute(plan, batch))
            # Step 4. Acknowledge and complete the checkpoint.
            completed, ordered, watermark = complete_batch(
                self.coordinator, pending, reports, parallelism=self.config.parallelism,
                batch_id=batch_id, watermark=self.watermark,
                watermark_delay_ms=self.config.watermark_delay_ms, drain=drain,
                key_columns=self.key_columns, lineage=self.lineage, config=self.config,
                function=function_name(self.function), extra=self._checkpoint_properties())
        except BaseException as exc:
            if not pending.is_completed:
                self.coordinator.abort(pending, f"batch {batch_id} failed: {exc}")
            failure = self._failure(exc, batch_id) if isinstance(exc, Exception) else None
            if failure is not None:
                raise failure from exc
            raise
        # Step 5. Advance.
        self.watermark = watermark
        self.last_batch_id = batch_id
        self.drained = drain
        self.base = RestoreSource.of(self.storage, completed.metadata, own=True)
        self.share_restored_files = True
        return completed, ordered, tasks

    def _commit_with_retries(self, context: ContextT, completed: CompletedCheckpoint, *,
                             fresh: bool = False) -> None:
        """Step 6, retrying transient storage errors (the commit is idempotent by batch id)
        as often as a failed checkpoint would be. ``fresh``: :meth:`_commit_sinks`'s, for the
        first attempt only (a failed one may have written the marker)."""
        tolerable = self._tolerable_failures()
        for attempt in range(1, tolerable + 2):
            try:
                self._commit_sinks(context, completed, fresh=fresh and attempt == 1)
                return
            except TransientStorageError as exc:
                if attempt > tolerable:
                    raise
                delay = self.storage.transfer.backoff(attempt)
                log.warning("checkpoint %d is complete, committing its output failed on "
                            "transient storage errors (%s); committing again in %.1f s "
                            "(attempt %d of %d)", completed.checkpoint_id, exc, delay,
                            attempt + 1, tolerable + 1)
                time.sleep(delay)

    def _commit_sinks(self, context: ContextT, completed: CompletedCheckpoint, *,
                      fresh: bool = False) -> None:
        """Step 6: commit a completed checkpoint's output (skipped when its marker says that
        happened), then write the marker and drop the staged files. ``fresh``: this loop
        completed the checkpoint and nothing tried its commit yet, so its marker is not asked
        for (no request): the marker names the checkpoint's id, which is new (a coordinator
        never reuses one, recovery continues above every id used), and only this loop
        commits it."""
        # A claimed snapshot staged nothing: its output is not this job's to commit. Its own
        # job committed it, or this job did at start from the copy the snapshot carried;
        # committing "nothing" for its batch on a replay would replace that output.
        if not output_pending(self.storage, completed, marker_known_missing=fresh):
            return
        self._committing = completed.checkpoint_id
        try:
            self._commit_output(context, self.storage, completed.metadata.properties)
            mark_output_committed(self.storage, self.coordinator, completed,
                                  cleaner=self._cleaner())
        finally:
            self._committing = None

    def _stats(self, batch_id: int, completed: CompletedCheckpoint,
               results: list[SubtaskReport], started: float) -> BatchStats:
        return batch_stats(results, completed, watermark=self.watermark,
                           duration_s=time.perf_counter() - started)


def is_transient_failure(exc: BaseException) -> bool:
    """Whether a failed batch failed on storage errors a later run may not meet: a
    :class:`TransientStorageError` raised here or in a subtask."""
    if isinstance(exc, TransientStorageError):
        return True
    task = find_task_failure(exc)
    return task is not None and task.error == TransientStorageError.__name__


def write_savepoint(source: ResolvedSnapshot, target: str,
                    storage_options: Mapping[str, Any] | None,
                    fmt: SnapshotFormat | str = SnapshotFormat.NATIVE,
                    attach: Attach | None = None) -> str:
    """A savepoint of ``source`` in ``target``, native (its files duplicated,
    :func:`~keyedstate.checkpoint.savepoint.write_native_savepoint`) or canonical (rewritten,
    :func:`~keyedstate.processor.canonical.write_canonical_savepoint`), with ``attach``'s job
    context; returns the path or URL of its ``_metadata``."""
    if SnapshotFormat(str(fmt).lower()) is SnapshotFormat.NATIVE:
        return write_native_savepoint(source, target, storage_options, attach=attach)
    from keyedstate.processor.canonical import write_canonical_savepoint

    return write_canonical_savepoint(source, target, storage_options, attach=attach)

