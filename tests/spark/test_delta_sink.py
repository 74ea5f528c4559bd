"""DeltaSink on real delta-rs: one Delta commit per batch, idempotent by the Delta application
transaction (lineage, batch id), partition columns, an incompatible table refused at start(),
S3 through the local S3 server, and real Spark jobs with a driver crash on either side of the
Delta commit. Tables are read back with delta-rs (``DeltaTable.to_pyarrow_table``): DuckDB's
``delta_scan`` needs its delta extension, which it downloads (not available offline)."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from keyedstate.errors import BatchFailedError, ConfigurationError, SinkSchemaError
from keyedstate.spark.delta_sink import COMMIT_BATCH_ID, COMMIT_LINEAGE, DeltaSink
from keyedstate.spark.sinks import StagedOutput
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from tests.spark.jobs import RunningTotals
from tests.spark.test_job import check_against_pandas, run_job, write_files
from tests.spark.test_sinks import LINEAGE, SCHEMA, CrashAroundCommit, stage

deltalake = pytest.importorskip("deltalake")


def rows(uri: str, storage_options: dict[str, str] | None = None) -> pd.DataFrame:
    return deltalake.DeltaTable(uri, storage_options=storage_options).to_pyarrow_table() \
        .to_pandas()


def batch_commits(uri: str, storage_options: dict[str, str] | None = None
                  ) -> list[tuple[int, str, int]]:
    """``(Delta version, lineage, batch id)`` of each of the sink's commits, oldest first."""
    history = deltalake.DeltaTable(uri, storage_options=storage_options).history()
    return sorted((h["version"], h[COMMIT_LINEAGE], int(h[COMMIT_BATCH_ID]))
                  for h in history if COMMIT_BATCH_ID in h)


# -- the sink alone (no Spark: DeltaSink.commit does not use it) ---------------------------------

def test_each_batch_is_one_commit_and_a_replay_adds_nothing(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    uri = str(tmp_path / "table")
    sink = DeltaSink(uri)
    sink.open(SCHEMA)  # no table yet: nothing to check, nothing created
    assert not os.path.exists(uri)
    batch0, batch1 = stage(storage, 0, 3), stage(storage, 1, 2)
    sink.commit(None, 0, batch0)
    sink.commit(None, 0, batch0)  # a replay: the transaction covers it
    sink.commit(None, 1, batch1)
    sink.commit(None, 1, batch1)
    sink.commit(None, 0, batch0)  # an older batch of the lineage: covered too
    sink.commit(None, 2, StagedOutput(storage, [], SCHEMA, LINEAGE))  # no rows: no commit
    table = deltalake.DeltaTable(uri)
    assert batch_commits(uri) == [(0, LINEAGE, 0), (1, LINEAGE, 1)]
    assert table.version() == 1 and table.transaction_version(LINEAGE) == 1
    got = rows(uri)
    assert len(got) == 25 and not got.duplicated(["user_id", "batch_id"]).any()
    assert pa.schema(table.schema().to_arrow()) == SCHEMA
    # Another lineage (a new query: batch ids from 0 again) is its own transaction.
    sink.commit(None, 0, stage(storage, 0, 1, lineage="job-b"))
    assert batch_commits(uri)[-1] == (2, "job-b", 0) and len(rows(uri)) == 30


def test_partition_columns(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    uri = str(tmp_path / "table")
    sink = DeltaSink(uri, partition_by=["batch_id"])
    for batch_id in range(3):
        sink.commit(None, batch_id, stage(storage, batch_id, 2))
    table = deltalake.DeltaTable(uri)
    assert table.metadata().partition_columns == ["batch_id"]
    assert sorted(os.path.basename(os.path.dirname(f)) for f in table.file_uris()) == [
        f"batch_id={b}" for b in range(3)]  # delta-rs writes one file per partition
    assert sorted(rows(uri).groupby("batch_id").size().items()) == [(0, 10), (1, 10), (2, 10)]
    with pytest.raises(ConfigurationError, match=r"partition columns \['day'\]"):
        DeltaSink(uri, partition_by=["day"]).open(SCHEMA)


def test_an_incompatible_table_is_refused_and_a_compatible_one_taken(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    # delta-rs alone would cast doubles into the bigint column silently
    wrong = str(tmp_path / "wrong")
    deltalake.DeltaTable.create(wrong, pa.schema([("user_id", pa.string()),
                                                  ("count", pa.float64()),
                                                  ("extra", pa.string())]))
    with pytest.raises(SinkSchemaError) as refused:
        DeltaSink(wrong).open(SCHEMA)
    message = str(refused.value)
    assert "column 'count' is double in the table, long in the output" in message
    assert "column 'ts' is missing from the table" in message
    assert "the table's column 'extra' is not in the output" in message
    assert "Table schema: user_id string, count double, extra string" in message
    assert "output schema: user_id string, count long, ts timestamp, batch_id long" in message
    partitioned = str(tmp_path / "partitioned")
    deltalake.DeltaTable.create(partitioned, SCHEMA, partition_by=["user_id"])
    with pytest.raises(SinkSchemaError, match=r"partitioned by \['user_id'\], the sink by "
                                              r"\['batch_id'\]"):
        DeltaSink(partitioned, partition_by=["batch_id"]).open(SCHEMA)
    not_null = str(tmp_path / "not-null")
    deltalake.DeltaTable.create(not_null, pa.schema(
        [pa.field("user_id", pa.string(), nullable=False), *list(SCHEMA)[1:]]))
    with pytest.raises(SinkSchemaError, match="'user_id' is NOT NULL in the table"):
        DeltaSink(not_null).open(SCHEMA)
    # The same columns in another order (and the table's partitioning, none given): taken.
    reordered = str(tmp_path / "reordered")
    deltalake.DeltaTable.create(reordered, pa.schema(list(reversed(list(SCHEMA)))),
                                partition_by=["user_id"])
    sink = DeltaSink(reordered)
    sink.open(SCHEMA)
    sink.commit(None, 0, stage(storage, 0, 2))
    assert len(rows(reordered)) == 10
    with pytest.raises(ConfigurationError, match="mode 'overwrite' is not supported"):
        DeltaSink(reordered, mode="overwrite")


def delta_storage_options(fsspec_options: dict[str, Any]) -> dict[str, str]:
    """delta-rs (object_store) options for the local S3 server the fsspec ``options`` of the
    ``s3_bucket`` fixture reach."""
    return {"AWS_ENDPOINT_URL": fsspec_options["client_kwargs"]["endpoint_url"],
            "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": fsspec_options["key"],
            "AWS_SECRET_ACCESS_KEY": fsspec_options["secret"]}


@pytest.mark.s3
def test_on_s3_through_the_local_s3_server(s3_bucket, tmp_path):
    """delta-rs commits on S3 by conditional put (``If-None-Match``), which the local S3
    server implements; no locking provider, no unsafe rename."""
    url, options = s3_bucket
    delta_options = delta_storage_options(options)
    staging = CheckpointStorage(f"{url}/ckpt", options)  # staged on S3 too
    uri = f"{url}/table"
    sink = DeltaSink(uri, delta_options, partition_by=["batch_id"])
    sink.open(SCHEMA)
    batches = [stage(staging, b, 2) for b in range(2)]
    for batch_id, batch in enumerate(batches):
        sink.commit(None, batch_id, batch)
        sink.commit(None, batch_id, batch)
    assert batch_commits(uri, delta_options) == [(0, LINEAGE, 0), (1, LINEAGE, 1)]
    got = rows(uri, delta_options)
    assert len(got) == 20 and not got.duplicated(["user_id", "batch_id"]).any()
    with pytest.raises(SinkSchemaError):
        DeltaSink(uri, delta_options).open(pa.schema([("user_id", pa.int32())]))


# -- real Spark jobs -----------------------------------------------------------------------------

class CrashingDeltaSink(CrashAroundCommit, DeltaSink):
    """DeltaSink dying once around the Delta commit of batch ``batch_id``."""

    table_format = "Delta"

    def __init__(self, uri: str, batch_id: int, marker: str, after: bool) -> None:
        super().__init__(uri)
        self.crash_once(batch_id, marker, after)


@pytest.mark.spark
def test_spark_job_into_delta_equals_pandas_one_version_per_batch(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    uri = os.path.join(root, "table")
    query = run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(DeltaSink(uri),))
    check_against_pandas(root, rows(uri))
    lineage = query.query.id
    assert batch_commits(uri) == [(b, lineage, b) for b in range(3)]
    # A restart from the same checkpoint: nothing to do, nothing written.
    run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(DeltaSink(uri),))
    assert deltalake.DeltaTable(uri).version() == 2


@pytest.mark.spark
@pytest.mark.parametrize("after", [False, True], ids=["before-delta-commit",
                                                      "after-delta-commit"])
def test_driver_crash_around_the_delta_commit_then_restart_is_exactly_once(spark, tmp_path,
                                                                          after):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    uri = os.path.join(root, "table")
    sink = CrashingDeltaSink(uri, 1, str(tmp_path / "crashed"), after)
    with pytest.raises(BatchFailedError, match="driver stopped around the Delta commit"):
        run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(sink,))
    assert deltalake.DeltaTable(uri).version() == (1 if after else 0)
    query = run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(sink,))
    assert query.stats[0].skipped_replay, "batch 1 must be replayed from its checkpoint"
    check_against_pandas(root, rows(uri))
    lineage = query.query.id
    assert batch_commits(uri) == [(b, lineage, b) for b in range(3)]


@pytest.mark.spark
@pytest.mark.s3
def test_spark_job_into_delta_on_s3(spark, s3_bucket, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    url, options = s3_bucket
    uri, delta_options = f"{url}/table", delta_storage_options(options)
    sink = DeltaSink(uri, delta_options, partition_by=["batch_id"])
    query = run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(sink,))
    check_against_pandas(root, rows(uri, delta_options))
    assert batch_commits(uri, delta_options) == [(b, query.query.id, b) for b in range(2)]


@pytest.mark.spark
def test_incompatible_table_refused_by_start_before_anything_is_written(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    uri = os.path.join(root, "table")
    deltalake.DeltaTable.create(uri, pa.schema([("user_id", pa.string()),
                                                ("count", pa.int32())]))
    with pytest.raises(SinkSchemaError, match="column 'count' is integer in the table, long"):
        run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(DeltaSink(uri),))
    assert deltalake.DeltaTable(uri).version() == 0 and rows(uri).empty
    assert not os.path.exists(os.path.join(root, "out"))  # no batch ran
    assert not os.path.exists(os.path.join(root, "spark"))  # the query never started


def test_without_the_delta_extra_the_error_says_what_to_install(monkeypatch):
    import sys

    from keyedstate.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "deltalake", None)  # what an absent package raises
    sink = DeltaSink("/nowhere")  # constructing needs no delta-rs
    with pytest.raises(MissingDependencyError, match=r"pip install 'keyedstate\[delta\]'"):
        sink.open(SCHEMA)
