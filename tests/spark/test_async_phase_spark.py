"""The asynchronous phase on Spark (docs/checkpoints.md, "The asynchronous phase"): results
equal pandas over the input, exactly once; a failed upload fails the query with the batches
after the last completed checkpoint discarded, and the restart runs them again; a driver
killed after Spark recorded a batch as done but before that batch's checkpoint completed
restarts with Spark's log rewound, so the batch runs again from the same source
positions."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.errors import CheckpointDiscardedError, KeyedStateError
from keyedstate.spark.offsets import OffsetLog
from keyedstate.spark.sinks import StagedOutput
from keyedstate.testing.faults import FaultPlan
from tests.spark.jobs import RunningTotals
from tests.spark.test_exactly_once import BatchFiles, SavepointInSink, run_with_driver, start
from tests.spark.test_job import check_against_pandas, run_job, write_files

pytestmark = pytest.mark.spark

WORKTREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_results_equal_pandas_with_async_uploads(spark, tmp_path, backend):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 4)
    query = run_job(spark, root, RunningTotals(), parallelism=2, backend=backend,
                    async_upload=True)
    check_against_pandas(root)
    stats = [s for s in query.stats if s.checkpoint_id >= 0]
    # Every batch completed once, in order (the last ones by the stop), each uploaded.
    assert [s.batch_id for s in stats] == [0, 1, 2, 3]
    assert all(s.full_bytes > 0 and s.async_duration_s > 0 for s in stats)
    assert not [p for p in _files(os.path.join(root, "ckpt")) if "/_acks/" in p]


def _files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


#: A driver in its own process: the job with async uploads, SIGKILLed when it starts to
#: complete batch 1's checkpoint (during batch 2, after Spark recorded batch 1 as done), or
#: the batch argv[2] says.
KILLED_DRIVER = textwrap.dedent("""
    import os, signal, sys
    from keyedstate.runtime import inflight
    from keyedstate.spark.session import local_session
    from tests.spark.jobs import RunningTotals
    from tests.spark.test_job import run_job

    complete_oldest = inflight.InFlightCheckpoints.complete_oldest
    KILL_AT = int(sys.argv[2]) if len(sys.argv) > 2 else 1

    def die_at_batch_1(self, *args, **kwargs):
        if next(iter(self)).batch_id == KILL_AT:
            with open(os.path.join(sys.argv[1], "killed"), "w") as f:
                f.write("1")
            os.kill(os.getpid(), signal.SIGKILL)
        return complete_oldest(self, *args, **kwargs)

    inflight.InFlightCheckpoints.complete_oldest = die_at_batch_1
    spark = local_session("local[2]", "killed-driver")
    run_job(spark, sys.argv[1], RunningTotals(), parallelism=2, async_upload=True)
""")


def _killed_driver(tmp_path, root: str, kill_at: int = 1) -> None:
    """Run :data:`KILLED_DRIVER` over ``root`` until it is killed at batch ``kill_at``."""
    script = tmp_path / "driver.py"
    script.write_text(KILLED_DRIVER)
    env = {**os.environ, "PYTHONPATH": WORKTREE}
    driver = subprocess.Popen([sys.executable, str(script), root, str(kill_at)], cwd=WORKTREE,
                              env=env, start_new_session=True)
    try:
        rc = driver.wait(timeout=600)
    finally:
        try:  # its JVM and Python workers go with it
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert rc == -signal.SIGKILL and os.path.exists(os.path.join(root, "killed"))


def test_driver_killed_between_sparks_commit_and_the_checkpoint(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 4)
    _killed_driver(tmp_path, root)
    # Spark recorded batch 1 as done; keyedstate's checkpoints cover batch 0 only.
    log = OffsetLog.at(os.path.join(root, "spark"))
    assert log.last_committed() == 1
    completed = sorted(int(d.split("-")[1]) for d in os.listdir(os.path.join(root, "ckpt"))
                       if d.startswith("chk-") and os.path.exists(
                           os.path.join(root, "ckpt", d, "_metadata")))
    assert len(completed) == 1
    # The restart rewinds Spark's log to batch 0: batch 1 runs again with its logged offsets.
    query = run_job(spark, root, RunningTotals(), parallelism=2, async_upload=True)
    check_against_pandas(root)
    ran = [(s.batch_id, s.rows_in) for s in query.stats if s.checkpoint_id >= 0]
    assert ran == [(1, 1500), (2, 1500), (3, 1500)]  # one input file each, as planned before
    assert log.batches("commits") == [0, 1, 2, 3]


@pytest.mark.parametrize("restart", ["async", "sync"])
def test_a_crash_before_the_first_checkpoint_completed_is_rewound(spark, tmp_path, restart):
    """The driver killed as batch 0's checkpoint, the job's first, starts to complete (Spark
    had recorded batch 0 as done): no checkpoint of the job says it ran asynchronously, its
    marker does (``_async-upload``), so the restart, in either mode, rewinds Spark's log to
    before batch 0 and runs every batch again, one input file each, exactly once."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    _killed_driver(tmp_path, root, kill_at=0)
    log = OffsetLog.at(os.path.join(root, "spark"))
    assert log.last_committed() == 0
    assert os.path.exists(os.path.join(root, "ckpt", "_async-upload"))
    query = run_job(spark, root, RunningTotals(), parallelism=2,
                    async_upload=restart == "async")
    check_against_pandas(root)
    ran = [(s.batch_id, s.rows_in) for s in query.stats if s.checkpoint_id >= 0]
    assert ran == [(0, 1500), (1, 1500), (2, 1500)]
    assert log.batches("commits") == [0, 1, 2]


#: A refused call at each step of batch 1's checkpoint (checkpoint 2): where, and whether it
#: discards (the batches from 1 on run again after the restart) or, after the checkpoint
#: completed, only fails its sink commit (the restart commits it, then runs batch 2 on).
STEPS = {
    "upload": ("/shared/chk-2-", True),                # in the worker, before the ack
    "staging": ("staging/batch-1/", True),            # the uploader, after the upload
    "ack-write": ("chk-2/_acks/subtask-1", True),      # after the upload: no ack ever comes
    "metadata": ("chk-2/_metadata", True),             # the driver's commit point
    "sink-commit": ("commits/batch-1-", False),        # its marker, after the sinks committed
}


@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_fault_at_each_step_and_the_restart_is_exactly_once(spark, tmp_path, step):
    """The query fails during batch 2 (Spark had recorded batch 1 as done): with
    ``CheckpointDiscardedError`` when the fault hit batch 1's checkpoint before it completed,
    with the sink commit's error after. The restart (no fault) gets Spark's log and the sinks
    back in line with the checkpoints: the output equals pandas, exactly once."""
    match, discards = STEPS[step]
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 4)
    plan = FaultPlan(tmp_path / "faults.json")
    plan.add("write", "denied", match=match)
    faulty = dict(checkpoint_dir=plan.url(os.path.join(root, "ckpt")),
                  storage_options=plan.storage_options("file"), transfer_attempts=1,
                  async_upload=True, checkpoint_timeout="5 s")
    with pytest.raises(KeyedStateError) as failed:
        start(spark, root, **faulty)
    assert plan.fired()
    assert isinstance(failed.value, CheckpointDiscardedError) == discards, failed.value
    if discards:
        assert failed.value.discarded_batches[0] == 1  # type: ignore[attr-defined]
    assert OffsetLog.at(os.path.join(root, "spark")).last_committed() == 1
    query = start(spark, root, **faulty)
    query.stop()
    check_against_pandas(root)
    ran = [s.batch_id for s in query.stats if s.checkpoint_id >= 0]
    assert ran == ([1, 2, 3] if discards else [2, 3])


def test_stop_with_drain_and_savepoint_waits_for_the_checkpoints_in_flight(spark, tmp_path):
    """``stop(drain=True, savepoint=...)``: the last batch's checkpoint, in flight when the
    query stopped, completes and commits first; then the drain (its own batch, nothing left in
    flight after it) and the savepoint of it."""
    from keyedstate.checkpoint.properties import BATCH_ID, DRAINED
    from keyedstate.checkpoint.resolve import resolve_snapshot

    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    query = start(spark, root, async_upload=True)
    assert [s.batch_id for s in query.stats if s.checkpoint_id >= 0] == [0, 1]  # 2 in flight
    savepoint = query.stop(drain=True, savepoint=str(tmp_path / "savepoint"))
    assert savepoint is not None
    check_against_pandas(root)
    assert [s.batch_id for s in query.stats if s.checkpoint_id >= 0] == [0, 1, 2, 3]
    props = resolve_snapshot(savepoint).metadata.properties
    assert (props[BATCH_ID], props[DRAINED]) == ("3", "true")


class BesideSink(SavepointInSink):
    """:class:`SavepointInSink` (a savepoint from inside the commit of batch ``batch_id``)
    that records, for each commit, the thread it ran on, the Spark job group it runs its
    Spark jobs in, and a Spark job's result."""

    def __init__(self, path: str, batch_id: int, target: str) -> None:
        super().__init__(path, batch_id, target)
        self.commits: list[tuple[int, str, str | None, int]] = []

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        if batch_id == self.batch_id:
            # A long commit: the next batch's tasks end first (they staged their output),
            # and the batch thread goes on to wait for this one.
            next_batch = os.path.join(self.driver.config.checkpoint_dir, "staging",
                                      f"batch-{batch_id + 1}")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not _files(next_batch):
                time.sleep(0.05)
            time.sleep(1.0)
        group = spark.sparkContext.getLocalProperty("spark.jobGroup.id")
        self.commits.append((batch_id, threading.current_thread().name, group,
                             spark.range(3).count()))
        super().commit(spark, batch_id, staged)


def test_sink_commits_beside_the_next_batch_run_as_its_jobs_and_may_take_a_savepoint(
        spark, tmp_path):
    """Batch 0's and batch 1's sink commits run on the driver's completion thread beside
    batches 1's and 2's tasks. There a sink's Spark job runs in the query's job group (the
    batch thread's job properties go with the thread, so stopping the query cancels it), and
    a savepoint taken from inside batch 1's commit neither waits for the batch thread (which
    holds the batch lock and waits for the commit) nor commits again: it carries batch 1 and
    its output, and a job restored from it in a new location goes on after batch 1."""
    root = str(tmp_path)
    out = os.path.join(root, "out")
    write_files(os.path.join(root, "input"), 3)
    sink = BesideSink(out, 1, os.path.join(root, "sp"))
    query = run_with_driver(spark, root, sink, async_upload=True)
    sink.driver.flush()  # batch 2's checkpoint, in flight when the query ended, on this thread
    run_id = str(query.runId)
    assert [c[:3] for c in sink.commits] == [
        (0, "keyedstate-completion", run_id), (1, "keyedstate-completion", run_id),
        (2, threading.current_thread().name, None)]
    assert all(c[3] == 3 for c in sink.commits)
    check_against_pandas(root)
    carried = resolve_snapshot(os.path.join(root, "sp")).metadata.properties
    assert carried["batch_id"] == "1" and "staged" in carried
    shutil.rmtree(out)
    write_files(os.path.join(root, "input"), 1, first=3)
    restored = start(spark, root, ckpt="ckpt-2", location="spark-2",
                     restore_path=os.path.join(root, "sp"), sink=BatchFiles(out),
                     async_upload=True)
    restored.stop()
    assert [s.batch_id for s in restored.stats if s.checkpoint_id >= 0] == [2, 3]
    assert sorted(os.listdir(out)) == ["batch-1.parquet", "batch-2.parquet", "batch-3.parquet"]
