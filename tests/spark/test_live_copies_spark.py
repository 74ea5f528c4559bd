"""The background catch-up of live copies happens on Spark (``runtime/live_copies.py``,
docs/spark.md "State locality"): a heap job of 8 subtasks, one Spark task each, on the
session's two Python workers, so subtasks move between workers from batch to batch; a worker
catches its copies that the other worker moved on up in the background, and a later task
there reuses one. Its batches record it, and the output equals pandas over the whole input.
In the asynchronous mode the same happens with the checkpoint in flight (from its subtasks'
acknowledgements), and a checkpoint in flight that fails after copies were caught up to it
leaves the output exactly once."""

from __future__ import annotations

import os
from typing import Any

import pytest

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.stats import history_of
from keyedstate.errors import CheckpointDiscardedError
from keyedstate.testing.faults import FaultPlan
from tests.spark.jobs import RunningTotals
from tests.spark.test_exactly_once import start
from tests.spark.test_job import check_against_pandas, run_job, write_files

pytestmark = pytest.mark.spark

#: Runs of the job (each a few more batches, continuing the same checkpoints) before giving
#: up on seeing a copy caught up in the background: Spark, not the job, decides which worker
#: runs which task (seen: in the 1st run, or only in the 3rd of 6 batches each).
ATTEMPTS = 5
BATCHES_PER_RUN = 8


MODES = {
    "sync-heap": dict(backend="heap"),
    "async-heap": dict(backend="heap", async_upload=True, background_catch_up=True),
    "async-rocksdb": dict(backend="rocksdb", async_upload=True, background_catch_up=True,
                          background_restore=True),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_copies_caught_up_in_the_background_on_spark(spark, tmp_path, mode):
    root = str(tmp_path)
    seen, batches = 0, 0
    for _ in range(ATTEMPTS):
        write_files(os.path.join(root, "input"), BATCHES_PER_RUN, first=batches)
        batches += BATCHES_PER_RUN
        query = run_job(spark, root, RunningTotals(), parallelism=8, spark_tasks=8,
                        **MODES[mode])
        stats = [s for s in query.stats if s.checkpoint_id >= 0]
        assert len(stats) == BATCHES_PER_RUN
        assert all(s.background_caught_up_subtasks <= s.reused_subtasks for s in stats)
        seen += sum(s.background_caught_up_subtasks for s in stats)
        if seen:
            caught = [s for s in stats if s.background_caught_up_subtasks]
            assert all(s.background_catch_up_s > 0 for s in caught)
            break
    assert seen > 0, f"no subtask reused a copy caught up in the background in {batches} batches"
    # The checkpoints record the same counts (the history in the latest _metadata).
    history = history_of(resolve_snapshot(os.path.join(root, "ckpt")).metadata)
    assert sum(r.background_caught_up_subtasks or 0 for r in history) == seen
    check_against_pandas(root)  # every batch exactly once, totals carried through every copy


def test_by_default_the_asynchronous_mode_catches_up_on_the_task_s_path(spark, tmp_path):
    """The asynchronous mode leaves background catch-up off unless set: the next batch's tasks
    start at once, so a worker is never idle for it (docs/spark.md, "State locality"). A moved
    subtask catches its copy up in its task instead; the output equals pandas."""
    root = str(tmp_path)
    moved, batches = 0, 0
    for _ in range(ATTEMPTS):  # until Spark has moved a subtask to a worker with a stale copy
        write_files(os.path.join(root, "input"), BATCHES_PER_RUN, first=batches)
        batches += BATCHES_PER_RUN
        query = run_job(spark, root, RunningTotals(), parallelism=8, spark_tasks=8,
                        backend="heap", async_upload=True)
        stats = [s for s in query.stats if s.checkpoint_id >= 0]
        assert len(stats) == BATCHES_PER_RUN
        assert [s.background_caught_up_subtasks for s in stats] == [0] * BATCHES_PER_RUN
        moved += sum(s.caught_up_subtasks for s in stats)
        if moved:
            break
    assert moved > 0, f"no subtask caught a copy up in its task in {batches} batches"
    check_against_pandas(root)


def test_a_checkpoint_in_flight_that_fails_after_copies_were_caught_up_to_it(spark, tmp_path):
    """The asynchronous mode, 8 subtasks on two workers: checkpoint 6 (batch 5), to which the
    workers' idle copies are caught up while batch 6 runs on it, fails at its commit point
    (``_metadata`` refused): the query fails, batches 5 and 6 discarded. The restart runs them
    again on checkpoint 5; the output equals pandas, exactly once."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 8)
    faults = FaultPlan(tmp_path / "faults.json")
    faults.add("write", "denied", match="chk-6/_metadata")
    config: dict[str, Any] = dict(
        checkpoint_dir=faults.url(os.path.join(root, "ckpt")),
        storage_options=faults.storage_options("file"), transfer_attempts=1,
        async_upload=True, background_catch_up=True, backend="heap", parallelism=8,
        spark_tasks=8)
    with pytest.raises(CheckpointDiscardedError) as failed:
        start(spark, root, **config)
    assert faults.fired() and failed.value.discarded_batches[0] == 5
    # Which copies were caught up to checkpoint 6 is Spark's placement (the runtime test
    # tests/runtime/test_background_catch_up.py pins it down); the completed batches end at 4.
    history = history_of(resolve_snapshot(os.path.join(root, "ckpt")).metadata)
    assert [r.batch_id for r in history][-1] == 4
    query = start(spark, root, **config)
    query.stop()
    ran = [s for s in query.stats if s.checkpoint_id >= 0]
    assert [s.batch_id for s in ran] == [5, 6, 7]
    assert ran[0].reused_subtasks == 0  # a new start: no copy of the failed one is used
    check_against_pandas(root)
