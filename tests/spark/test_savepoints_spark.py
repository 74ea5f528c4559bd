"""Savepoints of a running Spark job: taken without stopping it, read by the state processor
API, claimed by a new job at another parallelism; results against pandas over the input."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pandas as pd
import pytest

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.config import JobConfig
from keyedstate.errors import SnapshotExistsError
from keyedstate.runtime.function import KeyedProcessFunction
from keyedstate.spark.api import key_by
from keyedstate.spark.query import KeyedQuery
from keyedstate.spark.sinks import ParquetSink
from tests.spark.jobs import COUNT_SCHEMA, RunningTotals
from tests.spark.test_job import SCHEMA, check_against_pandas, write_files

pytestmark = pytest.mark.spark


def start(spark: Any, root: str, parallelism: int, input_dir: str | None = None,
          fn: KeyedProcessFunction | None = None, **config: Any) -> KeyedQuery:
    """A running job of ``fn`` (default :class:`RunningTotals`) over ``input_dir`` (default
    ``root/input``; one file per batch) writing ``root/out``."""
    events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
              .parquet(input_dir or os.path.join(root, "input")))
    job = (key_by(events, "user_id").process(fn or RunningTotals(), COUNT_SCHEMA)
           .sink(ParquetSink(os.path.join(root, "out"))))
    return job.start(JobConfig(checkpoint_dir=os.path.join(root, "ckpt"),
                               parallelism=parallelism, **config),
                     spark_checkpoint_location=os.path.join(root, "spark"))


def publish(staging: str, input_dir: str) -> None:
    """One more input file for a running query, appearing whole with its final
    modification time (written elsewhere, then renamed): the file source must never list it
    with a newer time than it ends up with, or it drops the older files as too old."""
    write_files(staging, 1, first=1)
    for name in sorted(os.listdir(staging)):
        os.rename(os.path.join(staging, name), os.path.join(input_dir, name))


def test_trigger_savepoint_on_a_running_job_then_restore_at_another_parallelism(spark,
                                                                                tmp_path):
    job1 = str(tmp_path / "job1")
    write_files(os.path.join(job1, "input"), 1)
    query = start(spark, job1, parallelism=2)
    query.process_all_available()
    # A savepoint while the query runs: the job goes on afterwards.
    url = query.trigger_savepoint(str(tmp_path / "sp"))
    assert query.query.isActive
    with pytest.raises(SnapshotExistsError):
        query.trigger_savepoint(str(tmp_path / "sp"))
    publish(str(tmp_path / "later"), os.path.join(job1, "input"))
    query.process_all_available()
    query.stop()
    assert [s.batch_id for s in query.stats] == [0, 1]
    check_against_pandas(job1)  # both batches, exactly once, across the savepoint
    snapshot = resolve_snapshot(url).metadata
    assert (snapshot.kind, snapshot.properties["batch_id"]) == ("savepoint", "0")
    # Relocate it; the state processor API reads it there (the state after batch 0).
    shutil.move(str(tmp_path / "sp"), str(tmp_path / "moved"))
    from keyedstate.spark.processor import SavepointReader

    first_file = pd.read_parquet(os.path.join(job1, "input", "part-000.parquet"))
    after_batch_0 = first_file.groupby("user_id")["amount"].agg(["size", "sum"])
    reader = SavepointReader.read(spark, str(tmp_path / "moved"))
    state = reader.state("totals").toPandas().sort_values(reader.key_columns[0])
    assert list(state[reader.key_columns[0]]) == sorted(after_batch_0.index)
    assert [v["count"] for v in state["value"]] == list(after_batch_0.sort_index()["size"])
    # A new job claims it (CLAIM) at parallelism 3, in a Spark checkpoint location of its own:
    # the savepoint's source positions make it resume after batch 0, so it reads the later
    # file only.
    job2 = str(tmp_path / "job2")
    restored = start(spark, job2, parallelism=3, input_dir=os.path.join(job1, "input"),
                     restore_path=str(tmp_path / "moved"), restore_mode="CLAIM")
    restored.process_all_available()
    restored.stop()
    first = [s for s in restored.stats if s.checkpoint_id >= 0][0]
    assert first.restored_subtasks == 3 and len(first.state_bytes_per_subtask) == 3
    assert not os.path.exists(tmp_path / "moved")  # claimed, then subsumed: deleted
    # Every user's last row equals pandas over both files (state carried over).
    events = pd.concat(pd.read_parquet(os.path.join(job1, "input", n))
                       for n in sorted(os.listdir(os.path.join(job1, "input"))))
    expected = events.groupby("user_id")["amount"].agg(["size", "sum"])
    out = pd.read_parquet(os.path.join(job2, "out")).sort_values("batch_id")
    last = out.groupby("user_id").last()
    assert len(last) > 0 and set(out.batch_id) == {1}
    assert (last["count"] == expected.loc[last.index, "size"]).all()
    assert ((last["total"] - expected.loc[last.index, "sum"]).abs() < 1e-6).all()
