"""KeyedQuery: the errors a failed batch raises."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd
import pytest

from keyedstate.config import JobConfig
from keyedstate.errors import BatchFailedError
from keyedstate.spark.job import key_by
from keyedstate.spark.query import KeyedQuery
from keyedstate.spark.sinks import ParquetSink
from tests.spark.jobs import COUNT_SCHEMA, FailOnKey
from tests.spark.test_job import SCHEMA, write_files


def start_job(spark: Any, root: str, fn: Any, parallelism: int) -> KeyedQuery:
    events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
              .parquet(os.path.join(root, "input")))
    job = key_by(events, "user_id").process(fn, COUNT_SCHEMA)
    job.sink(ParquetSink(os.path.join(root, "out")))
    return job.start(JobConfig(checkpoint_dir=os.path.join(root, "ckpt"), parallelism=parallelism),
                     trigger={"availableNow": True},
                     spark_checkpoint_location=os.path.join(root, "spark"))


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
