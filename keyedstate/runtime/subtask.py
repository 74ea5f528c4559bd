"""What runs in an executor: one subtask of one micro-batch (a Spark task of ``mapInArrow``).

A Spark task runs one subtask, or a contiguous group of them one after another when the job
has more subtasks than the cluster has task slots (``keyedstate.spark.tasks``): Spark's fixed
cost per task (~50-80 ms here, mostly handing the task to a Python worker) is then paid once
per slot, not once per subtask. Steps of each subtask (:func:`process_subtask`), in order (the
driver's side is :mod:`keyedstate.runtime.loop`):

1. Get the subtask's state at the last committed checkpoint: the live copy this Python worker
   holds if this start of the job made it and it is exactly that version (same snapshot
   token); else that copy caught up with
   what later checkpoints wrote when its backend can (``KeyedStateBackend.catch_up``: Spark
   ran the subtask's last tasks in another worker, the copy is older but on the same chain);
   else a restore from checkpoint storage (rescaling when the parallelism changed). A copy
   that can't catch up is closed, never used.
2. Fire timers due at the batch's watermark (event time) and now (processing time): the
   watermark advanced at the end of the previous batch, as Flink fires timers when a
   watermark arrives after the elements before it.
3. Split late rows (event time before the watermark) off: counted, dropped or side output.
4. Run the function key by key over the rows (grouped by key, arrival order kept:
   :mod:`keyedstate.runtime.grouping`), or, for a function overriding ``process_batch``, once
   over all of them (:class:`KeyedBatch`).
5. Check the outputs against their schemas (:mod:`keyedstate.runtime.output`) and stage them
   as Parquet files under the checkpoint directory (not yet visible).
6. Snapshot the state and keep the live copy for the next batch
   (:mod:`keyedstate.runtime.live_copies`). The synchronous mode runs the synchronous part,
   then the upload (Flink's "asynchronous" part) here, in the task: the batch waits for it.
   The asynchronous mode (``BatchPlan.async_upload``) runs only the synchronous part here and
   hands the upload to the process's uploader (:mod:`keyedstate.runtime.uploads`), which
   acknowledges it in storage; a copy reused on a checkpoint still in flight first waits for
   its own upload of it (docs/checkpoints.md, "The asynchronous phase").
7. Return one row: the subtask's report (:mod:`keyedstate.runtime.wire`): the snapshot
   handle (None in the asynchronous mode), staged files, max event time, counts and timings.

Nothing here is visible to readers until the driver commits the checkpoint and the sinks.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.checkpoint.properties import MAX_WATERMARK, tokens_of
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.config import LATE_EVENTS_TAG, LateEvents
from keyedstate.errors import BatchFailedError, CheckpointError, OutputSchemaError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.runtime.event_time import event_time_ms
from keyedstate.runtime.failures import NO_KEY, subtask_failed
from keyedstate.runtime.function import Context, KeyedProcessFunction, Output
from keyedstate.runtime.gc_freeze import collection_paused, freeze_survivors, thaw
from keyedstate.runtime.grouping import keyed_batch, sort_by_key
from keyedstate.runtime.live_copies import (
    LiveCopy,
    close_live,
    keep_live,
    stop_background_catch_up,
    take_live,
)
from keyedstate.runtime.local_aggregation import local_aggregation_of, split_aggregated
from keyedstate.runtime.output import Emitter, rows_to_table
from keyedstate.runtime.uploads import (
    StagedFile,
    fetch_acks,
    submit,
    wait_for,
    wait_for_subtask,
)
from keyedstate.runtime.wire import (
    KG_COLUMN,
    SUBTASK_COLUMN,
    WIRE_VERSION,
    SubtaskFigures,
    SubtaskReport,
    report_batch,
)
from keyedstate.state.timers import TimeDomain
from keyedstate.state.ttl import SystemTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata, KeyedStateHandle, SnapshotFormat
from keyedstate.storage.layout import METADATA_FILE, staging_dir


@dataclass(frozen=True)
class RestoreSource:
    """The committed snapshot a batch starts from: where to read it and its handles."""

    checkpoint_id: int
    storage: CheckpointStorage
    handles: list[KeyedStateHandle]
    parallelism: int
    #: per subtask index, the token of the snapshot that subtask produced (reuse check)
    tokens: list[str] | None
    #: the snapshot's metadata when it is a canonical savepoint (bulk-loaded, not restored
    #: from backend files); None for native snapshots
    canonical: CheckpointMetadata | None = None
    #: the job's checkpoint ``checkpoint_id`` is in flight (asynchronous mode): ``handles`` is
    #: empty; a subtask reuses its live copy of ``tokens`` or restores from its ack
    pending: bool = False

    @classmethod
    def of(cls, storage: CheckpointStorage, metadata: CheckpointMetadata, own: bool
           ) -> RestoreSource:
        """What the next batch's subtasks restore from: the job's own checkpoint (``own``: its
        subtasks' tokens let a worker reuse the live copy of exactly that version) or the
        snapshot a new job started from."""
        tokens = tokens_of(metadata.properties) if own else None
        # A canonical savepoint travels whole: each subtask bulk-loads its key groups from it.
        canonical = metadata if metadata.format is SnapshotFormat.CANONICAL else None
        return cls(metadata.checkpoint_id, storage, list(metadata.handles),
                   metadata.parallelism, tokens, canonical)

    @classmethod
    def in_flight(cls, storage: CheckpointStorage, checkpoint_id: int, parallelism: int,
                  tokens: list[str]) -> RestoreSource:
        """The job's own checkpoint ``checkpoint_id``, still in flight (its subtasks'
        ``tokens``, no handles yet)."""
        return cls(checkpoint_id, storage, [], parallelism, tokens, pending=True)


@dataclass(frozen=True)
class BatchPlan:
    """Everything a subtask needs for one batch; pickled into the task closure."""

    job_id: str
    #: the start of the job this batch belongs to (:attr:`~keyedstate.runtime.startup.
    #: JobStart.start_id`): live copies of another start are never used
    start_id: str
    batch_id: int
    checkpoint_id: int
    parallelism: int
    max_parallelism: int
    key_columns: list[str]
    key_types: list[str]
    backend: StateBackend
    storage: CheckpointStorage
    function: KeyedProcessFunction
    output_schema: pa.Schema
    side_output_schemas: dict[str, pa.Schema]
    watermark: int
    watermark_column: str | None
    late_events: LateEvents
    restore: RestoreSource | None
    share_restored_files: bool
    drain: bool = False
    local_dir: str | None = None
    #: Spark tasks running the subtasks (:func:`subtasks_of_task`); None: one per subtask
    spark_tasks: int | None = None
    #: restored states to drop (``JobConfig.drop_states``)
    drop_states: tuple[str, ...] = ()
    #: after its task, the worker catches its other copies of the job up with this batch's
    #: checkpoint in the background (``JobConfig.background_catch_up``; the Spark runtime)
    background_catch_up: bool = False
    #: ... and restores those that can't catch up (``JobConfig.background_restore``)
    background_restore: bool = False
    #: in the asynchronous mode, after its task, the worker prefetches the files of this
    #: batch's checkpoint that its stale copies lack (``JobConfig.background_prefetch``;
    #: :mod:`keyedstate.runtime.prefetch`)
    background_prefetch: bool = False
    #: the asynchronous mode (``JobConfig.async_upload``): step 6 hands the upload to the
    #: process's uploader (:mod:`keyedstate.runtime.uploads`) and reports no handle
    async_upload: bool = False
    #: how long a subtask waits for the acknowledgement it restores from
    #: (``JobConfig.checkpoint_timeout``)
    ack_timeout_s: float = 600.0

    @property
    def tasks(self) -> int:
        """Spark tasks the subtasks run in."""
        return self.spark_tasks or self.parallelism

    @property
    def largest_group(self) -> int:
        """The most subtasks one Spark task runs."""
        return -(-self.parallelism // self.tasks)


#: How a subtask got its state (step 1): its live copy as it was, its live copy caught up
#: with later checkpoints, or a restore (or empty state for a new job).
REUSED, CAUGHT_UP, RESTORED = "reused", "caught-up", "restored"


class Acquired(NamedTuple):
    """A subtask's state before its batch (step 1)."""

    backend: KeyedStateBackend
    #: ``REUSED``, ``CAUGHT_UP`` or ``RESTORED``
    how: str
    #: seconds the batch spent getting it (0 when reused)
    restore_s: float
    #: seconds this worker spent catching the reused copy up in the background before the
    #: batch (:func:`~keyedstate.runtime.live_copies.catch_up_in_background`), off its path
    background_s: float = 0.0


def _acquire(plan: BatchPlan, index: int) -> Acquired:
    """The subtask's backend at the last committed checkpoint and how it got it; the states of
    ``drop_states`` are dropped from a restored one (a live copy, of the same job, dropped
    them when it was restored)."""
    acquired = _restore(plan, index)
    if acquired.how == RESTORED:
        _drop_states(plan, acquired.backend)
    return acquired


def _drop_states(plan: BatchPlan, backend: KeyedStateBackend) -> None:
    """Drop ``plan.drop_states`` from a restored ``backend`` (closed if that fails)."""
    try:
        for name in plan.drop_states:
            backend.drop_state(name)
    except BaseException:
        backend.close()
        raise


def restorer(plan: BatchPlan
             ) -> Callable[[int, int, Sequence[KeyedStateHandle]], KeyedStateBackend]:
    """For the background catch-up (:mod:`keyedstate.runtime.live_copies`) of a copy whose
    backend can't catch up (RocksDB): subtask ``index``'s backend restored from ``handles``
    of checkpoint ``checkpoint_id``, a later checkpoint of ``plan``'s job at the same
    parallelism (a committed one's handles, or the subtask's acknowledged one of a checkpoint
    in flight), exactly as step 1 restores it."""
    def restore(index: int, checkpoint_id: int, handles: Sequence[KeyedStateHandle]
                ) -> KeyedStateBackend:
        src = RestoreSource(checkpoint_id, plan.storage, list(handles), plan.parallelism, None)
        backend = _restored(replace(plan, restore=src), index)
        _drop_states(plan, backend)
        return backend

    return restore


def _restore(plan: BatchPlan, index: int) -> Acquired:
    live = take_live(plan.job_id, index, plan.start_id)
    src = plan.restore
    same_layout = (live is not None and src is not None and src.canonical is None
                   and src.parallelism == plan.parallelism
                   and live.parallelism == plan.parallelism)
    if (live is not None and same_layout and src is not None and src.tokens is not None
            and index < len(src.tokens) and src.tokens[index] == live.token):
        if not src.pending:  # a checkpoint in flight is confirmed at step 6 (_confirm_in_flight)
            live.backend.notify_checkpoint_complete(src.checkpoint_id)
        return Acquired(live.backend, REUSED, 0.0, live.caught_up_s)
    start = time.perf_counter()
    if live is not None:
        # Not reused as it is: an upload of it still running must end before it may change
        # or close (runtime.uploads).
        wait_for_subtask(plan.job_id, index)
    if src is not None and src.pending:
        # A checkpoint in flight: never a state older than it. Its ack has the handle, and a
        # copy that can catch up applies what was written since it, as from a completed one
        # (its next snapshot builds on the checkpoint in flight, as a reused copy's does:
        # discarded with it if it fails); any other is closed and the state restored.
        try:
            src = _acknowledged(plan, src, index)
        except BaseException:
            if live is not None:
                close_live(live)
            raise
    if live is not None:
        try:
            if same_layout and src is not None \
                    and live.backend.catch_up(src.handles, src.storage):
                return Acquired(live.backend, CAUGHT_UP, time.perf_counter() - start)
        except BaseException:
            close_live(live)  # possibly half caught up: never used again
            raise
        close_live(live)  # uncommitted, or on another chain: never used
    return Acquired(_restored(replace(plan, restore=src), index), RESTORED,
                    time.perf_counter() - start)


def _acknowledged(plan: BatchPlan, src: RestoreSource, index: int) -> RestoreSource:
    """``src`` (a checkpoint in flight) with subtask ``index``'s handle from its
    acknowledgement, once this process's upload of it (if it made it) is done. Without the
    acknowledgement the subtask fails: a state older than the checkpoint would be wrong."""
    # This process's upload of it ends first; one by another process (Spark placed the
    # subtask elsewhere) is read at once, or polled for until written.
    wait_for(plan.job_id, index, src.checkpoint_id)
    ack, = fetch_acks(src.storage, src.checkpoint_id, [index], plan.ack_timeout_s)
    if ack is None or ack.handle is None:
        why = "is not written" if ack is None else f"says the upload failed: {ack.error}"
        raise CheckpointError(
            f"subtask {index} must restore checkpoint {src.checkpoint_id}, still in flight, "
            f"but its acknowledgement {why}; the batch fails and the job goes back to its last "
            f"completed checkpoint")
    return replace(src, handles=[ack.handle], pending=False)


def _confirm_in_flight(plan: BatchPlan, index: int, backend: KeyedStateBackend, how: str
                       ) -> None:
    """Before the synchronous phase of a copy reused on a checkpoint in flight: wait for this
    process's upload of it (ahead in the uploader's queue), then tell the copy the checkpoint
    is complete, so its next incremental snapshot builds on it. Optimistic and safe: a later
    checkpoint completes only after it, and is discarded with it if it fails."""
    src = plan.restore
    if src is None or not src.pending or how != REUSED:
        return
    wait_for(plan.job_id, index, src.checkpoint_id)
    backend.notify_checkpoint_complete(src.checkpoint_id)


def _restored(plan: BatchPlan, index: int) -> KeyedStateBackend:
    """Subtask ``index``'s backend restored from ``plan.restore`` (empty for a new job)."""
    src = plan.restore
    key_group_range = KeyGroupRange.of_operator(plan.max_parallelism, plan.parallelism, index)
    if src is not None and src.canonical is not None:
        # A canonical savepoint: an empty backend of the job's kind, bulk-loaded with the rows
        # of this subtask's key groups (any parallelism, any source backend).
        from keyedstate.processor.canonical import restore_canonical

        backend = restore_canonical(
            plan.backend, ResolvedSnapshot(src.storage, METADATA_FILE, src.canonical),
            subtask_index=index, key_group_range=key_group_range,
            max_parallelism=plan.max_parallelism, key_serializer=KeySerializer(plan.key_types),
            time_provider=SystemTimeProvider(), local_dir=plan.local_dir)
        return backend
    return plan.backend.create_keyed_backend(KeyedStateBackendParameters(
        subtask_index=index,
        key_group_range=key_group_range,
        max_parallelism=plan.max_parallelism,
        key_serializer=KeySerializer(plan.key_types),
        restore_handles=src.handles if src else (),
        storage=src.storage if src else None,
        share_restored_files=plan.share_restored_files,
        time_provider=SystemTimeProvider(),
        local_dir=plan.local_dir,
    ))


def _stage(plan: BatchPlan, index: int, name: str, table: pa.Table,
           deferred: list[StagedFile]) -> str | None:
    """Stage ``table`` (output ``name`` of subtask ``index``) as one Parquet file under the
    batch's staging folder; its path, None for no rows. The asynchronous mode only encodes it
    here and adds it to ``deferred``: the process's uploader writes it before the subtask's
    acknowledgement (:mod:`keyedstate.runtime.uploads`), so the task ends without the round
    trip, and the driver reads it only after the checkpoint completed."""
    if table.num_rows == 0:
        return None
    relative = f"{staging_dir(plan.batch_id)}/{name}/part-{index:05d}-{uuid.uuid4().hex}.parquet"
    if plan.async_upload:
        encoded = pa.BufferOutputStream()
        pq.write_table(table, encoded)
        deferred.append(StagedFile(relative, encoded.getvalue().to_pybytes()))
        return relative
    storage = plan.storage
    path = storage.path(relative)

    def write() -> None:
        storage.ensure_parent(path)
        with storage.fs.open(path, "wb") as f:
            pq.write_table(table, f)

    storage.call(f"staging output {storage.url_of(relative)}", write)
    return relative


def _call(ctx: Context, key: Any, fn: Any, *args: Any) -> Output:
    """Call the user's ``fn`` (for ``key``, or :data:`NO_KEY`); what it raises fails the
    subtask with the function's traceback (:func:`~keyedstate.runtime.failures.subtask_failed`).
    Rows come back as a list, Arrow tables as they are."""
    try:
        result = fn(*args)
        if result is None or isinstance(result, (pa.Table, pa.RecordBatch)):
            return result
        return list(result)
    except Exception as exc:
        raise subtask_failed(ctx.batch_id, ctx.subtask_index, "the function raised", exc, key,
                             user_code=True) from exc


def _fire_timers(plan: BatchPlan, backend: KeyedStateBackend, ctx: Context, out: Emitter
                 ) -> int:
    fired = 0
    fn = plan.function
    for domain, now in ((TimeDomain.PROCESSING_TIME, ctx.processing_time),
                        (TimeDomain.EVENT_TIME, ctx.watermark)):
        ctx.time_domain = domain
        for timer in backend.timer_service.pop_due(domain, now):
            backend.set_current_key_bytes(timer.key_bytes, timer.key_group)
            key = backend.get_current_key()
            out.extend(key, _call(ctx, key, fn.on_timer, timer.timestamp, ctx))
            fired += 1
    ctx.time_domain = None
    return fired


def is_vectorized(function: KeyedProcessFunction) -> bool:
    """Whether ``function`` overrides :meth:`KeyedProcessFunction.process_batch` (it then runs
    once per subtask and batch, not once per key)."""
    return getattr(type(function), "process_batch", None) is not KeyedProcessFunction.process_batch


def process_group(plan: BatchPlan, subtasks: range, batches: Iterator[pa.RecordBatch]
                   ) -> Iterator[pa.RecordBatch]:
    """Several subtasks in one Spark task: its rows split by subtask (arrival order kept), then
    each subtask run as if it had the task to itself, every one of them even without rows."""
    received = [b for b in batches if b.num_rows]
    table = pa.Table.from_batches(received) if received else None
    for index in subtasks:
        rows: list[pa.RecordBatch] = []
        if table is not None:
            mine = table.filter(pc.equal(table.column(SUBTASK_COLUMN), index))
            rows = mine.to_batches()
        yield from process_subtask(plan, index, iter(rows))


def process_subtask(plan: BatchPlan, index: int, batches: Iterator[pa.RecordBatch]
                    ) -> Iterator[pa.RecordBatch]:
    """One subtask of one batch, given its index (Spark-independent: tests and profiling call
    it directly with the routed Arrow batches): its one report row
    (:func:`~keyedstate.runtime.wire.report_batch`).
    Whatever fails raises :class:`~keyedstate.errors.BatchFailedError` carrying the failure
    to the driver (:mod:`keyedstate.runtime.failures`)."""
    # A copy this worker is catching up in the background is done (or closed) before the
    # subtask looks at its live copies (runtime.live_copies).
    stop_background_catch_up()
    with collection_paused():  # runtime.gc_freeze: no collection walks the state meanwhile
        report = _run_subtask(plan, index, batches)
    yield report


def _run_subtask(plan: BatchPlan, index: int, batches: Iterator[pa.RecordBatch]
                 ) -> pa.RecordBatch:
    # Step 1. State at the last committed checkpoint.
    try:
        backend, how, restore_s, background_s = _acquire(plan, index)
    except Exception as exc:
        raise subtask_failed(plan.batch_id, index, "restoring the state failed with", exc) \
            from exc
    # The state outlives the batch: keep the cyclic collector off it (runtime.gc_freeze; here,
    # where the previous batch's temporaries are gone).
    freeze_survivors()
    token = uuid.uuid4().hex
    step = "processing the rows failed with"
    try:
        started = time.perf_counter()
        input_batches = [b for b in batches if b.num_rows]
        table = pa.Table.from_batches(input_batches) if input_batches else None
        watermark = MAX_WATERMARK if plan.drain else plan.watermark
        ctx = Context(backend, subtask_index=index, parallelism=plan.parallelism,
                      batch_id=plan.batch_id, watermark=watermark,
                      processing_time=time.time_ns() // 1_000_000)
        fn = plan.function
        out = Emitter()
        _call(ctx, NO_KEY, fn.open, ctx)
        # Step 2. Timers due at the watermark reached by the previous batch, and now.
        fired = _fire_timers(plan, backend, ctx, out)
        # Step 3. Late rows.
        late = 0
        max_event_time = None
        rows_in: int | None = None
        if table is not None and local_aggregation_of(fn) is not None:
            # Aggregated before the hand-off (in Spark's JVM, or by the local runtime), late
            # rows split off there: the hidden columns say how many and the largest event time.
            aggregated = split_aggregated(table)
            table, rows_in = aggregated.table, aggregated.rows_in
            late, max_event_time = aggregated.late, aggregated.max_event_time
        elif table is not None and plan.watermark_column:
            event_ms = event_time_ms(table.column(plan.watermark_column))
            max_event_time = pc.max(event_ms).as_py()
            # A row without an event time is never late (null -> False: a null mask entry would
            # drop the row from both sides of the split below).
            is_late = pc.fill_null(pc.less(event_ms, pa.scalar(plan.watermark, pa.int64())),
                                   False)
            late = pc.sum(is_late.cast(pa.int64())).as_py() or 0
            if late:
                if plan.late_events is LateEvents.SIDE_OUTPUT:
                    late_rows = table.filter(is_late).drop_columns([KG_COLUMN, SUBTASK_COLUMN])
                    ctx.side_outputs.setdefault(LATE_EVENTS_TAG, []).extend(late_rows.to_pylist())
                table = table.filter(pc.invert(is_late))
        # Step 4. The function, over the rows grouped by key (a stable sort keeps arrival
        # order within a key): once per key, or once over all keys (vectorized).
        function_rows = 0 if table is None else table.num_rows
        if rows_in is None:
            rows_in = function_rows
        if table is not None and table.num_rows:
            batch = keyed_batch(sort_by_key(table, plan.key_columns), plan.key_columns,
                                backend.key_serializer)
            if is_vectorized(fn):
                # No key is current: a per-key call must name its key (ctx.set_current_key).
                backend.clear_current_key()
                out.extend(NO_KEY, _call(ctx, NO_KEY, fn.process_batch, batch, ctx))
            else:
                # Keys, their bytes and key groups come from the batch (encoded in one pass),
                # each key's rows are a zero-copy slice.
                keys, rows, offsets = batch.keys, batch.rows, batch.offsets.to_pylist()
                for i, key in enumerate(keys.keys):
                    backend.set_current_batch_key(keys, i)
                    key_rows = rows.slice(offsets[i], offsets[i + 1] - offsets[i])
                    out.extend(key, _call(ctx, key, fn.process_key, key, key_rows, ctx))
        if plan.drain:
            fired += _fire_timers(plan, backend, ctx, out)
        _call(ctx, NO_KEY, fn.close)
        process_s = time.perf_counter() - started
        # Step 5. Stage outputs (invisible until the driver commits).
        step = "staging the output failed with"
        staged: dict[str, str] = {}
        deferred: list[StagedFile] = []
        main = out.main_output(plan.output_schema)
        if (path := _stage(plan, index, "main", main, deferred)) is not None:
            staged["main"] = path
        for tag, rows in ctx.side_outputs.items():
            schema = plan.side_output_schemas.get(tag)
            if schema is None:
                raise OutputSchemaError(
                    f"side output {tag!r} is not declared on the job; declared: "
                    f"{sorted(plan.side_output_schemas)}")
            if (path := _stage(plan, index, tag, rows_to_table(rows, schema, tag),
                               deferred)) is not None:
                staged[tag] = path
        # Step 6. Snapshot: both phases here, or the synchronous one and the upload handed to
        # the process's uploader (runtime.uploads).
        step = "the snapshot failed with"
        _confirm_in_flight(plan, index, backend, how)
        result = backend.snapshot(plan.checkpoint_id,
                                  plan.storage.location(plan.checkpoint_id, index))
        handle: KeyedStateHandle | None = None
        if not plan.async_upload:
            handle = result.materialize()
    except BaseException as exc:
        try:
            # Its upload of the checkpoint in flight reads files the close deletes (RocksDB).
            wait_for_subtask(plan.job_id, index)
            backend.close()
        finally:
            thaw()  # a reused live copy's objects were frozen
        if isinstance(exc, Exception) and not isinstance(exc, BatchFailedError):
            raise subtask_failed(plan.batch_id, index, step, exc) from exc
        raise
    keep_live((plan.job_id, index), LiveCopy(backend, token, plan.parallelism, plan.start_id),
               group=plan.largest_group)
    if handle is None:
        submit(job_id=plan.job_id, checkpoint_id=plan.checkpoint_id, index=index, token=token,
               storage=plan.storage, result=result, staged=deferred)
    # Step 7. Report (runtime.wire).
    return report_batch(SubtaskReport(
        version=WIRE_VERSION, subtask=index, token=token, handle=handle, staged=staged,
        max_event_time=max_event_time, late=late,
        figures=SubtaskFigures(
            rows_in=rows_in, function_rows=function_rows, rows_out=main.num_rows,
            timers_fired=fired, process_s=process_s, restore_s=restore_s,
            reused_local_state=how == REUSED,
            restored=how != REUSED and plan.restore is not None,
            caught_up=how == CAUGHT_UP, background_catch_up_s=background_s,
            sync_s=result.stats.sync_duration_s, async_s=result.stats.async_duration_s,
            incremental_bytes=handle.incremental_size if handle else 0,
            full_bytes=handle.full_size if handle else 0,
            worker_pid=os.getpid())))
