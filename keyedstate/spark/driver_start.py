"""The Spark driver's start-up (:class:`SparkJobStart`, the base of
:class:`~keyedstate.spark.driver.KeyedJobDriver`): the job start-up every runtime shares
(:mod:`keyedstate.runtime.startup`, through the loop) with the driver's own steps on the
job's Spark query (:mod:`keyedstate.spark.query_log`): a restored snapshot's source positions
and carried output, the claimed checkpoint's properties, the query a restart finds checked,
and Spark's log rewound after a crash in the asynchronous mode."""

from __future__ import annotations

from typing import TYPE_CHECKING

from keyedstate.checkpoint.coordinator import CompletedCheckpoint
from keyedstate.checkpoint.properties import BATCH_ID, DRAINED, RESTORED_FROM
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.runtime.async_loop import AsyncBatchLoop
from keyedstate.runtime.batch import ResumePoint, output_pending
from keyedstate.runtime.startup import JobStart
from keyedstate.runtime.subtask import RestoreSource
from keyedstate.spark.carry import output_committed
from keyedstate.spark.offsets import PROP_QUERY_ID, PROP_SPARK_CHECKPOINT_LOCATION, Branch
from keyedstate.spark.query_log import QueryLog, async_bound, mark_async_start

if TYPE_CHECKING:  # the job (api) builds its driver
    # Used in the base class's quoted arguments, which ruff does not read.
    from pyspark.sql import DataFrame  # noqa: F401

    from keyedstate.spark.api import KeyedProcessJob
    from keyedstate.spark.pyspark_types import Session  # noqa: F401


class SparkJobStart(AsyncBatchLoop["DataFrame", "Session"]):
    """The start-up of the Spark engine of the batch loop (module docstring); its subclass
    :class:`~keyedstate.spark.driver.KeyedJobDriver` sets :attr:`job` and
    :attr:`spark_checkpoint_location` (besides what :class:`~keyedstate.runtime.async_loop.
    AsyncBatchLoop` needs) and calls :meth:`_open`."""

    job: KeyedProcessJob
    #: where Spark keeps the source offsets: batch ids are comparable only within it
    spark_checkpoint_location: str
    #: the job's Spark query, as its offset log records it
    query_log: QueryLog
    #: the batch a restored snapshot's source positions resume after (-1: none)
    _resumed_batch: int
    #: the bound the job's asynchronous marker records, once read (:meth:`_marked_bound`)
    _marked: int | None

    def _open(self) -> None:
        """Recover from the job's own checkpoints, else start from the configured snapshot in
        its restore mode (:mod:`keyedstate.checkpoint.restore_modes`), else from empty state.

        Step 0b. A directory holding checkpoints: the job must be the one that wrote them
            (key types, key columns, states; :class:`~keyedstate.errors.JobMismatchError`
            unless ``keyedstate.state-recovery.allow-job-change``); its own checkpoints then
            win over any restore path.
        Step 1. A new job with ``execution.state-recovery.path``: check the snapshot, reading
            only (max parallelism, not claimed by another job, every file's size and
            checksum); restore its source positions
            (:meth:`~keyedstate.spark.query_log.QueryLog.resume`: Spark resumes
            exactly after the snapshot's batch, or the start is refused); commit the output
            it carries (a savepoint of a batch whose sinks had not committed); CLAIM then
            imports it as this job's first checkpoint.
        Step 2. Max parallelism: configured, else the state's (as Flink), else the default.
        Step 3. The job's own checkpoints: recover from the latest complete one (drain
            checked, its lineage kept; a fall-back past a lost or corrupt ``_metadata`` is in the coordinator's
            ``recovery_notes``). A job that completed checkpoints but has none left raises
            :class:`~keyedstate.errors.MissingCheckpointFileError` here, as the core runtime
            does; a gap in batch ids after a fall-back is refused per batch
            (:meth:`_check_continuity`); a Spark checkpoint location that no longer holds the
            query whose batches the checkpoints cover is refused
            (:meth:`~keyedstate.spark.query_log.QueryLog.check_query`).
        Step 3b. Spark's log ahead of the job's state after a crash in the asynchronous mode:
            rewound (:meth:`_rewind_source`).
        Step 4. NO_CLAIM / LEGACY: restore from the snapshot where it lies; the first
            checkpoint references none of the snapshot's files: the executors have the store
            duplicate them into this job's root (no upload), then build on the copies.

        Steps 0-3 are :func:`keyedstate.runtime.startup.start_job`, as in the local runtime.
        Before all (its step 0): the checkpoint storage must accept the job's credentials and exist
        (:meth:`~keyedstate.storage.checkpoint_storage.CheckpointStorage.check_access`), so a wrong key
        or a missing bucket fails the start, not the first batch.
        """
        cfg = self.config
        self.base: RestoreSource | None = None
        self.share_restored_files = True
        self.lineage = {RESTORED_FROM: cfg.restore_path or "",
                        PROP_SPARK_CHECKPOINT_LOCATION: self.spark_checkpoint_location}
        #: the job's Spark query, as its offset log records it
        self.query_log = QueryLog(self.spark_checkpoint_location, cfg.storage_options)
        self._resumed_batch = -1
        self._marked: int | None = None
        # Steps 1-3 (runtime/startup.py, through the loop), with this driver's own steps on
        # the snapshot (_on_restore) before it is claimed; then step 3 (the recovered
        # checkpoint's lineage and drain checked) or step 4 (NO_CLAIM / LEGACY: the first
        # checkpoint references none of the snapshot's files, the backends duplicate them
        # into this job's root instead).
        start = self._start(self._on_restore)
        if start.recovered:
            latest = self.coordinator.latest_completed
            assert latest is not None
            self.query_log.check_query(latest.metadata.properties, cfg.checkpoint_dir)
        self._rewind_source(start)

    def _rewind_source(self, start: JobStart) -> None:
        """Step 3b: a crash in the asynchronous mode may have left Spark's log ahead of the
        job's state (the recovered checkpoint, or the snapshot it was restored from, or
        none): :meth:`~keyedstate.spark.query_log.QueryLog.rewind`, when the job's marker or
        that checkpoint says it ran asynchronously (whatever this start's mode). Then, if
        this start is asynchronous, its own marker, before any batch of it runs
        (:func:`~keyedstate.spark.query_log.mark_async_start`)."""
        if not self.spark_checkpoint_location:
            return
        latest = self.coordinator.latest_completed if start.recovered else None
        covered = int(latest.metadata.properties.get(BATCH_ID, -1)) if latest is not None \
            else self._resumed_batch
        bound = max(self._marked_bound(), async_bound(None, latest))
        self.query_log.rewind(covered, bound, latest, self._commit_if_pending)
        if self.config.async_upload \
                and self._marked_bound() < self.config.max_concurrent_checkpoints:
            mark_async_start(self.storage, self.config.max_concurrent_checkpoints)

    def _marked_bound(self) -> int:
        """:func:`~keyedstate.spark.query_log.async_bound` of the job's marker, read once."""
        if self._marked is None:
            self._marked = async_bound(self.storage, None)
        return self._marked

    def _commit_if_pending(self, completed: CompletedCheckpoint) -> None:
        """Commit a completed checkpoint's output unless its marker says that happened."""
        if output_pending(self.storage, completed):
            self._commit_with_retries(self.job.stream.dataframe().sparkSession, completed)

    def _resumed_batch_id(self, start: JobStart, point: ResumePoint) -> int:
        """Batch ids: the recovered checkpoint's; a restored snapshot's only as far as its
        source positions were restored in this job's offset log
        (:meth:`~keyedstate.spark.query_log.QueryLog.resume`)."""
        return point.batch_id if start.recovered else self._resumed_batch

    def _on_restore(self, snap: ResolvedSnapshot) -> dict[str, str]:
        """Step 1, the driver's part, on the checked snapshot a new job starts from: restore
        its source positions (:meth:`~keyedstate.spark.query_log.QueryLog.resume`), commit
        the output it carries
        (:meth:`_commit_carried_output`); returns the properties of the checkpoint it becomes
        if claimed (:meth:`_claim_properties`)."""
        self._resumed_batch = self.query_log.resume(
            snap, self.config, [sink for sinks in self.job.sinks.values() for sink in sinks],
            ahead=self._marked_bound())
        self._commit_carried_output(snap)
        return self._claim_properties(snap, self._resumed_batch)

    def _claim_properties(self, snap: ResolvedSnapshot, batch_id: int) -> dict[str, str]:
        """Properties of the checkpoint a claimed snapshot becomes: this job's lineage, not
        drained (a drained job's savepoint starts a new job), the batch id it covers in this
        job's offset log (:meth:`~keyedstate.spark.query_log.QueryLog.resume`) and that log's
        query (the snapshot's, or
        a new branch's with its parent)."""
        if batch_id < 0:
            return {**self.lineage, DRAINED: "false", BATCH_ID: str(batch_id),
                    PROP_QUERY_ID: ""}
        return {**self.lineage, DRAINED: "false", BATCH_ID: str(batch_id),
                **self.query_log.properties()}

    def _commit_carried_output(self, snap: ResolvedSnapshot) -> None:
        """Commit the output a snapshot carries: staged output of its batch whose sinks were
        not known to have committed it when the savepoint was taken (idempotent, as every
        sink commit)."""
        if not output_committed(snap):
            self._commit_output(self.job.stream.dataframe().sparkSession, snap.storage,
                                snap.metadata.properties)

    def query_id(self) -> str:
        """The id of the Spark query whose batch ids this job's batches carry
        (:meth:`~keyedstate.spark.query_log.QueryLog.query_id`)."""
        return self.query_log.query_id()

    def branch(self) -> Branch | None:
        """The lineage branch this job's query is, None for a query Spark started itself
        (:meth:`~keyedstate.spark.query_log.QueryLog.branch`)."""
        return self.query_log.branch()
