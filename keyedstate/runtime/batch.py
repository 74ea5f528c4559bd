"""One batch of a keyed job, the engine-independent half of a driver: what a batch restores
from, how its checkpoint completes, and the bookkeeping of its output's commit.

A runtime (the Spark driver, :class:`~keyedstate.runtime.local.LocalJob`) triggers checkpoint
N, runs the batch's p subtasks (:func:`~keyedstate.runtime.subtask.process_subtask`, one
result row each), completes the checkpoint with :func:`complete_batch`, hands the staged
output (:class:`StagedOutput`) to its consumers while :func:`output_pending` says so, then
:func:`mark_output_committed`. A checkpoint is complete before its output is committed: a
crash in between is repaired by committing again (idempotent by batch id), never by running
the batch again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from keyedstate.checkpoint.cleanup import Cleaner
from keyedstate.checkpoint.coordinator import (
    CheckpointCoordinator,
    CompletedCheckpoint,
    PendingCheckpoint,
)
from keyedstate.checkpoint.properties import (
    BATCH_ID,
    DRAINED,
    JOB_CONFIG,
    JOB_FUNCTION,
    MIN_WATERMARK,
    RESTORED_FROM,
    STAGED,
    TOKENS,
    WATERMARK,
)
from keyedstate.checkpoint.stats import BatchStats, completed_stats, stats_properties
from keyedstate.config import LATE_EVENTS_TAG, JobConfig, LateEvents
from keyedstate.errors import CheckpointProtocolError, JobDrainedError
from keyedstate.processor.canonical import PROP_KEY_COLUMNS
from keyedstate.runtime.startup import JobStart
from keyedstate.runtime.subtask import RestoreSource
from keyedstate.runtime.wire import SubtaskReport
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import (
    COMMITS_DIR,
    checkpoint_id_of_commit_marker,
    commit_marker,
    staging_dir,
)
from keyedstate.storage.transfer import RESTORE_PREFIX, TransferStats, parallel_map

#: the tag of a job's main output (side outputs have their own tags)
MAIN_OUTPUT = "main"


@dataclass(frozen=True)
class StagedOutput:
    """One output of one batch, staged as Parquet files in checkpoint storage.

    ``lineage`` names the sequence of batch ids the batch belongs to: a batch is identified by
    ``(lineage, batch id)``. The driver passes the Spark streaming query's id (a uuid, kept
    across restarts from one Spark checkpoint location and carried by savepoints; a new query's
    batch ids start again at 0), as its checkpoint records it. ``""`` means unknown: batches
    are then told apart by their id alone.

    ``parent_lineage`` and ``fork_batch_id``: a lineage that is a branch (a job restored from
    a snapshot into a new Spark checkpoint location) forks from batch ``fork_batch_id`` of
    ``parent_lineage``; sinks record them with the batch so that readers can tell branches
    apart. ``""`` and -1 for a lineage that is no branch."""

    storage: CheckpointStorage
    paths: list[str]
    schema: pa.Schema
    lineage: str = ""
    parent_lineage: str = ""
    fork_batch_id: int = -1

    def urls(self) -> list[str]:
        return [self.storage.url_of(p) for p in self.paths]


def read_staged(staged: StagedOutput) -> pa.Table:
    """The batch's output as one Arrow table of ``staged.schema``, read in this process through
    the staging storage's filesystem (any fsspec URL, S3 included). The files are read in
    parallel (the storage's transfer threads; one on a local filesystem), concatenated in
    path order."""
    storage = staged.storage
    tables = parallel_map(lambda relative: pq.read_table(pa.BufferReader(storage.read(relative))),
                          sorted(staged.paths), storage.request_threads)
    if not tables:
        return staged.schema.empty_table()
    return pa.concat_tables(tables).cast(staged.schema)


def side_output_schemas(side_outputs: Mapping[str, pa.Schema], late_events: LateEvents,
                        late_schema: pa.Schema) -> dict[str, pa.Schema]:
    """The side outputs a batch's subtasks may stage: the job's, plus the late rows (of the
    input's schema, ``late_schema``) when late events go to a side output."""
    return {**side_outputs,
            **({LATE_EVENTS_TAG: late_schema} if late_events is LateEvents.SIDE_OUTPUT else {})}


def check_recovered(latest: CompletedCheckpoint, checkpoint_dir: str) -> None:
    """Refuse to continue a recovered job that was stopped with drain
    (:class:`JobDrainedError`). Which snapshot its lineage started from does not matter: a
    job's own checkpoints win over the configured restore path (start-up logs a different
    one as ignored; docs/restore-modes.md)."""
    if latest.metadata.properties.get(DRAINED) == "true":
        raise JobDrainedError(
            f"the job in {checkpoint_dir} was stopped with drain; start a new "
            f"job from its savepoint (execution.state-recovery.path) in a new directory"
        )


@dataclass(frozen=True)
class ResumePoint:
    """Where a started job's next batch begins (from :func:`resume_point`)."""

    #: what its subtasks restore from (None: empty state)
    base: RestoreSource | None
    #: False while the job depends on a snapshot it did not claim (its first checkpoint then
    #: duplicates the restored files instead of referencing them)
    share_restored_files: bool
    watermark: int
    #: the batch id the restored state covers, as recorded (-1: none)
    batch_id: int
    #: the snapshot the job's lineage started from ("": empty state), which its checkpoints
    #: record (:data:`~keyedstate.checkpoint.properties.RESTORED_FROM`): the recovered
    #: checkpoint's, else the configured restore path
    restored_from: str = ""


def resume_point(start: JobStart, config: JobConfig) -> ResumePoint:
    """What the job ``start`` describes resumes from: its recovered latest checkpoint
    (checked by :func:`check_recovered`), else the snapshot it restores in NO_CLAIM / LEGACY
    mode, else empty state; with the watermark and batch id they recorded, and the snapshot
    the job's lineage started from (the recovered checkpoint's, else the restore path)."""
    latest = start.coordinator.latest_completed
    if start.recovered and latest is not None:
        check_recovered(latest, config.checkpoint_dir)
        base, share, props = (RestoreSource.of(start.coordinator.storage, latest.metadata, own=True),
                              True, latest.metadata.properties)
    elif start.restored is not None:
        snapshot = start.restored
        base, share, props = (RestoreSource.of(snapshot.storage, snapshot.metadata, own=False),
                              False, snapshot.metadata.properties)
    else:
        return ResumePoint(None, True, MIN_WATERMARK, -1, config.restore_path or "")
    origin = (props.get(RESTORED_FROM, "") if start.recovered
              else config.restore_path or "")
    return ResumePoint(base, share, int(props.get(WATERMARK, MIN_WATERMARK)),
                       int(props.get(BATCH_ID, -1)), origin)


def next_watermark(reports: Sequence[SubtaskReport], watermark: int,
                   watermark_delay_ms: int) -> int:
    """The watermark after a batch: its largest event time less ``watermark_delay_ms``, never
    back from ``watermark``."""
    event_times = [r.max_event_time for r in reports if r.max_event_time is not None]
    if event_times:
        return max(watermark, max(event_times) - watermark_delay_ms)
    return watermark


def complete_batch(coordinator: CheckpointCoordinator, pending: PendingCheckpoint,
                   reports: Sequence[SubtaskReport], *, parallelism: int, batch_id: int, watermark: int,
                   watermark_delay_ms: int, drain: bool, key_columns: Sequence[str],
                   lineage: Mapping[str, str], extra: Mapping[str, str] | None = None,
                   config: JobConfig | None = None, function: str = "",
                   ) -> tuple[CompletedCheckpoint, list[SubtaskReport], int]:
    """Acknowledge every subtask's handle and complete ``pending``; returns the completed
    checkpoint, the reports in subtask order and the watermark after the batch.

    ``reports``: one per subtask (:func:`~keyedstate.runtime.wire.decode_reports`), each with
    its handle. The watermark advances to the batch's largest event
    time less ``watermark_delay_ms``, never back. The checkpoint's properties record
    ``lineage`` (where the job started from), the batch id, the new watermark, each subtask's
    snapshot token, the staged outputs, whether the batch drained the job, the key columns,
    the function's class (``function``, when given: who the job is,
    :mod:`~keyedstate.runtime.identity`), the checkpoint's statistics and the job's history
    (:func:`~keyedstate.checkpoint.stats.stats_properties`), the job's ``config``
    (:meth:`~keyedstate.config.JobConfig.recorded`) when given, and ``extra``. Raises
    :class:`CheckpointProtocolError` unless there is exactly one result per subtask; the
    caller aborts ``pending`` on any failure.
    """
    ordered = sorted(reports, key=lambda r: r.subtask)
    if [r.subtask for r in ordered] != list(range(parallelism)):
        raise CheckpointProtocolError(
            f"batch {batch_id}: expected one result per subtask 0..{parallelism - 1}, "
            f"got {[r.subtask for r in ordered]}"
        )
    handles = [r.handle for r in ordered if r.handle is not None]
    if len(handles) != len(ordered):
        raise CheckpointProtocolError(
            f"batch {batch_id}: subtasks {[r.subtask for r in ordered if r.handle is None]} "
            f"reported no snapshot handle (the asynchronous mode's reports get theirs from "
            f"the acknowledgements, runtime/inflight.py)")
    for handle in handles:
        coordinator.acknowledge(pending, handle)
    # Flink's end-to-end duration: trigger to the last acknowledgement (just now).
    end_to_end_ms = max(0.0, time.time() * 1000 - pending.timestamp_ms)
    subtasks = [r.figures.state_stats() for r in ordered]
    row = completed_stats(pending.checkpoint_id, batch_id=batch_id,
                          trigger_ms=pending.timestamp_ms, handles=handles,
                          subtasks=subtasks, end_to_end_ms=end_to_end_ms)
    previous = coordinator.latest_completed
    watermark = next_watermark(ordered, watermark, watermark_delay_ms)
    staged: dict[str, list[str]] = {}
    for r in ordered:
        for tag, path in r.staged.items():
            staged.setdefault(tag, []).append(path)
    properties = {
        **lineage,
        BATCH_ID: str(batch_id),
        WATERMARK: str(watermark),
        TOKENS: json.dumps([r.token for r in ordered]),
        STAGED: json.dumps(staged),
        DRAINED: "true" if drain else "false",
        **stats_properties(row, subtasks, None if previous is None else previous.metadata),
        **({JOB_CONFIG: json.dumps(config.recorded(), default=str)} if config else {}),
        **(extra or {}),
        # Names the key columns for the state processor API and canonical savepoints; with
        # the function, who the job is (checked at its next start).
        PROP_KEY_COLUMNS: json.dumps(list(key_columns)),
        **({JOB_FUNCTION: function} if function else {}),
    }
    completed = coordinator.complete(pending, properties=properties)
    return completed, ordered, watermark


def staged_outputs(storage: CheckpointStorage, properties: Mapping[str, str],
                   schemas: Mapping[str, pa.Schema], lineage: str = "",
                   parent_lineage: str = "", fork_batch_id: int = -1
                   ) -> dict[str, StagedOutput]:
    """Every output of ``schemas`` a checkpoint's batch staged in ``storage``
    (``properties[STAGED]``); an output without rows has no files."""
    staged = json.loads(properties.get(STAGED, "{}"))
    return {tag: StagedOutput(storage, staged.get(tag, []), schema, lineage=lineage,
                              parent_lineage=parent_lineage, fork_batch_id=fork_batch_id)
            for tag, schema in schemas.items()}


def output_pending(storage: CheckpointStorage, completed: CompletedCheckpoint, *,
                   marker_known_missing: bool = False) -> bool:
    """Whether ``completed``'s output still has to be committed: it staged output (a claimed
    snapshot did not: its output is not this job's to commit) and its commit marker is not
    written yet (not asked of storage with ``marker_known_missing``: the caller knows)."""
    props = completed.metadata.properties
    if STAGED not in props:
        return False
    if marker_known_missing:
        return True
    return not storage.exists(commit_marker(int(props[BATCH_ID]), completed.checkpoint_id))


def mark_output_committed(storage: CheckpointStorage, coordinator: CheckpointCoordinator,
                          completed: CompletedCheckpoint, cleaner: Cleaner | None = None
                          ) -> None:
    """After ``completed``'s output was committed: write its marker, drop its staged files,
    and delete the markers of checkpoints no longer retained (only a retained checkpoint's
    marker is ever consulted: a replay of its batch, a savepoint of it).

    The marker comes first (once the staged files are gone, only it says the output was
    committed); the two clean-ups after it are independent of each other and run in parallel
    on the storage's transfer threads: each is a listing and a delete, round trips on an
    object store. Given a ``cleaner`` (the asynchronous mode), they are handed to it and the
    call returns after the marker: nothing waits for them, and a failure is logged, the
    staged files left to ``keyedstate gc``. Without one, a failed one raises once both
    ended (the caller's retry finds the marker written and leaves the staged files to gc)."""
    batch_id = int(completed.metadata.properties[BATCH_ID])
    storage.write(commit_marker(batch_id, completed.checkpoint_id), b"")
    retained = [c.checkpoint_id for c in coordinator.retained]

    def drop_stale_markers() -> None:
        if not retained:
            return
        stale = [p for p in storage.list_files(COMMITS_DIR)
                 if (marked := checkpoint_id_of_commit_marker(p)) is not None
                 and marked < min(retained)]
        storage.delete_many(stale)

    cleanups: list[Callable[[], None]] = [lambda: storage.delete_dir(staging_dir(batch_id)),
                                          drop_stale_markers]

    def clean_up() -> None:
        parallel_map(lambda cleanup: cleanup(), cleanups, storage.request_threads)

    if cleaner is None:
        clean_up()
    else:
        cleaner.submit(f"the staged output of batch {batch_id} and old commit markers",
                       clean_up)


def batch_stats(reports: Sequence[SubtaskReport], completed: CompletedCheckpoint, *,
                watermark: int, duration_s: float) -> BatchStats:
    """The statistics of a batch whose checkpoint ``completed`` from its subtasks'
    ``reports`` (sums and, for durations, the slowest subtask) and its handles' transfer
    counts; ``watermark`` after the batch, ``duration_s`` from its start to its commit."""
    figures = [r.figures for r in reports]
    metadata = completed.metadata
    transfer, restored = TransferStats(), TransferStats()
    for handle in metadata.handles:
        transfer.merge(TransferStats.from_properties(handle.properties))
        restored.merge(TransferStats.from_properties(handle.properties, RESTORE_PREFIX))
    return BatchStats(
        batch_id=int(metadata.properties[BATCH_ID]), checkpoint_id=completed.checkpoint_id,
        rows_in=sum(f.rows_in for f in figures), rows_out=sum(f.rows_out for f in figures),
        function_rows=sum(f.function_rows for f in figures),
        late_events=sum(r.late for r in reports),
        timers_fired=sum(f.timers_fired for f in figures), watermark=watermark,
        duration_s=duration_s,
        sync_duration_s=max(f.sync_s for f in figures),
        async_duration_s=max(f.async_s for f in figures),
        incremental_bytes=metadata.incremental_size, full_bytes=metadata.full_size,
        state_bytes_per_subtask=[h.full_size for h in metadata.handles],
        restore_s=max(f.restore_s for f in figures),
        reused_subtasks=sum(1 for f in figures if f.reused_local_state),
        restored_subtasks=sum(1 for f in figures if not f.reused_local_state),
        caught_up_subtasks=sum(1 for f in figures if f.caught_up),
        uploaded_bytes=transfer.uploaded_bytes, duplicated_bytes=transfer.duplicated_bytes,
        inlined_bytes=transfer.inlined_bytes,
        objects_written=transfer.uploaded_objects + transfer.duplicated_objects,
        restore_downloaded_bytes=restored.downloaded_bytes,
        restore_cache_hit_bytes=restored.cache_hit_bytes,
        background_caught_up_subtasks=sum(1 for f in figures if f.background_catch_up_s),
        background_catch_up_s=max(f.background_catch_up_s for f in figures),
    )
