"""The state processor API on Spark: read a job's checkpoint as DataFrames, bootstrap a job
from a DataFrame, transform (read, change with Spark, write, restore); each checked against a
pandas oracle over the input files."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd
import pytest

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.errors import ConfigurationError, SnapshotExistsError
from keyedstate.spark.processor import SavepointReader, SavepointWriter
from tests.spark.jobs import RunningTotals
from tests.spark.test_job import run_job, write_files

pytestmark = pytest.mark.spark

EVENTS, USERS = 400, 40


def totals_of(root: str, files: list[str]) -> pd.DataFrame:
    """pandas: count and total per user over the given input files."""
    frames = [pd.read_parquet(os.path.join(root, "input", f)) for f in files]
    return (pd.concat(frames).groupby("user_id")["amount"].agg(["size", "sum"])
            .rename(columns={"size": "count", "sum": "total"}))


def check_outputs(root: str, initial: pd.DataFrame) -> None:
    """Each output row = the user's initial state plus everything up to its batch."""
    out = pd.read_parquet(os.path.join(root, "out"))
    files = sorted(os.listdir(os.path.join(root, "input")))
    assert not out.duplicated(["user_id", "batch_id"]).any()
    for batch_id in sorted(out.batch_id.unique()):
        cumulative = totals_of(root, files[:batch_id + 1]).add(initial, fill_value=0)
        got = out[out.batch_id == batch_id].set_index("user_id")
        assert (got["count"] == cumulative.loc[got.index, "count"]).all()
        assert ((got["total"] - cumulative.loc[got.index, "total"]).abs() < 1e-6).all()
    assert len(out.batch_id.unique()) == len(files)


def state_frame(reader: SavepointReader) -> pd.DataFrame:
    df = reader.state("totals").toPandas()
    key = reader.key_columns[0]
    return pd.DataFrame({"user_id": df[key], "count": df["value"].map(lambda v: v["count"]),
                         "total": df["value"].map(lambda v: v["total"])}).set_index("user_id")


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_read_a_spark_jobs_checkpoint(spark: Any, tmp_path: Any, backend: str) -> None:
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2, events=EVENTS, users=USERS)
    run_job(spark, root, RunningTotals(), parallelism=2, backend=backend)
    reader = SavepointReader.read(spark, os.path.join(root, "ckpt"))
    assert reader.state_names == ["totals"]
    assert reader.key_columns == ["user_id"]  # the job records its key columns
    df = reader.state("totals")
    assert df.rdd.getNumPartitions() == 2  # one task per key-group range
    assert [f.name for f in df.schema.fields] == ["key_group", "user_id", "namespace", "value"]
    got = state_frame(reader).sort_index()
    expected = totals_of(root, sorted(os.listdir(os.path.join(root, "input")))).sort_index()
    assert list(got.index) == list(expected.index)
    assert (got["count"] == expected["count"]).all()
    assert ((got["total"] - expected["total"]).abs() < 1e-6).all()
    assert reader.timers().count() == 0
    # Any parallelism of the read gives the same rows.
    assert reader.state("totals", splits=5).count() == len(expected)


def test_bootstrap_a_job_from_a_dataframe(spark: Any, tmp_path: Any) -> None:
    from pyspark.sql import functions as F

    root = str(tmp_path)
    initial = pd.DataFrame({"user_id": [f"u{i:04d}" for i in range(0, USERS + 10, 2)]})
    initial["count"] = range(len(initial))
    initial["total"] = [i * 0.5 for i in range(len(initial))]
    savepoint = os.path.join(root, "bootstrap")
    writer = SavepointWriter.new_savepoint(64, key_columns=["user_id"], key_types=["string"])
    df = spark.createDataFrame(initial)
    # Fields in another order than the state's type: matched by name.
    writer.with_state(RunningTotals.totals, df, value_column=F.struct("total", "count"))
    writer.write(savepoint)
    with pytest.raises(SnapshotExistsError):
        writer.write(savepoint)
    meta = resolve_snapshot(savepoint).metadata
    assert (meta.format, meta.max_parallelism) == ("canonical", 64)
    # The job starts from it (heap backend, 3 subtasks) and runs over new input.
    write_files(os.path.join(root, "input"), 2, events=EVENTS, users=USERS)
    run_job(spark, root, RunningTotals(), parallelism=3, backend="heap",
            restore_path=savepoint, max_parallelism=64)
    check_outputs(root, initial.set_index("user_id")[["count", "total"]])


def test_transform_read_change_write_restore(spark: Any, tmp_path: Any) -> None:
    from pyspark.sql import functions as F

    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    write_files(os.path.join(first, "input"), 2, events=EVENTS, users=USERS)
    run_job(spark, first, RunningTotals(), parallelism=2, backend="rocksdb")
    reader = SavepointReader.read(spark, os.path.join(first, "ckpt"))
    key = reader.key_columns[0]
    # With Spark: drop users below u0010, reset everyone else's count to 100.
    changed = (reader.state("totals").where(F.col(key) >= "u0010")
               .withColumn("value", F.struct(F.lit(100).cast("bigint").alias("count"),
                                             F.col("value.total").alias("total"))))
    savepoint = str(tmp_path / "transformed")
    (SavepointWriter.from_existing(spark, os.path.join(first, "ckpt"))
     .with_state(RunningTotals.totals, changed).write(savepoint))
    state = state_frame(SavepointReader.read(spark, savepoint)).sort_index()
    before = totals_of(first, sorted(os.listdir(os.path.join(first, "input"))))
    kept = before[before.index >= "u0010"].assign(count=100).sort_index()
    assert list(state.index) == list(kept.index) and (state["count"] == 100).all()
    # A new job (heap, 3 subtasks) from the transformed savepoint, over new input.
    write_files(os.path.join(second, "input"), 2, events=EVENTS, users=USERS, seed=9)
    run_job(spark, second, RunningTotals(), parallelism=3, backend="heap",
            restore_path=savepoint, source_positions="ignore")
    check_outputs(second, kept)


def test_duplicate_entries_are_refused(spark: Any, tmp_path: Any) -> None:
    from pyspark.sql import functions as F

    df = spark.createDataFrame([("u1", 1, 1.0), ("u1", 2, 2.0)], "user_id string, count bigint, "
                                                                "total double")
    writer = (SavepointWriter.new_savepoint(16, key_columns=["user_id"], key_types=["string"])
              .with_state(RunningTotals.totals, df, value_column=F.struct("count", "total")))
    with pytest.raises(ConfigurationError, match="twice"):
        writer.write(str(tmp_path / "dup"))
    assert not os.path.exists(tmp_path / "dup" / "_metadata")


def test_what_tasks_receive_pickles(tmp_path: Any) -> None:
    import pickle

    import pyarrow as pa

    from keyedstate.checkpoint.resolve import ResolvedSnapshot
    from keyedstate.processor.canonical import canonical_metadata
    from keyedstate.runtime.subtask import RestoreSource
    from keyedstate.spark.processor_tasks import ReadPlan, WritePlan
    from keyedstate.state.descriptors import ValueStateDescriptor
    from keyedstate.state.evolution import SchemaEvolution
    from keyedstate.storage.checkpoint_storage import CheckpointStorage

    storage = CheckpointStorage(str(tmp_path))
    metadata = canonical_metadata(checkpoint_id=0, max_parallelism=8, key_types=["string"],
                                  key_columns=["user_id"], handles=[])
    snapshot = ResolvedSnapshot(storage, "_metadata", metadata)
    schema = pa.schema([("key_group", pa.int32())])
    evolved = ValueStateDescriptor("totals", "struct<n:bigint,total:double>",
                                   evolution=SchemaEvolution(renames={"n": "count"}))
    for obj in (ReadPlan(snapshot, 2, "totals", ["user_id"], schema, 0),
                ReadPlan(snapshot, 2, evolved, ["user_id"], schema, 0),
                WritePlan(storage, "states/totals", "totals", None, 2, 8, ["user_id"], schema,
                           False, False, False),
                RestoreSource(0, storage, [], 1, None, metadata)):
        again = pickle.loads(pickle.dumps(obj))
        assert again == obj or repr(again) == repr(obj)
