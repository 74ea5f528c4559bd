"""KeyedQuery: a stop that waits for the batch in flight (on Spark, in a subprocess whose JVM
output is checked), the stop gate on its own, the errors a failed batch raises, and the
statistics of the asynchronous mode's batches completed before a discard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pandas as pd
import pytest

from keyedstate.config import JobConfig
from keyedstate.errors import (
    BatchFailedError,
    CheckpointDiscardedError,
    ConfigurationError,
    StopTimeoutError,
)
from keyedstate.spark.api import key_by
from keyedstate.spark.query import KeyedQuery, StopGate
from keyedstate.spark.sinks import ParquetSink
from keyedstate.testing.faults import FaultPlan
from tests.spark.jobs import COUNT_SCHEMA, FailOnKey, RunningTotals
from tests.spark.test_job import (
    SCHEMA,
    check_against_pandas,
    committed_and_aborted,
    run_job,
    write_files,
)

STOP_SCRIPT = """
import json, os, sys, time
from keyedstate.config import JobConfig
from keyedstate.spark.api import key_by
from keyedstate.spark.session import local_session
from keyedstate.spark.sinks import ParquetSink
from keyedstate.testing.faults import FaultPlan
from tests.spark.jobs import COUNT_SCHEMA, SlowBatch
from tests.spark.test_job import SCHEMA, write_files

root, how = sys.argv[1], sys.argv[2]
markers = os.path.join(root, "markers")
os.makedirs(markers)
write_files(os.path.join(root, "input"), 4)
spark = local_session("local[2]", "keyedstate-stop")
events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
          .parquet(os.path.join(root, "input")))
job = key_by(events, "user_id").process(SlowBatch(1, 4.0, markers), COUNT_SCHEMA)
job.sink(ParquetSink(os.path.join(root, "out")))
# the default trigger: one batch after the other, as long as files are left
query = job.start(JobConfig(checkpoint_dir=os.path.join(root, "ckpt"), parallelism=2),
                  spark_checkpoint_location=os.path.join(root, "spark"))
while not os.listdir(markers):
    time.sleep(0.05)
started = time.monotonic()
if how == "stop":
    query.stop()
else:
    query.query.stop()  # Spark's own stop: cuts batch 1 off
print(json.dumps({
    "stop_s": time.monotonic() - started,
    "batches": [[s.batch_id, s.checkpoint_id] for s in query.stats],
    "exception": None if query.query.exception() is None else str(query.query.exception()),
    "interrupted": query.driver.gate.interrupted,
    "active": query.query.isActive,
}))
spark.stop()
"""


def run_stop_script(root: str, how: str) -> tuple[dict[str, Any], str]:
    result = subprocess.run(
        [sys.executable, "-c", STOP_SCRIPT, root, how], capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def assert_quiet(stderr: str) -> None:
    """Spark's console after a stop: no overflow, no query failure, no traceback (before, a
    stop printed a 1,000-line StackOverflowError or "terminated with error" and the batch's
    traceback)."""
    for sign in ("StackOverflowError", "terminated with error", "Exception in thread",
                 "Traceback"):
        assert sign not in stderr, stderr[-3000:]


@pytest.mark.spark
def test_stop_lets_the_batch_in_flight_finish_and_runs_no_other(spark, tmp_path):
    """stop() while batch 1 runs: batch 1 completes (checkpoint and sink commit), no later
    batch runs, Spark prints no error (the README's quick start printed a 1,000-line
    StackOverflowError in 3 of 4 runs when stop() cut a batch off), and a restart goes on
    exactly once."""
    root = str(tmp_path)
    report, stderr = run_stop_script(root, "stop")
    assert report["batches"] == [[0, 1], [1, 2]], report
    assert report["exception"] is None and not report["active"], report
    assert_quiet(stderr)
    out = pd.read_parquet(os.path.join(root, "out"))
    assert sorted(out.batch_id.unique()) == [0, 1]
    # nothing of a partial batch: no staged output, no checkpoint after batch 1's
    assert not [p for p in (tmp_path / "ckpt").glob("staging/*")]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("chk-*")) == ["chk-2"]
    query = run_job(spark, root, RunningTotals(), parallelism=2)
    assert [s.batch_id for s in query.stats] == [2, 3]
    check_against_pandas(root)


@pytest.mark.spark
def test_spark_stop_cutting_a_batch_off_is_quiet_and_the_batch_runs_again(spark, tmp_path):
    """Spark's own stop (query.query.stop()) cuts batch 1 off: its checkpoint is aborted and
    Spark reports a stop, not a failure, nor a StackOverflowError over the batch's error;
    batch 1 runs again on restart, exactly once."""
    root = str(tmp_path)
    report, stderr = run_stop_script(root, "interrupt")
    assert report["batches"] == [[0, 1]], report
    assert report["interrupted"] == [1] and report["exception"] is None, report
    assert_quiet(stderr)
    assert committed_and_aborted(tmp_path / "ckpt") == (["chk-1"], ["chk-2"])
    query = run_job(spark, root, RunningTotals(), parallelism=2)
    assert [s.batch_id for s in query.stats] == [1, 2, 3]
    check_against_pandas(root)


def start_job(spark: Any, root: str, fn: Any, parallelism: int) -> KeyedQuery:
    events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
              .parquet(os.path.join(root, "input")))
    job = key_by(events, "user_id").process(fn, COUNT_SCHEMA)
    job.sink(ParquetSink(os.path.join(root, "out")))
    return job.start(JobConfig(checkpoint_dir=os.path.join(root, "ckpt"), parallelism=parallelism),
                     trigger={"availableNow": True},
                     spark_checkpoint_location=os.path.join(root, "spark"))


class FakeQuery:
    """The part of Spark's StreamingQuery the gate uses."""

    def __init__(self, trigger_active: bool = True) -> None:
        self.isActive = True
        self.trigger_active = trigger_active
        #: what the gate did to the query, in order
        self.events: list[str] = []

    @property
    def status(self) -> dict[str, Any]:
        self.events.append("status")
        return {"isTriggerActive": self.trigger_active}

    def stop(self) -> None:
        self.events.append("stop")
        self.isActive = False


def test_gate_stops_spark_when_the_next_batch_waits_and_refuses_it():
    gate, query = StopGate(), FakeQuery()
    gate.query = query
    gate.enter(0)  # no stop under way: batches pass
    stopping = threading.Thread(target=gate.stop, args=(5.0,))
    stopping.start()
    time.sleep(0.2)
    assert query.isActive, "a batch runs (trigger active): the stop must wait"
    with pytest.raises(Exception, match="batch 1 was not run"):
        gate.enter(1)  # the next batch: waits at the gate until Spark stopped, then refused
    stopping.join()
    assert not query.isActive and gate.interrupted == [1]


def test_gate_stops_spark_at_once_between_triggers():
    """No batch runs: the gate looks once and stops Spark, without a wait in between (a wait
    would read the status again)."""
    gate, query = StopGate(), FakeQuery(trigger_active=False)
    gate.query = query
    gate.stop(5.0)
    assert query.events == ["status", "stop"]


def test_gate_timeout_leaves_the_query_running():
    gate, query = StopGate(), FakeQuery()
    gate.query = query
    with pytest.raises(StopTimeoutError, match="keeps running"):
        gate.stop(0.2)
    assert query.isActive
    gate.enter(3)  # the stop was withdrawn: the next batch runs
    assert gate.interrupted == []


def test_gate_refuses_a_stop_from_inside_a_batch():
    gate, query = StopGate(), FakeQuery()
    gate.query = query
    gate.enter(0)  # this thread runs the batches (a listener would call stop() here)
    with pytest.raises(ConfigurationError, match="inside a batch"):
        gate.stop(5.0)
    assert query.isActive


@pytest.mark.spark
@pytest.mark.parametrize("parallelism", [2, 4])  # 4: two subtasks per Spark task
def test_failed_batch_raises_batch_failed_error_with_the_users_traceback(spark, tmp_path,
                                                                          parallelism):
    """await_termination() raises BatchFailedError: batch, subtask, key and the user's own
    traceback (file and line of the raise), short, without Spark's JVM frames; stop() after it
    raises the same error."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 1)
    bad_key = pd.read_parquet(os.path.join(root, "input", "part-000.parquet")).user_id.iloc[0]
    query = start_job(spark, root, FailOnKey(bad_key), parallelism=parallelism)
    with pytest.raises(BatchFailedError) as failure:
        query.await_termination()
    error = failure.value
    with pytest.raises(BatchFailedError) as again:
        query.stop()
    assert again.value is error
    text = str(error)
    jobs_py = os.path.join("tests", "spark", "jobs.py")
    with open(jobs_py) as f:
        line = next(n for n, source in enumerate(f, 1) if "raise ValueError" in source)
    assert text.startswith(f"batch 0, subtask {error.subtask}, key {bad_key!r}: "
                           f"the function raised ValueError: cannot handle {bad_key}")
    assert f'{jobs_py}", line {line}, in process_key' in text
    assert len(text) < 3000 and "at org.apache.spark" not in text and "py4j" not in text
    assert (error.batch_id, error.key) == (0, repr(bad_key))
    assert error.user_traceback is not None and jobs_py in error.user_traceback
    from pyspark.errors import StreamingQueryException

    assert isinstance(error.__cause__, StreamingQueryException)


@pytest.mark.spark
def test_a_discard_keeps_the_stats_of_the_batches_completed_before_it(spark, tmp_path):
    """The asynchronous mode with two checkpoints in flight: batches 2 and 3's are left when
    the query runs out of input, and the stop completes them in one call; batch 3's
    ``_metadata`` write is refused, so the stop raises ``CheckpointDiscardedError`` for batch
    3. Batch 2 completed and committed first: its statistics are recorded and the listeners
    called (they were lost with the discard)."""
    from tests.spark.test_exactly_once import start

    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 4)
    plan = FaultPlan(tmp_path / "faults.json")
    plan.add("write", "denied", match="chk-4/_metadata")  # batch 3's checkpoint
    heard: list[int] = []
    query = start(spark, root, checkpoint_dir=plan.url(os.path.join(root, "ckpt")),
                  storage_options=plan.storage_options("file"), transfer_attempts=1,
                  async_upload=True, max_concurrent_checkpoints=2,
                  listener=lambda s: heard.append(s.batch_id))
    with pytest.raises(CheckpointDiscardedError) as discarded:
        query.stop()
    assert plan.fired() and discarded.value.discarded_batches == [3]
    assert [s.batch_id for s in query.stats if s.checkpoint_id >= 0] == [0, 1, 2]
    assert heard == [0, 1, 2]
