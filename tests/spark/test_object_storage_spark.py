"""A keyed Spark job checkpointing to the local S3 server through the fault-injecting wrapper:
throttled uploads are retried by the executors, a checkpoint that fails is aborted and its
batch run again, and a missing bucket stops the job at start."""

from __future__ import annotations

import os

import pytest

from keyedstate.config import JobConfig
from keyedstate.errors import StorageLocationError
from keyedstate.processor.inspection import find_garbage
from keyedstate.spark.api import key_by
from keyedstate.spark.sinks import ParquetSink
from keyedstate.testing.faults import FaultPlan
from tests.spark.jobs import COUNT_SCHEMA, RunningTotals
from tests.spark.test_job import SCHEMA, check_against_pandas, write_files

pytestmark = [pytest.mark.spark, pytest.mark.s3]


def test_throttled_checkpoints_are_retried_and_the_job_goes_on(spark, s3_bucket, tmp_path):
    url, options = s3_bucket
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    plan = FaultPlan(tmp_path / "faults.json")
    # executors: two throttled uploads, absorbed by the per-call retries
    plan.add("write", "slowdown", match="/shared/", times=2)
    # driver: checkpoint 2's _metadata fails twice = every attempt: the checkpoint is aborted
    # and batch 1 runs again as checkpoint 3
    plan.add("write", "internal", match="chk-2/_metadata", times=2)
    events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
              .parquet(os.path.join(root, "input")))
    job = key_by(events, "user_id").process(RunningTotals(), COUNT_SCHEMA)
    job.sink(ParquetSink(os.path.join(root, "out")))
    query = job.start(JobConfig(checkpoint_dir=plan.url(f"{url}/ckpt"), parallelism=2,
                                storage_options=plan.storage_options("s3", options),
                                transfer_attempts=2, memory_threshold=1024),
                      trigger={"availableNow": True},
                      spark_checkpoint_location=os.path.join(root, "spark"))
    query.await_termination()
    query.stop()
    check_against_pandas(root)  # nothing lost, nothing doubled
    fired = plan.fired()
    assert sum(f["path"].endswith("chk-2/_metadata") for f in fired) == 2
    assert sum("/shared/" in f["path"] for f in fired) == 2
    stats = [s for s in query.stats if s.checkpoint_id >= 0]
    assert [(s.batch_id, s.checkpoint_id, s.attempts) for s in stats] == [(0, 1, 1), (1, 3, 2)]
    assert all(s.uploaded_bytes > 0 for s in stats)
    garbage = find_garbage(f"{url}/ckpt", options).files
    assert [f for f in garbage if f.startswith(("shared/", "chk-"))] == []


def test_callback_sink_with_checkpoints_on_s3(spark, s3_bucket, tmp_path):
    """The staged output lies in S3, which Spark's JVM can't read (no ``s3`` filesystem): the
    callback still gets every batch's rows, read through fsspec, as a DataFrame of the declared
    schema, also for a batch without output rows (an input file without rows)."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from keyedstate.spark.schema import to_arrow_schema, to_spark_schema

    url, options = s3_bucket
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    empty = os.path.join(root, "input", "part-002.parquet")
    pq.write_table(pa.schema([("user_id", pa.string()), ("ts", pa.timestamp("us", tz="UTC")),
                              ("amount", pa.float64())]).empty_table(), empty)
    os.utime(empty, (1_700_000_002, 1_700_000_002))
    got: list[tuple[int, object, pd.DataFrame]] = []
    events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
              .parquet(os.path.join(root, "input")))
    job = key_by(events, "user_id").process(RunningTotals(), COUNT_SCHEMA)
    job.sink(lambda df, batch_id: got.append((batch_id, df.schema, df.toPandas())))
    query = job.start(JobConfig(checkpoint_dir=f"{url}/ckpt", parallelism=2,
                                storage_options=options),
                      trigger={"availableNow": True},
                      spark_checkpoint_location=os.path.join(root, "spark"))
    query.await_termination()
    query.stop()
    declared = to_spark_schema(to_arrow_schema(COUNT_SCHEMA))
    assert [(b, s) for b, s, _ in got] == [(0, declared), (1, declared), (2, declared)]
    assert got[2][2].empty and list(got[2][2].columns) == declared.names
    check_against_pandas(root, pd.concat([df for _, _, df in got], ignore_index=True))


def test_missing_bucket_stops_the_job_before_the_first_batch(spark, s3_bucket, tmp_path):
    _, options = s3_bucket
    write_files(str(tmp_path / "input"), 1)
    events = spark.readStream.schema(SCHEMA).parquet(str(tmp_path / "input"))
    job = key_by(events, "user_id").process(RunningTotals(), COUNT_SCHEMA)
    with pytest.raises(StorageLocationError, match="no-such-bucket-keyedstate"):
        job.start(JobConfig(checkpoint_dir="s3://no-such-bucket-keyedstate/job",
                            storage_options=options),
                  spark_checkpoint_location=str(tmp_path / "spark"))
    assert not os.path.exists(tmp_path / "spark")
