"""The background catch-up of live copies happens on Spark (``runtime/live_copies.py``,
docs/spark.md "State locality"): a heap job of 8 subtasks, one Spark task each, on the
session's two Python workers, so subtasks move between workers from batch to batch; a worker
catches its copies that the other worker moved on up in the background, and a later task
there reuses one. Its batches record it, and the output equals pandas over the whole input."""

from __future__ import annotations

import os

import pytest

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.stats import history_of
from tests.spark.jobs import RunningTotals
from tests.spark.test_job import check_against_pandas, run_job, write_files

pytestmark = pytest.mark.spark

#: Runs of the job (each a few more batches, continuing the same checkpoints) before giving
#: up on seeing a copy caught up in the background: Spark, not the job, decides which worker
#: runs which task (seen: in the 1st run, or only in the 3rd of 6 batches each).
ATTEMPTS = 5
BATCHES_PER_RUN = 8


def test_copies_caught_up_in_the_background_on_spark(spark, tmp_path):
    root = str(tmp_path)
    seen, batches = 0, 0
    for _ in range(ATTEMPTS):
        write_files(os.path.join(root, "input"), BATCHES_PER_RUN, first=batches)
        batches += BATCHES_PER_RUN
        query = run_job(spark, root, RunningTotals(), parallelism=8, backend="heap",
                        spark_tasks=8)
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
