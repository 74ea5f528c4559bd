"""Checkpoint statistics in ``_metadata``: each checkpoint of a job records its own and the
job's history (bounded), old ``_metadata`` without them still reads, and no savepoint carries
them. Real jobs on the local runtime (the same ``complete_batch`` as Spark's driver)."""

from __future__ import annotations

import json

import msgspec

from keyedstate.checkpoint.properties import (
    CHECKPOINT_HISTORY,
    JOB_CONFIG,
    SUBTASK_STATS,
    portable_properties,
)
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.stats import (
    HISTORY_SIZE,
    CompletedCheckpointStats,
    history_of,
    stats_of,
    stats_properties,
    subtask_stats_of,
)
from keyedstate.config import JobConfig
from keyedstate.storage.handles import CheckpointMetadata
from tests.runtime.test_local_job import batches, config, new_job


def latest(root) -> CheckpointMetadata:
    return resolve_snapshot(str(root / "ckpt")).metadata


def test_every_checkpoint_records_its_statistics_and_the_jobs_history(tmp_path):
    with new_job(config(tmp_path, num_retained=1)) as job:
        for table in batches(4):
            job.process_batch(table)
    metadata = latest(tmp_path)
    history = history_of(metadata)
    # Only chk-4 is retained, yet it carries all four checkpoints' rows.
    assert [r.checkpoint_id for r in history] == [1, 2, 3, 4]
    assert [r.batch_id for r in history] == [0, 1, 2, 3]
    for row in history:
        assert row.parallelism == 2 and row.trigger_ms is not None
        assert row.sync_ms is not None and row.async_ms is not None and row.sync_ms > 0
        assert row.end_to_end_ms >= max(row.sync_ms, row.async_ms)
        assert 0 < row.incremental_bytes <= row.full_bytes
        assert row.min_subtask_bytes <= row.max_subtask_bytes
        assert row.uploaded_bytes == row.incremental_bytes  # a local disk: all uploaded
        assert row.rows_in > 0
    # A new job opens empty state; then both subtasks reuse their live state.
    assert (history[0].reused_subtasks, history[0].restored_subtasks) == (0, 0)
    assert all((r.reused_subtasks, r.restored_subtasks) == (2, 0) for r in history[1:])
    # The latest row is the retained checkpoint's, with its subtasks recorded one by one.
    assert stats_of(metadata) == history[-1]
    assert history[-1].full_bytes == metadata.full_size
    assert history[-1].incremental_bytes == metadata.incremental_size
    subtasks = subtask_stats_of(metadata)
    assert subtasks is not None and len(subtasks) == 2
    assert max(s.sync_ms for s in subtasks) == history[-1].sync_ms
    assert all(s.reused and not s.restored for s in subtasks)
    assert json.loads(metadata.properties[JOB_CONFIG])["parallelism.default"] == 2


def test_the_history_continues_across_a_restart_and_a_rescale(tmp_path):
    with new_job(config(tmp_path, num_retained=2)) as job:
        for table in batches(2):
            job.process_batch(table)
    with new_job(config(tmp_path, num_retained=2, parallelism=3)) as job:
        job.process_batch(batches(1, seed=11)[0])
    history = history_of(latest(tmp_path))
    assert [r.checkpoint_id for r in history] == [1, 2, 3]
    assert [r.parallelism for r in history] == [2, 2, 3]
    # The rescaled job restored all three subtasks from chk-2 before its batch.
    assert (history[-1].reused_subtasks, history[-1].restored_subtasks) == (0, 3)
    assert history[-1].restore_ms > 0


def test_no_savepoint_carries_the_statistics_and_a_job_started_from_one_starts_its_own(
        tmp_path):
    with new_job(config(tmp_path / "first")) as job:
        for table in batches(2):
            job.process_batch(table)
        savepoint = job.savepoint(str(tmp_path / "savepoint"))
    properties = resolve_snapshot(savepoint).metadata.properties
    for key in (CHECKPOINT_HISTORY, SUBTASK_STATS, JOB_CONFIG):
        assert key not in properties
        assert key not in portable_properties({key: "x"})
    restored = config(tmp_path / "second", restore_path=str(tmp_path / "savepoint"))
    with new_job(restored) as job:
        job.process_batch(batches(1, seed=5)[0])
    history = history_of(latest(tmp_path / "second"))
    assert len(history) == 1 and history[0].restored_subtasks == 2


def row(checkpoint_id: int) -> CompletedCheckpointStats:
    """A history row with every field at a large value (the size bound's worst case)."""
    big = 10 ** 12
    return CompletedCheckpointStats(
        checkpoint_id, batch_id=checkpoint_id, trigger_ms=1_800_000_000_000,
        end_to_end_ms=123456.7, sync_ms=12345.6, async_ms=12345.6, restore_ms=12345.6,
        parallelism=1024, reused_subtasks=1000, restored_subtasks=24, incremental_bytes=big,
        full_bytes=big, min_subtask_bytes=big, max_subtask_bytes=big, uploaded_bytes=big,
        duplicated_bytes=big, inlined_bytes=big, downloaded_bytes=big, cache_hit_bytes=big,
        rows_in=big, rows_out=big)


def metadata_with(properties: dict[str, str], checkpoint_id: int = 500) -> CheckpointMetadata:
    return CheckpointMetadata(checkpoint_id=checkpoint_id, timestamp_ms=0, backend="heap",
                              parallelism=0, max_parallelism=128, key_types=["bigint"],
                              handles=[], properties=properties)


def test_the_history_is_bounded_in_rows_and_bytes():
    full = [row(i) for i in range(1, HISTORY_SIZE + 1)]
    previous = metadata_with({CHECKPOINT_HISTORY: msgspec.json.encode(full).decode()},
                             checkpoint_id=HISTORY_SIZE)
    recorded = stats_properties(row(HISTORY_SIZE + 1), [], previous)
    history = history_of(metadata_with(recorded))
    assert [r.checkpoint_id for r in history] == list(range(2, HISTORY_SIZE + 2))
    assert len(recorded[CHECKPOINT_HISTORY]) < 25_000  # the bound docs/checkpoints.md states


def test_old_metadata_without_statistics_gives_a_row_from_its_handles(tmp_path):
    with new_job(config(tmp_path)) as job:
        job.process_batch(batches(1)[0])
    metadata = latest(tmp_path)
    old = msgspec.structs.replace(metadata, properties={
        k: v for k, v in metadata.properties.items()
        if k not in (CHECKPOINT_HISTORY, SUBTASK_STATS, JOB_CONFIG)})
    assert history_of(old) == [] and subtask_stats_of(old) is None
    derived = stats_of(old)
    recorded = stats_of(metadata)
    # What the handles record is the same; durations and subtask counts are blank.
    for field in ("checkpoint_id", "batch_id", "trigger_ms", "parallelism",
                  "incremental_bytes", "full_bytes", "min_subtask_bytes",
                  "max_subtask_bytes", "uploaded_bytes"):
        assert getattr(derived, field) == getattr(recorded, field), field
    for field in ("end_to_end_ms", "sync_ms", "async_ms", "restore_ms", "reused_subtasks",
                  "restored_subtasks", "rows_in"):
        assert getattr(derived, field) is None, field
    # The next checkpoint's history starts from that derived row.
    assert history_of(metadata_with(stats_properties(row(2), [], old))) == [derived, row(2)]


def test_rows_of_older_and_newer_writers_read_back():
    older = metadata_with({CHECKPOINT_HISTORY: "[[7, 3]]"})
    assert history_of(older) == [CompletedCheckpointStats(7, batch_id=3)]
    newer = json.loads(msgspec.json.encode([row(8)]))
    newer[0].append("a field added later")
    assert history_of(metadata_with({CHECKPOINT_HISTORY: json.dumps(newer)})) == [row(8)]
    # Something unreadable is left out, never raised: statistics never fail a checkpoint.
    assert history_of(metadata_with({CHECKPOINT_HISTORY: "{not json"})) == []
    assert subtask_stats_of(metadata_with({SUBTASK_STATS: "[[1, 2]]"})) is None  # 0 handles


def test_the_recorded_configuration_leaves_out_the_storage_options(tmp_path):
    cfg = JobConfig(checkpoint_dir=str(tmp_path), storage_options={"secret": "hunter2"},
                    watermark_delay=1500, backend_options={"block_cache_size": 1 << 20})
    recorded = cfg.recorded()
    assert "keyedstate.checkpointing.storage-options" not in recorded
    assert "hunter2" not in json.dumps(recorded)
    assert set(recorded) == set(JobConfig.keys()) - {"keyedstate.checkpointing.storage-options"}
    assert recorded["keyedstate.watermark.delay"] == 1500
    assert recorded["execution.state-recovery.claim-mode"] == "NO_CLAIM"
    assert JobConfig.from_mapping(recorded) == cfg.replace(storage_options={})
