"""IcebergSink on real pyiceberg with its SQL catalog on SQLite: one snapshot per batch,
idempotent by the (lineage, batch id) in the snapshot summary, identity partitions, an
incompatible table refused at start(), a warehouse on the local S3 server, and real Spark jobs
with a driver crash on either side of the Iceberg commit. Tables are read back through a catalog
loaded afresh (another SQLite connection) with pyiceberg's scan (``scan().to_pandas()``):
DuckDB's ``iceberg_scan`` needs its iceberg extension, which it downloads (not available
offline)."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from keyedstate.errors import BatchFailedError, ConfigurationError, SinkSchemaError
from keyedstate.spark.iceberg_sink import DEFAULT_CATALOG_NAME, IcebergSink, committed_batch_id
from keyedstate.spark.sinks import COMMIT_BATCH_ID, COMMIT_LINEAGE, StagedOutput
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from tests.spark.jobs import RunningTotals
from tests.spark.test_job import check_against_pandas, run_job, write_files
from tests.spark.test_sinks import LINEAGE, SCHEMA, CrashAroundCommit, stage

pyiceberg_catalog = pytest.importorskip("pyiceberg.catalog")

TABLE = "analytics.counts"


def catalog_properties(directory: str, warehouse: str | None = None,
                       **extra: str) -> dict[str, str]:
    """A SQL catalog on SQLite in ``directory``, its warehouse there too unless given."""
    os.makedirs(directory, exist_ok=True)
    return {"type": "sql", "uri": f"sqlite:///{directory}/catalog.db",
            "warehouse": warehouse or f"file://{directory}/warehouse", **extra}


def load_catalog(properties: dict[str, str]) -> Any:
    """The sink's catalog loaded afresh (another SQLite connection). A SQL catalog keeps the
    tables of every catalog name in one database: the name is part of a table's identity."""
    return pyiceberg_catalog.load_catalog(DEFAULT_CATALOG_NAME, **properties)


def load_table(properties: dict[str, str], table: str = TABLE) -> Any:
    """The table through a catalog loaded afresh (not the sink's)."""
    return load_catalog(properties).load_table(table)


def rows(properties: dict[str, str], table: str = TABLE) -> pd.DataFrame:
    return load_table(properties, table).scan().to_pandas()


def batch_snapshots(properties: dict[str, str], table: str = TABLE) -> list[tuple[str, int]]:
    """``(lineage, batch id)`` of each of the sink's snapshots, oldest first (the current
    snapshot's ancestry)."""
    from pyiceberg.table.snapshots import ancestors_of

    loaded = load_table(properties, table)
    return [(s.summary[COMMIT_LINEAGE], int(s.summary[COMMIT_BATCH_ID]))
            for s in reversed(list(ancestors_of(loaded.current_snapshot(), loaded.metadata)))
            if s.summary is not None and COMMIT_BATCH_ID in s.summary]


# -- the sink alone (no Spark: IcebergSink.commit does not use it) -------------------------------

def test_each_batch_is_one_snapshot_and_a_replay_adds_nothing(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    properties = catalog_properties(str(tmp_path / "catalog"))
    sink = IcebergSink(properties, TABLE)
    sink.open(SCHEMA)  # no table yet: nothing to check, nothing created
    assert not sink.catalog().table_exists(TABLE)
    batch0, batch1 = stage(storage, 0, 3), stage(storage, 1, 2)
    sink.commit(None, 0, batch0)
    sink.commit(None, 0, batch0)  # a replay: the newest snapshot of the lineage covers it
    sink.commit(None, 1, batch1)
    sink.commit(None, 1, batch1)
    sink.commit(None, 0, batch0)  # an older batch of the lineage: covered too
    sink.commit(None, 2, StagedOutput(storage, [], SCHEMA, LINEAGE))  # no rows: no snapshot
    table = load_table(properties)
    assert batch_snapshots(properties) == [(LINEAGE, 0), (LINEAGE, 1)]
    assert len(table.snapshots()) == 2 and committed_batch_id(table, LINEAGE) == 1
    got = rows(properties)
    assert len(got) == 25 and not got.duplicated(["user_id", "batch_id"]).any()
    assert table.scan().to_arrow().schema == SCHEMA
    # Another lineage (a new query: batch ids from 0 again) is looked up on its own.
    sink.commit(None, 0, stage(storage, 0, 1, lineage="job-b"))
    assert batch_snapshots(properties)[-1] == ("job-b", 0) and len(rows(properties)) == 30
    assert committed_batch_id(load_table(properties), LINEAGE) == 1
    assert committed_batch_id(load_table(properties), "job-c") is None


def test_only_the_current_snapshots_ancestry_counts(tmp_path):
    """A snapshot rolled back out of the table's history (here: the table reset to batch 0's
    snapshot) no longer covers its batch: the replay appends it again, once."""
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    properties = catalog_properties(str(tmp_path / "catalog"))
    sink = IcebergSink(properties, TABLE)
    batch0, batch1 = stage(storage, 0, 1), stage(storage, 1, 1)
    sink.commit(None, 0, batch0)
    sink.commit(None, 1, batch1)
    table = load_table(properties)
    first = table.snapshots()[0].snapshot_id
    table.manage_snapshots().set_current_snapshot(first).commit()
    assert committed_batch_id(load_table(properties), LINEAGE) == 0
    sink.commit(None, 1, batch1)
    assert batch_snapshots(properties) == [(LINEAGE, 0), (LINEAGE, 1)]
    assert len(rows(properties)) == 10


def test_partition_columns(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    properties = catalog_properties(str(tmp_path / "catalog"))
    sink = IcebergSink(properties, TABLE, partition_by=["batch_id"])
    for batch_id in range(3):
        sink.commit(None, batch_id, stage(storage, batch_id, 2))
    table = load_table(properties)
    assert [(f.name, str(f.transform)) for f in table.spec().fields] == [("batch_id",
                                                                          "identity")]
    files = [t.file for t in table.scan().plan_files()]  # one data file per partition
    assert sorted(f.partition[0] for f in files) == [0, 1, 2]
    assert all(f"/batch_id={f.partition[0]}/" in f.file_path for f in files)
    assert sorted(rows(properties).groupby("batch_id").size().items()) == [(0, 10), (1, 10),
                                                                           (2, 10)]
    with pytest.raises(ConfigurationError, match=r"partition columns \['day'\]"):
        IcebergSink(properties, TABLE, partition_by=["day"]).open(SCHEMA)
    # The table's partitioning taken when none is given.
    IcebergSink(properties, TABLE).commit(None, 3, stage(storage, 3, 1))
    assert len(rows(properties)) == 35


def test_an_incompatible_table_is_refused_and_a_compatible_one_taken(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    properties = catalog_properties(str(tmp_path / "catalog"))
    catalog = load_catalog(properties)
    catalog.create_namespace("analytics")
    # pyiceberg alone would fill the missing column with nulls and refuse only at append
    catalog.create_table("analytics.wrong", pa.schema([("user_id", pa.string()),
                                                      ("count", pa.float64()),
                                                      ("extra", pa.string())]))
    with pytest.raises(SinkSchemaError) as refused:
        IcebergSink(properties, "analytics.wrong").open(SCHEMA)
    message = str(refused.value)
    assert "column 'count' is double in the table, long in the output" in message
    assert "column 'ts' is missing from the table" in message
    assert "the table's column 'extra' is not in the output" in message
    assert "Table schema: user_id string, count double, extra string" in message
    assert "output schema: user_id string, count long, ts timestamptz, batch_id long" in message
    # pyiceberg would promote ints into the long column silently
    catalog.create_table("analytics.promoted", pa.schema(
        [("user_id", pa.string()), ("count", pa.int32()), *list(SCHEMA)[2:]]))
    with pytest.raises(SinkSchemaError, match="'count' is int in the table, long in the output"):
        IcebergSink(properties, "analytics.promoted").open(SCHEMA)
    partitioned = catalog.create_table_transaction("analytics.partitioned", SCHEMA)
    with partitioned.update_spec() as spec:
        spec.add_identity("user_id")
    partitioned.commit_transaction()
    with pytest.raises(SinkSchemaError, match=r"partitioned by \[identity\(user_id\)\], the "
                                              r"sink by \[identity\(batch_id\)\]"):
        IcebergSink(properties, "analytics.partitioned", partition_by=["batch_id"]).open(SCHEMA)
    catalog.create_table("analytics.required", pa.schema(
        [pa.field("user_id", pa.string(), nullable=False), *list(SCHEMA)[1:]]))
    with pytest.raises(SinkSchemaError, match="'user_id' is required in the table"):
        IcebergSink(properties, "analytics.required").open(SCHEMA)
    # Nested types are compared without their field ids.
    nested = pa.schema([("user_id", pa.string()),
                        ("tags", pa.list_(pa.struct([("k", pa.string()), ("v", pa.int64())])))])
    catalog.create_table("analytics.nested", nested)
    IcebergSink(properties, "analytics.nested").open(nested)
    with pytest.raises(SinkSchemaError, match=r"'tags' is list<struct<k: string, v: long>> in "
                                              r"the table, list<struct<k: string, v: int>>"):
        IcebergSink(properties, "analytics.nested").open(pa.schema(
            [("user_id", pa.string()),
             ("tags", pa.list_(pa.struct([("k", pa.string()), ("v", pa.int32())])))]))
    # The same columns in another order (and the table's partitioning, none given): taken.
    reordered = catalog.create_table_transaction("analytics.reordered",
                                                 pa.schema(list(reversed(list(SCHEMA)))))
    with reordered.update_spec() as spec:
        spec.add_identity("user_id")
    reordered.commit_transaction()
    sink = IcebergSink(properties, "analytics.reordered")
    sink.open(SCHEMA)
    sink.commit(None, 0, stage(storage, 0, 2))
    assert len(rows(properties, "analytics.reordered")) == 10
    with pytest.raises(ConfigurationError, match="must name a namespace and a table"):
        IcebergSink(properties, "counts")


def test_a_catalog_object_or_properties_and_the_sink_pickles_with_properties(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    properties = catalog_properties(str(tmp_path / "catalog"))
    catalog = load_catalog(properties)
    IcebergSink(catalog, ("analytics", "counts")).commit(None, 0, stage(storage, 0, 1))
    sink = IcebergSink(properties, TABLE)
    sink.open(SCHEMA)  # loads its catalog
    copy = pickle.loads(pickle.dumps(sink))
    copy.commit(None, 0, stage(storage, 0, 1))  # a replay, found through the copy's catalog
    copy.commit(None, 1, stage(storage, 1, 1))
    assert batch_snapshots(properties) == [(LINEAGE, 0), (LINEAGE, 1)]


def iceberg_s3_properties(directory: str, url: str, fsspec_options: dict[str, Any]
                          ) -> dict[str, str]:
    """A SQLite catalog in ``directory`` whose warehouse is ``<url>/warehouse`` on the local S3
    server the fsspec ``options`` of the ``s3_bucket`` fixture reach (pyiceberg's S3 property
    names; its pyarrow FileIO)."""
    return catalog_properties(
        directory, f"{url}/warehouse",
        **{"s3.endpoint": fsspec_options["client_kwargs"]["endpoint_url"],
           "s3.access-key-id": fsspec_options["key"],
           "s3.secret-access-key": fsspec_options["secret"], "s3.region": "us-east-1"})


@pytest.mark.s3
def test_on_s3_through_the_local_s3_server(s3_bucket, tmp_path):
    url, options = s3_bucket
    properties = iceberg_s3_properties(str(tmp_path / "catalog"), url, options)
    staging = CheckpointStorage(f"{url}/ckpt", options)  # staged on S3 too
    sink = IcebergSink(properties, TABLE, partition_by=["batch_id"])
    sink.open(SCHEMA)
    batches = [stage(staging, b, 2) for b in range(2)]
    for batch_id, batch in enumerate(batches):
        sink.commit(None, batch_id, batch)
        sink.commit(None, batch_id, batch)
    assert batch_snapshots(properties) == [(LINEAGE, 0), (LINEAGE, 1)]
    got = rows(properties)
    assert len(got) == 20 and not got.duplicated(["user_id", "batch_id"]).any()
    assert load_table(properties).location().startswith(f"{url}/warehouse/")
    with pytest.raises(SinkSchemaError):
        IcebergSink(properties, TABLE).open(pa.schema([("user_id", pa.int32())]))


# -- real Spark jobs -----------------------------------------------------------------------------

class CrashingIcebergSink(CrashAroundCommit, IcebergSink):
    """IcebergSink dying once around the Iceberg commit of batch ``batch_id``."""

    table_format = "Iceberg"

    def __init__(self, properties: dict[str, str], batch_id: int, marker: str, after: bool) -> None:
        super().__init__(properties, TABLE)
        self.crash_once(batch_id, marker, after)


@pytest.mark.spark
def test_spark_job_into_iceberg_equals_pandas_one_snapshot_per_batch(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    properties = catalog_properties(os.path.join(root, "catalog"))
    query = run_job(spark, root, RunningTotals(), parallelism=2,
                    extra_sinks=(IcebergSink(properties, TABLE),))
    check_against_pandas(root, rows(properties))
    lineage = query.query.id
    assert batch_snapshots(properties) == [(lineage, b) for b in range(3)]
    # A restart from the same checkpoint: nothing to do, nothing written.
    run_job(spark, root, RunningTotals(), parallelism=2,
            extra_sinks=(IcebergSink(properties, TABLE),))
    assert len(load_table(properties).snapshots()) == 3


@pytest.mark.spark
@pytest.mark.parametrize("after", [False, True], ids=["before-iceberg-commit",
                                                      "after-iceberg-commit"])
def test_driver_crash_around_the_iceberg_commit_then_restart_is_exactly_once(spark, tmp_path,
                                                                            after):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    properties = catalog_properties(os.path.join(root, "catalog"))
    sink = CrashingIcebergSink(properties, 1, str(tmp_path / "crashed"), after)
    with pytest.raises(BatchFailedError, match="driver stopped around the Iceberg commit"):
        run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(sink,))
    assert len(load_table(properties).snapshots()) == (2 if after else 1)
    query = run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(sink,))
    assert query.stats[0].skipped_replay, "batch 1 must be replayed from its checkpoint"
    check_against_pandas(root, rows(properties))
    lineage = query.query.id
    assert batch_snapshots(properties) == [(lineage, b) for b in range(3)]


@pytest.mark.spark
@pytest.mark.s3
def test_spark_job_into_iceberg_on_s3(spark, s3_bucket, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    url, options = s3_bucket
    properties = iceberg_s3_properties(os.path.join(root, "catalog"), url, options)
    sink = IcebergSink(properties, TABLE, partition_by=["batch_id"])
    query = run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(sink,))
    check_against_pandas(root, rows(properties))
    assert batch_snapshots(properties) == [(query.query.id, b) for b in range(2)]


@pytest.mark.spark
def test_incompatible_table_refused_by_start_before_anything_is_written(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    properties = catalog_properties(os.path.join(root, "catalog"))
    catalog = load_catalog(properties)
    catalog.create_namespace("analytics")
    catalog.create_table(TABLE, pa.schema([("user_id", pa.string()), ("count", pa.int32())]))
    with pytest.raises(SinkSchemaError, match="column 'count' is int in the table, long"):
        run_job(spark, root, RunningTotals(), parallelism=2,
                extra_sinks=(IcebergSink(properties, TABLE),))
    assert load_table(properties).snapshots() == [] and rows(properties).empty
    assert not os.path.exists(os.path.join(root, "out"))  # no batch ran
    assert not os.path.exists(os.path.join(root, "spark"))  # the query never started


def test_without_the_iceberg_extra_the_error_says_what_to_install(monkeypatch):
    import sys

    from keyedstate.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "pyiceberg.catalog", None)  # what an absent package raises
    sink = IcebergSink({"uri": "sqlite:////nowhere/catalog.db"}, TABLE)  # needs no pyiceberg
    with pytest.raises(MissingDependencyError, match=r"pip install 'keyedstate\[iceberg\]'"):
        sink.open(SCHEMA)
