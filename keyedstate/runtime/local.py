"""The local runtime: a keyed job in this process, without Spark or Java.

:class:`LocalJob` runs a :class:`~keyedstate.runtime.function.KeyedProcessFunction` exactly as
the Spark runtime does (the same start-up, routing, subtask code, checkpoints and snapshots),
one checkpoint per batch; tests, the demo (``keyedstate demo --local``) and users testing a job
use it. :class:`LocalKeyedOperator` is the older, lower-level form (``fn(backend, key, value)``
over raw backends), kept for the tests and benchmarks that drive backends directly. Imports no
pyspark.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import pyarrow as pa

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from keyedstate.checkpoint.properties import BATCH_ID, DRAINED, RESTORED_FROM
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.checkpoint.savepoint import check_savepoint_target, write_native_savepoint
from keyedstate.config import JobConfig, RestoreMode, parse_restore_mode
from keyedstate.errors import ConfigurationError, JobDrainedError, NoCheckpointError
from keyedstate.keygroups import KeyGroupRange, check_parallelism, operator_index_for_key_group
from keyedstate.keys import KeySerializer
from keyedstate.runtime.async_loop import AsyncBatchLoop
from keyedstate.runtime.batch import (
    MAIN_OUTPUT,
    read_staged,
    side_output_schemas,
    staged_outputs,
)
from keyedstate.runtime.failures import batch_failure
from keyedstate.runtime.function import KeyedProcessFunction
from keyedstate.runtime.live_copies import release_live
from keyedstate.runtime.local_aggregation import aggregate_table, check_local_aggregation
from keyedstate.runtime.loop import write_savepoint
from keyedstate.runtime.startup import open_coordinator, start_job
from keyedstate.runtime.subtask import BatchPlan, process_group
from keyedstate.runtime.uploads import wait_for_job
from keyedstate.runtime.wire import KG_COLUMN, SUBTASK_COLUMN
from keyedstate.serde import to_arrow_schema, type_ddl
from keyedstate.state.ttl import TtlTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import SnapshotFormat
from keyedstate.storage.transfer import TransferOptions

ProcessFn = Callable[[KeyedStateBackend, Any, Any], None]


class LocalKeyedOperator:
    """``parallelism`` keyed backends in this process, with a checkpoint coordinator.

    Deprecated for jobs: run a :class:`KeyedProcessFunction` with :class:`LocalJob` (the same
    user contract as Spark). Kept for code that drives backends directly (tests, benchmarks).

    On construction it restores from the latest completed checkpoint in ``checkpoint_dir``
    (any fsspec URL) when there is one, at the given parallelism (rescaling if it changed).
    Otherwise, with ``restore_path``, it starts from that checkpoint or savepoint in
    ``restore_mode`` (:class:`~keyedstate.config.RestoreMode`, see
    :mod:`keyedstate.checkpoint.restore_modes`): every file of the snapshot is checked first
    (existence and size; checksums too on a local disk), then NO_CLAIM and LEGACY restore from
    it where it lies and their first checkpoint duplicates the restored files into this job's
    root (by the store itself: no upload), and CLAIM imports it as this job's first
    checkpoint. A job's own checkpoints always win over ``restore_path``; a job whose
    latest checkpoint lost its ``_metadata`` falls back to the newest complete one (a warning,
    and a line in ``coordinator.recovery_notes``), and one left with none raises
    :class:`~keyedstate.errors.MissingCheckpointFileError`: never an empty start. Without
    ``max_parallelism``, the state's is adopted. ``transfer`` tunes retries, parallel
    transfers, inlining, merging and the file cache (docs/object-storage.md). The storage is
    checked first: refused credentials or a missing bucket raise
    :class:`~keyedstate.errors.StorageAccessError` or
    :class:`~keyedstate.errors.StorageLocationError` before anything else happens.
    """

    def __init__(self, checkpoint_dir: str, *, key_types: Sequence[str],
                 backend: StateBackend | str = "rocksdb", parallelism: int = 2,
                 max_parallelism: int | None = None, num_retained: int = 1,
                 time_provider: TtlTimeProvider | None = None,
                 local_dir: str | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 restore_path: str | None = None,
                 restore_mode: RestoreMode | str = RestoreMode.NO_CLAIM,
                 transfer: TransferOptions | None = None) -> None:
        self.backend = load_backend(backend) if isinstance(backend, str) else backend
        self.parallelism = parallelism
        self.key_serializer = KeySerializer(list(key_types))
        self.storage = CheckpointStorage(checkpoint_dir, storage_options, transfer)
        self.time_provider = time_provider
        # None: the backends' default below the temp dir (one directory per process there,
        # removed with its process), not a new directory per operator that nothing removes.
        self.local_dir = local_dir
        self.num_retained = num_retained
        self.restore_mode = parse_restore_mode(restore_mode)
        # Steps 0-3 (runtime/startup.py): storage access, the restore snapshot (checked, then
        # claimed or kept), key groups, the coordinator; then the subtasks.
        start = start_job(self.storage, backend=self.backend.name,
                          key_types=self.key_serializer.type_strings, parallelism=parallelism,
                          max_parallelism=max_parallelism, num_retained=num_retained,
                          restore_path=restore_path, restore_mode=self.restore_mode,
                          storage_options=storage_options,
                          on_restore=lambda _: {RESTORED_FROM: str(restore_path)})
        self.max_parallelism = start.max_parallelism
        self.coordinator = start.coordinator
        #: the snapshot restored in NO_CLAIM or LEGACY mode, until the first checkpoint
        self.restored: ResolvedSnapshot | None = start.restored
        self.subtasks = self._open_subtasks()

    def _coordinator(self) -> CheckpointCoordinator:
        return open_coordinator(self.storage, backend=self.backend.name,
                                parallelism=self.parallelism,
                                max_parallelism=self.max_parallelism,
                                key_types=self.key_serializer.type_strings,
                                num_retained=self.num_retained)

    def _open_subtasks(self) -> list[KeyedStateBackend]:
        latest = self.coordinator.latest_completed
        handles = latest.metadata.handles if latest else ()
        storage, share = self.storage, True
        if latest is None and self.restored is not None:
            if self.restored.metadata.format is SnapshotFormat.CANONICAL:
                return self._load_canonical(self.restored)
            # NO_CLAIM / LEGACY: read the snapshot where it lies; reference none of its files.
            handles, storage, share = self.restored.metadata.handles, self.restored.storage, False
        return [
            self.backend.create_keyed_backend(KeyedStateBackendParameters(
                subtask_index=i,
                key_group_range=KeyGroupRange.of_operator(self.max_parallelism,
                                                          self.parallelism, i),
                max_parallelism=self.max_parallelism,
                key_serializer=self.key_serializer,
                restore_handles=handles,
                storage=storage,
                share_restored_files=share,
                time_provider=self.time_provider,
                local_dir=self.local_dir,
            ))
            for i in range(self.parallelism)
        ]

    def _load_canonical(self, snapshot: ResolvedSnapshot) -> list[KeyedStateBackend]:
        """Every subtask bulk-loaded from a canonical savepoint (any source backend)."""
        from keyedstate.processor.canonical import restore_canonical

        subtasks: list[KeyedStateBackend] = []
        try:
            for i in range(self.parallelism):
                subtasks.append(restore_canonical(
                    self.backend, snapshot, subtask_index=i,
                    key_group_range=KeyGroupRange.of_operator(self.max_parallelism,
                                                              self.parallelism, i),
                    max_parallelism=self.max_parallelism, key_serializer=self.key_serializer,
                    time_provider=self.time_provider, local_dir=self.local_dir))
        except BaseException:
            for sub in subtasks:
                sub.close()
            raise
        return subtasks

    def subtask_for(self, key: Any) -> tuple[KeyedStateBackend, int]:
        kg = self.key_serializer.key_group(key, self.max_parallelism)
        return self.subtasks[operator_index_for_key_group(self.max_parallelism,
                                                          self.parallelism, kg)], kg

    def process(self, records: Iterable[tuple[Any, Any]], fn: ProcessFn) -> None:
        """Call ``fn(backend, key, value)`` for each record with the key made current."""
        for key, value in records:
            sub, kg = self.subtask_for(key)
            sub.set_current_key(key, kg)
            fn(sub, key, value)

    def checkpoint(self, properties: dict[str, str] | None = None) -> CompletedCheckpoint:
        """Snapshot every subtask and commit the checkpoint (aborting it on any failure)."""
        pending = self.coordinator.trigger(properties)
        try:
            for sub in self.subtasks:
                result = sub.snapshot(pending.checkpoint_id,
                                      pending.location(sub.subtask_index))
                self.coordinator.acknowledge(pending, result.materialize())
            completed = self.coordinator.complete(pending)
        except BaseException:
            self.coordinator.abort(pending, "a subtask failed to snapshot")
            for sub in self.subtasks:
                sub.notify_checkpoint_aborted(pending.checkpoint_id)
            raise
        for sub in self.subtasks:
            sub.notify_checkpoint_complete(completed.checkpoint_id)
        # The job now depends on its own checkpoints only (NO_CLAIM's promise).
        self.restored = None
        return completed

    def savepoint(self, target: str) -> str:
        """A native savepoint of the latest completed checkpoint in ``target`` (see
        :func:`~keyedstate.checkpoint.savepoint.write_native_savepoint`); returns the path or
        URL of its ``_metadata``."""
        latest = self.coordinator.latest_completed
        if latest is None:
            raise NoCheckpointError(
                f"{self.storage.url} has no completed checkpoint yet: call checkpoint() first"
            )
        source = ResolvedSnapshot(self.storage, latest.metadata_path, latest.metadata)
        return write_native_savepoint(source, target, self.storage.storage_options)

    def rescale(self, parallelism: int) -> None:
        """Restore every subtask from the latest completed checkpoint at a new parallelism."""
        check_parallelism(parallelism, self.max_parallelism)
        self.close_subtasks()
        self.parallelism = parallelism
        self.coordinator = self._coordinator()
        self.subtasks = self._open_subtasks()

    def close_subtasks(self) -> None:
        for sub in self.subtasks:
            sub.close()
        self.subtasks = []

    def close(self) -> None:
        self.close_subtasks()

    def __enter__(self) -> LocalKeyedOperator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalJob(AsyncBatchLoop[pa.Table, None]):
    """A keyed job run in this process: the same :class:`KeyedProcessFunction` and
    :class:`~keyedstate.config.JobConfig` as on Spark, without Java (a user tests the job they
    run on Spark, a demo runs anywhere).

    ``LocalJob(fn, key_columns=["user_id"], input_schema="user_id string, ts timestamp,
    amount double", output_schema=..., side_outputs={...}, config=config)`` is Spark's
    ``key_by(df, "user_id").process(fn, output_schema, side_outputs)`` over a DataFrame of
    ``input_schema``, with ``config`` (a :class:`JobConfig` or its dotted keys). Each
    :meth:`process_batch` is one micro-batch and one checkpoint, as on Spark (the protocol is
    :class:`~keyedstate.runtime.loop.BatchLoop`'s; this class runs steps 1-2 in this process
    and delivers the output of step 4 to the caller):

    1. Trigger checkpoint N; for a function with a local aggregation, aggregate the rows per
       key with pyarrow (:func:`~keyedstate.runtime.local_aggregation.aggregate_table`, as
       Spark's JVM does); give every row its key group (:class:`KeySerializer`, the same
       ``pmod(xxhash64(key columns), maxP)`` as Spark) and its subtask ``kg * p // maxP``.
    2. Run every subtask with :func:`~keyedstate.runtime.subtask.process_subtask`, the code a
       Spark task runs (timers due at the watermark, late rows, the function key by key,
       staged output, snapshot), one after another in this process.
    3. Complete checkpoint N (:func:`~keyedstate.runtime.batch.complete_batch`: the watermark
       advances to the batch's largest event time less the delay).
    4. Read the staged output, mark it committed and return it, one table per output tag
       (``"main"``, the side outputs, ``"late-events"`` when late rows go to a side output).

    With ``keyedstate.checkpointing.async-upload: true`` (the asynchronous mode,
    docs/checkpoints.md) step 2 leaves the uploads to a background thread, and steps 3-4 run
    for checkpoint N during the call for batch N+1 (with the default
    ``max-concurrent-checkpoints`` 1): a call returns the output of the checkpoints it
    completed, in batch order; :meth:`flush`, :meth:`stop` and :meth:`drain` complete the
    rest. A failed upload raises :class:`~keyedstate.errors.CheckpointDiscardedError`: the
    batches after the last completed checkpoint are discarded, send them again. A call that
    raises may have committed earlier batches' output first: it is :attr:`last_outputs`.

    Start-up is :func:`~keyedstate.runtime.startup.start_job`: a job recovers its own latest
    checkpoint (at another parallelism: rescaling), else starts from
    ``execution.state-recovery.path`` in its claim mode, else from empty state (its own
    checkpoints win over a restore path); another job on the directory (other key columns,
    key types or states: :mod:`~keyedstate.runtime.identity`) and a job stopped with drain are
    refused, as on Spark.
    Snapshots are interchangeable with Spark's: a Spark job's savepoint restores here and one
    taken here restores on Spark (with ``keyedstate.state-recovery.source-positions: ignore``:
    a local job has no Spark source positions to carry). Batch ids continue those of the
    snapshot or checkpoint restored. Not here: Spark's sinks (the caller gets the output),
    retries of a failed batch (call :meth:`process_batch` again: its state is that of the last
    checkpoint), ``keyedstate.spark.tasks``.
    """

    def __init__(self, function: KeyedProcessFunction, *, key_columns: Sequence[str],
                 input_schema: Any, output_schema: Any,
                 side_outputs: Mapping[str, Any] | None = None,
                 config: JobConfig | Mapping[str, Any]) -> None:
        if not isinstance(function, KeyedProcessFunction):
            raise ConfigurationError("LocalJob needs a KeyedProcessFunction instance")
        self.function = function
        self.config = config if isinstance(config, JobConfig) else JobConfig.from_mapping(config)
        self.input_schema = to_arrow_schema(input_schema)
        self.key_columns = list(key_columns)
        missing = [c for c in [*self.key_columns, *filter(None, [self.config.watermark_column])]
                   if c not in self.input_schema.names]
        if not self.key_columns or missing:
            raise ConfigurationError(
                f"key columns {self.key_columns} and watermark column "
                f"{self.config.watermark_column!r} must be columns of the input; missing "
                f"{missing or 'a key column'}, the input's columns are {self.input_schema.names}")
        self.output_schema = to_arrow_schema(output_schema)
        self.side_outputs = {k: to_arrow_schema(v) for k, v in (side_outputs or {}).items()}
        cfg = self.config
        #: the function's local aggregation (its rows aggregated per key with pyarrow first)
        self.local_aggregation = check_local_aggregation(
            function, self.input_schema, self.key_columns,
            watermark_column=cfg.watermark_column, late_events=cfg.late_events)
        self.key_types = [type_ddl(self.input_schema.field(c).type) for c in self.key_columns]
        self.backend = load_backend(cfg.backend, **cfg.backend_options)
        self.storage = CheckpointStorage(cfg.checkpoint_dir, cfg.storage_options,
                                         cfg.transfer_options())
        self.lineage = {RESTORED_FROM: cfg.restore_path or ""}
        #: the outputs of the last batch (processed or drained)
        self.last_outputs: dict[str, pa.Table] = {}
        self._delivered: dict[str, pa.Table] = {}
        self.drained = False
        self._closed = False
        # Steps 0-3 (runtime/startup.py), then what the first batch resumes from; a local job
        # has no source positions: its batch ids continue the restored state's.
        self._start(self._claim_properties)
        self.key_serializer = KeySerializer(self.key_types)

    def _claim_properties(self, snapshot: ResolvedSnapshot) -> dict[str, str]:
        """The properties of the checkpoint a claimed snapshot becomes: this job's lineage,
        not drained, the snapshot's batch id (the job's batch ids continue from it)."""
        return {**self.lineage, DRAINED: "false",
                BATCH_ID: snapshot.metadata.properties.get(BATCH_ID, "-1")}

    # -- batches -------------------------------------------------------------------------------

    def process_batch(self, data: pa.Table | pa.RecordBatch | Iterable[Mapping[str, Any]]
                      ) -> dict[str, pa.Table]:
        """Run one micro-batch over ``data`` (a table or rows of the input schema) and
        checkpoint it (steps in the class docstring); returns its output per tag. A failure
        raises :class:`~keyedstate.errors.BatchFailedError` (a subtask's, naming the subtask
        and key) or the keyedstate error, and leaves the job at its last checkpoint."""
        if self.drained:
            raise JobDrainedError("the job was stopped with drain; it takes no more batches")
        return self._run(self._table(data), self.last_batch_id + 1, drain=False)

    def drain(self) -> dict[str, pa.Table]:
        """Flink's ``stop --drain``: a batch of its own without rows that sets the watermark
        to +infinity and fires every timer; returns its output. The job takes no more
        batches, and its last checkpoint says so (a restart from it is refused)."""
        if self.drained:
            raise JobDrainedError("the job was stopped with drain already")
        return self._run(self.input_schema.empty_table(), self.last_batch_id + 1, drain=True)

    def _table(self, data: pa.Table | pa.RecordBatch | Iterable[Mapping[str, Any]]
               ) -> pa.Table:
        schema = self.input_schema
        if isinstance(data, pa.RecordBatch):
            data = pa.Table.from_batches([data])
        if not isinstance(data, pa.Table):
            return pa.Table.from_pylist(list(data), schema=schema)
        missing = [n for n in schema.names if n not in data.column_names]
        if missing:
            raise ConfigurationError(f"the batch lacks the input columns {missing}; the input "
                                     f"schema is {schema}")
        return data.select(schema.names).cast(schema)

    def _route(self, table: pa.Table) -> pa.Table:
        """``table`` with each row's key group and subtask, as Spark's routing adds them."""
        p, max_p = self.config.parallelism, self.max_parallelism
        columns = [table.column(c).to_pylist() for c in self.key_columns]
        keys = columns[0] if len(columns) == 1 else list(zip(*columns))
        # Hashed once per distinct key (a batch holds each key many times; hashing in Python
        # cost half of a local batch).
        known: dict[Any, int] = {}
        key_group = self.key_serializer.key_group
        groups = [known[k] if k in known else known.setdefault(k, key_group(k, max_p))
                  for k in keys]
        return (table.append_column(KG_COLUMN, pa.array(groups, pa.int32()))
                     .append_column(SUBTASK_COLUMN,
                                    pa.array([kg * p // max_p for kg in groups], pa.int32())))

    def _run(self, table: pa.Table, batch_id: int, *, drain: bool) -> dict[str, pa.Table]:
        """One batch through the loop (:class:`~keyedstate.runtime.loop.BatchLoop`); the
        output committed meanwhile (the asynchronous mode: of the checkpoints completed), also
        kept as :attr:`last_outputs`, even when the call raises: in the asynchronous mode a
        failing call may have committed earlier batches' output first."""
        self._delivered = {}
        if not self.config.async_upload:
            self._run_batch(table, batch_id, started=time.perf_counter(), drain=drain,
                            context=None)
            return self._deliver()
        try:
            self._run_batch_async(table, batch_id, started=time.perf_counter(), drain=drain,
                                  context=None)
        finally:
            self._deliver()
        return self.last_outputs

    def _deliver(self) -> dict[str, pa.Table]:
        """What :meth:`_commit_output` delivered since :attr:`_delivered` was reset, one table
        per tag (empty for a tag without rows), kept as :attr:`last_outputs`."""
        self.last_outputs = {tag: self._delivered.get(tag, schema.empty_table())
                             for tag, schema in self._output_schemas().items()}
        return self.last_outputs

    def _output_schemas(self) -> dict[str, pa.Schema]:
        return {MAIN_OUTPUT: self.output_schema,
                **side_output_schemas(self.side_outputs, self.config.late_events,
                                      self.input_schema)}

    def flush(self) -> dict[str, pa.Table]:
        """Complete every checkpoint in flight (the asynchronous mode,
        ``keyedstate.checkpointing.async-upload``) and commit its output; returns that output,
        one table per tag (also :attr:`last_outputs`). Raises
        :class:`~keyedstate.errors.CheckpointDiscardedError` if one failed (the job is then at
        its last completed checkpoint; what was committed before is :attr:`last_outputs`).
        Nothing is in flight in the synchronous mode."""
        self._delivered = {}
        try:
            self._complete_in_flight(0)
        finally:
            self._deliver()
        return self.last_outputs

    def _execute(self, plan: BatchPlan, batch: pa.Table) -> list[Any]:
        """Steps 1-2 of the class docstring: every subtask, one after another in this
        process, as one Spark task running them all would; with a local aggregation, over
        the rows aggregated per key first (as Spark's JVM does)."""
        table: pa.Table = batch
        if self.local_aggregation is not None:
            table = aggregate_table(table, self.key_columns, self.local_aggregation,
                                    watermark=self.watermark,
                                    watermark_column=self.config.watermark_column)
        routed = self._route(table)
        return [row for result in process_group(plan, range(self.config.parallelism),
                                                iter(routed.to_batches()))
                for row in result.to_pylist()]

    def _commit_output(self, context: None, storage: CheckpointStorage,
                       props: Mapping[str, str]) -> None:
        """Step 4: read the staged output, one table per tag (the caller gets it; several
        batches' in one call in the asynchronous mode, in batch order)."""
        for tag, staged in staged_outputs(storage, props, self._output_schemas()).items():
            table = read_staged(staged)
            known = self._delivered.get(tag)
            self._delivered[tag] = table if known is None else pa.concat_tables([known, table])

    def _no_async_upload(self) -> str | None:
        return None

    def _late_schema(self) -> pa.Schema:
        return self.input_schema

    def _failure(self, exc: Exception, batch_id: int) -> BaseException | None:
        return batch_failure(exc, batch_id)

    # -- snapshots and stop --------------------------------------------------------------------

    @property
    def latest_checkpoint(self) -> CompletedCheckpoint | None:
        """The job's latest completed checkpoint (None before its first batch)."""
        return self.coordinator.latest_completed

    def savepoint(self, target: str, format: SnapshotFormat | str = SnapshotFormat.NATIVE
                  ) -> str:
        """A savepoint of the latest completed checkpoint in ``target`` (native or canonical,
        refused with :class:`~keyedstate.errors.SnapshotExistsError` where one exists);
        returns the path or URL of its ``_metadata``. The job keeps running. In the
        asynchronous mode the batches in flight are not in it: :meth:`flush` first (or
        ``stop(savepoint=...)``, which does)."""
        fmt = SnapshotFormat(str(format).lower())
        check_savepoint_target(CheckpointStorage(target, self.config.storage_options))
        latest = self.coordinator.latest_completed
        if latest is None:
            raise NoCheckpointError(
                "no checkpoint completed yet: nothing to take a savepoint of; process a batch "
                "first")
        source = ResolvedSnapshot(self.storage, latest.metadata_path, latest.metadata)
        return write_savepoint(source, target, self.config.storage_options, fmt)

    def stop(self, *, drain: bool = False, savepoint: str | None = None,
             format: SnapshotFormat | str = SnapshotFormat.NATIVE) -> str | None:
        """Stop the job, as Spark's ``KeyedQuery.stop``: with ``drain``, fire every timer first
        (:meth:`drain`; its output is :attr:`last_outputs`); in the asynchronous mode without
        drain, complete the checkpoints in flight first (:meth:`flush`; their output is
        :attr:`last_outputs`); with ``savepoint``, take one there (after the drain, if both)
        and return its ``_metadata`` path. Then close."""
        if savepoint:
            check_savepoint_target(CheckpointStorage(savepoint, self.config.storage_options))
        try:
            if drain:
                self.drain()
            elif self.config.async_upload:
                self.flush()
            return self.savepoint(savepoint, format) if savepoint else None
        finally:
            self.close()

    def close(self) -> None:
        """Close the subtasks' live state in this process (idempotent); the checkpoints stay.
        In the asynchronous mode the checkpoints in flight are not completed (call
        :meth:`stop` or :meth:`flush` for that): close waits for this process's uploads and
        leaves them incomplete, as a crash would; the next start resumes from the last
        completed checkpoint."""
        if not self._closed:
            self._closed = True
            wait_for_job(self.storage.url)
            self._wait_for_cleanups()
            release_live(self.storage.url, self.start_id)

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
