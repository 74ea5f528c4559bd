"""Exactly once at the edges of the commit protocol, on real Spark: a storage error after the
checkpoint commit, a drained savepoint restored, a savepoint of a batch whose sinks had not
committed, a restore into a new Spark checkpoint location. Every test compares the output with
pandas over the input."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.cli import main
from keyedstate.config import JobConfig
from keyedstate.errors import SourcePositionsError, TransientStorageError
from keyedstate.spark.api import key_by
from keyedstate.spark.offsets import OffsetLog
from keyedstate.spark.sinks import ParquetSink, Sink, StagedOutput, read_staged
from keyedstate.testing.faults import FaultPlan
from tests.spark.jobs import COUNT_SCHEMA, FailingSink, RunningTotals
from tests.spark.test_job import SCHEMA, check_against_pandas, write_files

pytestmark = pytest.mark.spark


def start(spark: Any, root: str, ckpt: str = "ckpt", location: str = "spark",
          sink: Any = None, listener: Any = None, **config: Any) -> Any:
    """A RunningTotals job over ``root/input`` (one file per batch) into ``sink`` (default a
    ParquetSink at ``root/out``); returns the query after every available file was
    processed."""
    events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
              .parquet(os.path.join(root, "input")))
    job = key_by(events, "user_id").process(RunningTotals(), COUNT_SCHEMA)
    job.sink(sink or ParquetSink(os.path.join(root, "out")))
    config.setdefault("checkpoint_dir", os.path.join(root, ckpt))
    query = job.start(JobConfig(**{"parallelism": 2, **config}), trigger={"availableNow": True},
                      spark_checkpoint_location=os.path.join(root, location))
    if listener is not None:
        query.add_listener(listener)
    query.await_termination()
    return query


def check_totals(root: str) -> pd.DataFrame:
    """Each user's last output row holds the count and total over the whole input, and no
    (user, batch) appears twice: nothing lost, nothing doubled, whatever the batch ids."""
    events = pd.read_parquet(os.path.join(root, "input"))
    out = pd.read_parquet(os.path.join(root, "out"))
    assert not out.duplicated(["user_id", "batch_id"]).any()
    last = out.sort_values("batch_id").groupby("user_id").last()
    expected = events.groupby("user_id")["amount"].agg(["size", "sum"])
    assert sorted(last.index) == sorted(expected.index)
    assert (last["count"] == expected.loc[last.index, "size"]).all(), "counts differ from pandas"
    assert ((last["total"] - expected.loc[last.index, "sum"]).abs() < 1e-6).all()
    return out


# -- 1. a storage error after the checkpoint committed --------------------------------------------

def test_storage_errors_after_the_commit_retry_the_sink_commit_not_the_batch(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    plan = FaultPlan(tmp_path / "faults.json")
    # batch 1's sink-commit marker fails twice (one attempt per call): its checkpoint is
    # complete, so only the commit may be retried
    plan.add("write", "internal", match="commits/batch-1-", times=2)
    query = start(spark, root, checkpoint_dir=plan.url(os.path.join(root, "ckpt")),
                  storage_options=plan.storage_options("file"), transfer_attempts=1)
    query.stop()
    assert sum("commits/batch-1-" in f["path"] for f in plan.fired()) == 2
    check_against_pandas(root)
    assert [(s.batch_id, s.attempts) for s in query.stats] == [(0, 1), (1, 1), (2, 1)]


def test_commit_markers_are_retired_with_their_checkpoints(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 4)
    start(spark, root, num_retained=2).stop()
    markers = sorted(os.listdir(os.path.join(root, "ckpt", "commits")))
    retained = sorted(n for n in os.listdir(os.path.join(root, "ckpt")) if n.startswith("chk-"))
    assert len(markers) == 2 and [m.split("-", 2)[2] for m in markers] == retained


def test_a_listener_failing_after_the_commit_never_reruns_the_batch(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    failed: list[int] = []

    def listener(stats: Any) -> None:
        if stats.batch_id == 1 and not failed:
            failed.append(1)
            raise TransientStorageError("listener: the metrics store is throttled")

    with pytest.raises(Exception, match="metrics store is throttled"):
        start(spark, root, listener=listener)
    query = start(spark, root)
    query.stop()
    check_against_pandas(root)
    assert query.stats[0].batch_id == 1 and query.stats[0].skipped_replay


def test_readme_idempotent_callback_sink_is_exactly_once_across_a_replay(spark, tmp_path):
    """The README's callback sink, called again for a batch after a crash that followed its
    write (before the sink-commit marker): the batch's rows are there once."""
    from pyspark.sql import functions as F

    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    calls: list[int] = []

    def upsert_batch(df: Any, batch_id: int) -> None:  # as in the README
        (df.withColumn("batch_id", F.lit(batch_id))
           .write.mode("overwrite").option("partitionOverwriteMode", "dynamic")
           .partitionBy("batch_id").parquet(os.path.join(root, "out")))
        calls.append(batch_id)
        if batch_id == 1 and calls.count(1) == 1:
            raise RuntimeError("driver crash after the callback wrote batch 1")

    with pytest.raises(Exception, match="driver crash after the callback"):
        start(spark, root, sink=upsert_batch)
    start(spark, root, sink=upsert_batch).stop()
    assert calls == [0, 1, 1, 2], "batch 1 is handed to the callback again, with the same rows"
    check_against_pandas(root)


# -- 2. a drained savepoint ----------------------------------------------------------------------

@pytest.mark.parametrize("location", ["spark", "spark-2"], ids=["same-location", "new-location"])
def test_drained_savepoint_restores_without_losing_the_next_batch(spark, tmp_path, location):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    first = start(spark, root)
    savepoint = first.stop(drain=True, savepoint=os.path.join(root, "sp"))
    drain_batch = first.stats[-1].batch_id
    assert drain_batch == 2, "the drain is a batch of its own"
    assert OffsetLog.at(os.path.join(root, "spark")).last_committed() == drain_batch
    write_files(os.path.join(root, "input"), 1, first=2)
    second = start(spark, root, ckpt="ckpt-2", location=location, restore_path=savepoint)
    second.stop()
    processed = [s.batch_id for s in second.stats if not s.skipped_replay]
    assert processed == [3], "the file after the drain is batch 3, processed once"
    check_totals(root)


# -- 3. a savepoint of a batch whose sinks had not committed -------------------------------------

def test_running_jobs_savepoint_commits_its_batch_first(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    sink = FailingSink(os.path.join(root, "out"), 1, str(tmp_path / "failed"))
    events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
              .parquet(os.path.join(root, "input")))
    job = key_by(events, "user_id").process(RunningTotals(), COUNT_SCHEMA).sink(sink)
    query = job.start(JobConfig(checkpoint_dir=os.path.join(root, "ckpt"), parallelism=2),
                      trigger={"availableNow": True},
                      spark_checkpoint_location=os.path.join(root, "spark"))
    with pytest.raises(Exception, match="driver stopped"):
        query.await_termination()
    assert not os.path.exists(os.path.join(root, "out")) or len(
        pd.read_parquet(os.path.join(root, "out")).batch_id.unique()) == 1
    # batch 1 is checkpointed, its output not committed; the savepoint commits it first
    query.driver.savepoint(os.path.join(root, "sp"))
    check_against_pandas(root)


@pytest.mark.parametrize("fmt", ["native", "canonical"])
def test_offline_savepoint_carries_uncommitted_output_and_the_restore_commits_it(spark, tmp_path,
                                                                                 fmt):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    failing = FailingSink(os.path.join(root, "out"), 1, str(tmp_path / "failed"))
    with pytest.raises(Exception, match="driver stopped"):
        start(spark, root, sink=failing)
    # an offline savepoint of the job's directory, after the driver is gone
    result = CliRunner().invoke(main, ["savepoint", "create", os.path.join(root, "ckpt"),
                                       os.path.join(root, "sp"), "--format", fmt, "--json"])
    assert result.exit_code == 0, result.output
    savepoint = json.loads(result.output)["savepoint"]
    carried = resolve_snapshot(savepoint).metadata.properties
    assert "staged" in carried and carried["batch_id"] == "1"
    write_files(os.path.join(root, "input"), 1, first=2)
    shutil.rmtree(os.path.join(root, "spark"))  # a new place: the positions come from the savepoint
    query = start(spark, root, ckpt="ckpt-2", location="spark-2", restore_path=savepoint)
    query.stop()
    assert [s.batch_id for s in query.stats] == [2]
    check_against_pandas(root)


class BatchFiles(Sink):
    """A sink idempotent by batch id that reads the staged rows, as a callback sink does:
    ``<path>/batch-<B>.parquet`` written over on every commit of batch B. Fails the first
    commit of ``fail_batch`` (a driver stopped between checkpoint commit and sink commit)."""

    def __init__(self, path: str, fail_batch: int = -1, marker: str = "") -> None:
        self.path = path
        self.fail_batch = fail_batch
        self.marker = marker

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        if batch_id == self.fail_batch and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise RuntimeError("driver stopped between checkpoint commit and sink commit")
        os.makedirs(self.path, exist_ok=True)
        pq.write_table(read_staged(staged), os.path.join(self.path, f"batch-{batch_id}.parquet"))


def test_claimed_savepoint_of_an_uncommitted_batch_keeps_its_output_when_spark_replays_it(
        spark, tmp_path):
    """CLAIM, in the Spark location of the crashed job: Spark runs the savepoint's batch again
    (the crash came before it recorded the batch), and the replay must not commit the claimed
    checkpoint's output: it has none of its own (the carried output was committed at start)."""
    root = str(tmp_path)
    out = os.path.join(root, "out")
    write_files(os.path.join(root, "input"), 2)
    with pytest.raises(Exception, match="driver stopped"):
        start(spark, root, sink=BatchFiles(out, 1, str(tmp_path / "failed")))
    result = CliRunner().invoke(main, ["savepoint", "create", os.path.join(root, "ckpt"),
                                       os.path.join(root, "sp"), "--json"])
    assert result.exit_code == 0, result.output
    write_files(os.path.join(root, "input"), 1, first=2)
    query = start(spark, root, ckpt="ckpt-2", restore_path=os.path.join(root, "sp"),
                  restore_mode="CLAIM", sink=BatchFiles(out))
    query.stop()
    assert [(s.batch_id, s.skipped_replay) for s in query.stats] == [(1, True), (2, False)]
    check_against_pandas(root)


class SavepointInSink(BatchFiles):
    """Takes a savepoint of the running job from inside its commit of one batch, before it
    reads the batch's staged rows (a sink that checkpoints an external system with the job)."""

    def __init__(self, path: str, batch_id: int, target: str) -> None:
        super().__init__(path)
        self.batch_id = batch_id
        self.target = target
        self.driver: Any = None

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        if batch_id == self.batch_id and not os.path.exists(self.target):
            self.driver.savepoint(self.target)
        super().commit(spark, batch_id, staged)


def run_with_driver(spark: Any, root: str, sink: SavepointInSink, **config: Any) -> Any:
    """A RunningTotals job over ``root/input`` into ``sink``, whose ``driver`` it sets, with
    the driver's ``foreachBatch`` started by hand; returns the query once it ended."""
    events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
              .parquet(os.path.join(root, "input")))
    job = key_by(events, "user_id").process(RunningTotals(), COUNT_SCHEMA).sink(sink)
    sink.driver = job.driver(
        JobConfig(checkpoint_dir=os.path.join(root, "ckpt"), parallelism=2, **config),
        os.path.join(root, "spark"))
    query = (events.writeStream.foreachBatch(sink.driver.process_batch)
             .option("checkpointLocation", os.path.join(root, "spark"))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    return query


def test_savepoint_from_inside_a_sink_commit_carries_the_batch_and_the_commit_goes_on(
        spark, tmp_path):
    root = str(tmp_path)
    out = os.path.join(root, "out")
    write_files(os.path.join(root, "input"), 2)
    sink = SavepointInSink(out, 1, os.path.join(root, "sp"))
    run_with_driver(spark, root, sink)  # the commit the savepoint interrupted finished
    check_against_pandas(root)
    # The savepoint covers batch 1, whose commit was under way: it carries the output.
    carried = resolve_snapshot(os.path.join(root, "sp")).metadata.properties
    assert carried["batch_id"] == "1" and "staged" in carried
    shutil.rmtree(out)
    write_files(os.path.join(root, "input"), 1, first=2)
    restored = start(spark, root, ckpt="ckpt-2", location="spark-2",
                     restore_path=os.path.join(root, "sp"), sink=BatchFiles(out))
    restored.stop()
    assert [s.batch_id for s in restored.stats] == [2]
    assert sorted(os.listdir(out)) == ["batch-1.parquet", "batch-2.parquet"], \
        "the carried batch 1, then batch 2"


# -- 4. a restore into a new Spark checkpoint location -------------------------------------------

def test_savepoint_restored_in_a_new_location_resumes_after_its_batch(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    savepoint = start(spark, root).stop(savepoint=os.path.join(root, "sp"))
    write_files(os.path.join(root, "input"), 2, first=2)
    query = start(spark, root, ckpt="ckpt-2", location="spark-2", restore_path=savepoint)
    query.stop()
    assert [s.batch_id for s in query.stats] == [2, 3]
    check_against_pandas(root)
    # restarting the restored job in its own location goes on from there
    write_files(os.path.join(root, "input"), 1, first=4)
    again = start(spark, root, ckpt="ckpt-2", location="spark-2", restore_path=savepoint)
    again.stop()
    assert [s.batch_id for s in again.stats] == [4]
    check_against_pandas(root)


@pytest.mark.s3
def test_savepoint_on_s3_carries_its_positions_to_a_new_location(spark, s3_bucket, tmp_path):
    """Checkpoints and savepoints on the local S3 server: the context files go through the
    store too (written, listed, read back by the restoring driver)."""
    url, options = s3_bucket
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    first = start(spark, root, checkpoint_dir=f"{url}/ckpt", storage_options=options)
    savepoint = first.stop(savepoint=f"{url}/sp")
    carried = resolve_snapshot(savepoint, options).metadata.properties
    assert carried["spark_source_log"] == "context/spark-source"
    write_files(os.path.join(root, "input"), 1, first=2)
    query = start(spark, root, location="spark-2", checkpoint_dir=f"{url}/ckpt-2",
                  storage_options=options, restore_path=savepoint)
    query.stop()
    assert [s.batch_id for s in query.stats] == [2]
    check_against_pandas(root)


def test_restore_that_fails_before_its_first_checkpoint_starts_again_from_the_seeded_location(
        spark, tmp_path):
    """The new location is seeded, then the first checkpoint fails (its _metadata write, past
    every retry): the restarted job finds its own seed and resumes after the savepoint's batch
    again, exactly once."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    savepoint = start(spark, root).stop(savepoint=os.path.join(root, "sp"))
    write_files(os.path.join(root, "input"), 1, first=2)
    plan = FaultPlan(tmp_path / "faults.json")
    plan.add("write", "internal", match="/_metadata", times=1)
    faulty = dict(checkpoint_dir=plan.url(os.path.join(root, "ckpt-2")),
                  storage_options=plan.storage_options("file"), transfer_attempts=1,
                  tolerable_failed_checkpoints=0)
    with pytest.raises(Exception, match="_metadata"):
        start(spark, root, location="spark-2", restore_path=savepoint, **faulty)
    assert OffsetLog.at(os.path.join(root, "spark-2")).last_committed() == 1  # seeded, no more
    query = start(spark, root, location="spark-2", restore_path=savepoint, **faulty)
    query.stop()
    assert [s.batch_id for s in query.stats] == [2]
    check_against_pandas(root)


def test_older_checkpoint_restored_in_a_new_location_resumes_after_its_own_batch(spark,
                                                                               tmp_path):
    """The old job went on after the checkpoint: the new location is seeded only up to the
    checkpoint's batch, so the batch after it is processed again from that state (into
    another sink: over the old job's batch 2 it would be a rollback, tests/spark/
    test_rollback.py)."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    start(spark, root, num_retained=2).stop()
    ids = sorted(int(n.split("-")[1]) for n in os.listdir(os.path.join(root, "ckpt"))
                 if n.startswith("chk-"))
    older = resolve_snapshot(os.path.join(root, "ckpt", f"chk-{ids[0]}"))
    assert older.metadata.properties["batch_id"] == "1"
    query = start(spark, root, ckpt="ckpt-2", location="spark-2",
                  restore_path=os.path.join(root, "ckpt", f"chk-{ids[0]}"),
                  sink=ParquetSink(os.path.join(root, "out-2")))
    query.stop()
    assert [s.batch_id for s in query.stats] == [2]
    old = pd.read_parquet(os.path.join(root, "out"))
    check_against_pandas(root, pd.concat([old[old.batch_id <= 1],
                                          pd.read_parquet(os.path.join(root, "out-2"))]))


def test_restore_without_source_positions_is_refused_unless_told_to_ignore_them(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    start(spark, root).stop()
    shutil.rmtree(os.path.join(root, "spark"))  # the job's source positions are gone
    with pytest.raises(SourcePositionsError, match="source-positions=ignore"):
        start(spark, root, ckpt="ckpt-2", location="spark-2",
              restore_path=os.path.join(root, "ckpt"))
    assert not os.path.exists(os.path.join(root, "ckpt-2", "chk-1")), "nothing was started"
    query = start(spark, root, ckpt="ckpt-3", location="spark-3",
                  restore_path=os.path.join(root, "ckpt"), source_positions="ignore")
    query.stop()
    assert [s.batch_id for s in query.stats] == [0, 1], "the input is read again, as asked"


def test_restart_with_the_spark_location_deleted_is_refused(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    start(spark, root).stop()
    shutil.rmtree(os.path.join(root, "spark"))
    with pytest.raises(SourcePositionsError, match="is empty"):
        start(spark, root)
    check_against_pandas(root)
