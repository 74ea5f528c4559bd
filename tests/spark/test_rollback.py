"""A rollback is never taken for a replay, on real Spark.

Job A runs batches 0-2, stops with a savepoint, runs on to batch 5; the savepoint is then
restored into a new checkpoint directory and a new Spark checkpoint location, over the same
sinks, with another trigger size (two files a batch) and one more file. Once, the restored
job's batches 3 and 4 carried A's query id and were skipped by every sink as replays of A's
batches 3 and 4, while the state moved on: the sink's last counts were wrong. Now the restored
job is a new branch (a query id of its own, its parent and fork batch recorded with each
batch); over sinks holding A's batches after the fork the start is refused by default
(``SinkRollbackError``), and with ``keyedstate.sinks.on-rollback: branch`` both branches are
there and the restored branch's last counts equal pandas'. The same for a restore from an older
retained checkpoint; a restore at the lineage's latest batch goes on with no option.
"""

from __future__ import annotations

import json
import os
from typing import Any

import deltalake
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.config import JobConfig
from keyedstate.errors import ConfigurationError, SinkRollbackError
from keyedstate.spark.api import key_by
from keyedstate.spark.delta_sink import DeltaSink
from keyedstate.spark.iceberg_sink import IcebergSink
from keyedstate.spark.offsets import OffsetLog
from keyedstate.spark.sinks import (
    COMMIT_FORK_BATCH_ID,
    COMMIT_PARENT_LINEAGE,
    SUCCESS_FILE,
    ParquetSink,
    read_published,
)
from tests.spark.jobs import COUNT_SCHEMA, RunningTotals
from tests.spark.test_iceberg_sink import TABLE, catalog_properties, load_table
from tests.spark.test_job import SCHEMA, write_files

pytestmark = pytest.mark.spark

#: small: ten users, a hundred events a file
EVENTS, USERS = 100, 10


def feed(root: str, files: int, first: int) -> None:
    write_files(os.path.join(root, "input"), files, events=EVENTS, users=USERS, first=first)


def run(spark: Any, root: str, sinks: list[Any], *, ckpt: str = "ckpt",
        location: str = "spark", files_per_trigger: int = 1, savepoint: str | None = None,
        **config: Any) -> Any:
    """A RunningTotals job over ``root/input`` into ``sinks``, run until every file is
    processed, then stopped (with a savepoint into ``savepoint`` if given)."""
    events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", files_per_trigger)
              .parquet(os.path.join(root, "input")))
    job = key_by(events, "user_id").process(RunningTotals(), COUNT_SCHEMA)
    for sink in sinks:
        job.sink(sink)
    query = job.start(JobConfig(checkpoint_dir=os.path.join(root, ckpt), parallelism=2,
                                **config),
                      trigger={"availableNow": True},
                      spark_checkpoint_location=os.path.join(root, location))
    query.await_termination()
    query.savepoint = query.stop(savepoint=savepoint) if savepoint else query.stop()
    return query


def parent_job(spark: Any, root: str, sinks: list[Any], backend: str) -> tuple[str, str]:
    """The issue's job A: batches 0-2, stop with a savepoint, batches 3-5; then one more file
    (6) arrives. Returns the savepoint and A's query id."""
    feed(root, 3, first=0)
    first = run(spark, root, sinks, backend=backend, savepoint=os.path.join(root, "sp"))
    feed(root, 3, first=3)
    again = run(spark, root, sinks, backend=backend)
    assert [s.batch_id for s in again.stats] == [3, 4, 5]
    feed(root, 1, first=6)
    query_id = first.driver.query_id()
    assert query_id and again.driver.query_id() == query_id
    return first.savepoint, query_id


def expected_last(root: str) -> pd.DataFrame:
    """Each user's count and total over the whole input (pandas)."""
    events = pd.concat(pd.read_parquet(os.path.join(root, "input", name))
                       for name in sorted(os.listdir(os.path.join(root, "input"))))
    return events.groupby("user_id")["amount"].agg(["size", "sum"])


def check_branch(root: str, rows: pd.DataFrame) -> None:
    """``rows`` (the parent's batches up to the fork and the branch's after it) end with each
    user's count and total over the whole input, no (user, batch) twice."""
    assert not rows.duplicated(["user_id", "batch_id"]).any()
    last = rows.sort_values("batch_id").groupby("user_id").last()
    expected = expected_last(root)
    assert sorted(last.index) == sorted(expected.index)
    assert (last["count"] == expected.loc[last.index, "size"]).all(), "counts differ from pandas"
    assert ((last["total"] - expected.loc[last.index, "sum"]).abs() < 1e-6).all()


def restore(spark: Any, root: str, sinks: list[Any], savepoint: str, backend: str,
            **config: Any) -> Any:
    """The restored job of the issue: new checkpoint directory, new Spark checkpoint location,
    two files a batch."""
    return run(spark, root, sinks, ckpt="ckpt-2", location="spark-2", files_per_trigger=2,
               backend=backend, restore_path=savepoint, **config)


def assert_refused_and_nothing_written(root: str, error: SinkRollbackError, *names: str
                                       ) -> None:
    message = str(error)
    for name in names:
        assert name in message, message
    assert "batches 3, 4, 5" in message and "keyedstate.sinks.on-rollback=branch" in message
    assert "another path or table" in message
    assert not os.path.exists(os.path.join(root, "ckpt-2")) or not [
        n for n in os.listdir(os.path.join(root, "ckpt-2")) if n.startswith("chk-")]
    assert OffsetLog.at(os.path.join(root, "spark-2")).query_id() is None, "not seeded"


# -- ParquetSink, both backends -------------------------------------------------------------------

def parquet_dirs(out: str, lineage: str) -> list[str]:
    return sorted(d for d in os.listdir(out) if d.startswith(f"{lineage}-batch-"))


def parquet_branch(out: str, parent: str, branch: str, fork: int) -> pd.DataFrame:
    """What docs/sinks.md tells a reader: the parent's batch directories up to the fork, and
    the branch's directories (their names start with the query id)."""
    frames = [pd.read_parquet(os.path.join(out, d)) for d in parquet_dirs(out, parent)
              if int(d.rsplit("-", 1)[1]) <= fork]
    frames += [pd.read_parquet(os.path.join(out, d)) for d in parquet_dirs(out, branch)]
    return pd.concat(frames)


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_rollback_over_a_parquet_sink_is_refused_by_default(spark, tmp_path, backend):
    root = str(tmp_path)
    out = os.path.join(root, "out")
    savepoint, parent = parent_job(spark, root, [ParquetSink(out)], backend)
    before = sorted(os.listdir(out))
    with pytest.raises(SinkRollbackError) as refused:
        restore(spark, root, [ParquetSink(out)], savepoint, backend)
    assert isinstance(refused.value, ConfigurationError) and isinstance(refused.value,
                                                                        ValueError)
    assert_refused_and_nothing_written(root, refused.value, f"ParquetSink at {out}", parent)
    assert sorted(os.listdir(out)) == before


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_rollback_over_a_parquet_sink_writes_a_new_branch_when_asked(spark, tmp_path, backend):
    root = str(tmp_path)
    out = os.path.join(root, "out")
    savepoint, parent = parent_job(spark, root, [ParquetSink(out)], backend)
    query = restore(spark, root, [ParquetSink(out)], savepoint, backend, on_rollback="branch")
    assert [(s.batch_id, s.skipped_replay) for s in query.stats] == [(3, False), (4, False)]
    branch = query.driver.query_id()
    assert branch and branch != parent, "the restored job is a lineage of its own"
    # Both branches are there: A's batches 0-5, the restored job's 3 and 4.
    assert len(parquet_dirs(out, parent)) == 6
    assert [d.rsplit("-", 1)[1] for d in parquet_dirs(out, branch)] == ["0000000003",
                                                                        "0000000004"]
    for name in parquet_dirs(out, branch):
        with open(os.path.join(out, name, SUCCESS_FILE)) as f:
            manifest = json.load(f)
        assert (manifest["lineage"], manifest["parent_lineage"], manifest["fork_batch_id"]) \
            == (branch, parent, 2)
    check_branch(root, parquet_branch(out, parent, branch, 2))
    published = read_published(out, lineage=branch).to_pandas()
    assert sorted(published.batch_id.unique()) == [3, 4]
    # Restarted in its own location, the branch stays itself.
    feed(root, 1, first=7)
    again = restore(spark, root, [ParquetSink(out)], savepoint, backend, on_rollback="branch")
    assert [s.batch_id for s in again.stats] == [5] and again.driver.query_id() == branch
    check_branch(root, parquet_branch(out, parent, branch, 2))


# -- DeltaSink and IcebergSink (RocksDB) --------------------------------------------------------

def delta_rows(uri: str, lineage: str, up_to: int | None = None) -> pd.DataFrame:
    """The snippet of docs/sinks.md: the rows of one lineage's commits (optionally up to a
    batch), as the files each of its commits added."""
    table = deltalake.DeltaTable(uri)
    versions = [c["version"] for c in table.history()
                if c.get("keyedstate.lineage") == lineage
                and (up_to is None or int(c["keyedstate.batch_id"]) <= up_to)]
    paths: list[str] = []
    for v in sorted(versions):
        before = set(deltalake.DeltaTable(uri, version=v - 1).file_uris()) if v else set()
        paths += sorted(set(deltalake.DeltaTable(uri, version=v).file_uris()) - before)
    return ds.dataset(paths, format="parquet").to_table().to_pandas()


def iceberg_rows(table: Any, lineage: str, up_to: int | None = None) -> pd.DataFrame:
    """The snippet of docs/sinks.md: the rows of one lineage's snapshots (optionally up to a
    batch), as the data files each of its snapshots added."""
    snapshots = {s.snapshot_id for s in table.snapshots()
                 if (s.summary or {}).get("keyedstate.lineage") == lineage
                 and (up_to is None or int(s.summary["keyedstate.batch_id"]) <= up_to)}
    paths = [e["data_file"]["file_path"] for e in table.inspect.entries().to_pylist()
             if e["status"] == 1 and e["snapshot_id"] in snapshots]  # 1: ADDED
    return pa.concat_tables(pq.read_table(table.io.new_input(p).open()) for p in paths
                            ).to_pandas()


def test_rollback_over_delta_and_iceberg_is_refused_then_branches_when_asked(spark, tmp_path):
    root = str(tmp_path)
    delta = str(tmp_path / "delta")
    iceberg = catalog_properties(str(tmp_path / "iceberg"))

    def sinks() -> list[Any]:
        return [DeltaSink(delta), IcebergSink(iceberg, TABLE)]

    savepoint, parent = parent_job(spark, root, sinks(), "rocksdb")
    with pytest.raises(SinkRollbackError) as refused:
        restore(spark, root, sinks(), savepoint, "rocksdb")
    assert_refused_and_nothing_written(root, refused.value, f"DeltaSink at {delta}",
                                       f"IcebergSink table {TABLE}")
    assert deltalake.DeltaTable(delta).version() == 5, "nothing was written"

    query = restore(spark, root, sinks(), savepoint, "rocksdb", on_rollback="branch")
    branch = query.driver.query_id()
    assert branch != parent
    history = deltalake.DeltaTable(delta).history()
    mine = [c for c in history if c.get("keyedstate.lineage") == branch]
    assert sorted(int(c["keyedstate.batch_id"]) for c in mine) == [3, 4]
    assert {(c[COMMIT_PARENT_LINEAGE], c[COMMIT_FORK_BATCH_ID]) for c in mine} == {(parent, "2")}
    check_branch(root, pd.concat([delta_rows(delta, parent, up_to=2), delta_rows(delta, branch)]))
    assert len(delta_rows(delta, parent)) == 6 * USERS, "A's batches are all still there"

    table = load_table(iceberg)
    summaries = [s.summary for s in table.snapshots()
                 if s.summary.get("keyedstate.lineage") == branch]
    assert sorted(int(s["keyedstate.batch_id"]) for s in summaries) == [3, 4]
    assert {(s[COMMIT_PARENT_LINEAGE], s[COMMIT_FORK_BATCH_ID]) for s in summaries} \
        == {(parent, "2")}
    check_branch(root, pd.concat([iceberg_rows(table, parent, up_to=2),
                                  iceberg_rows(table, branch)]))


# -- an older retained checkpoint ------------------------------------------------------------------

def test_restore_from_an_older_retained_checkpoint_is_a_rollback_too(spark, tmp_path):
    root = str(tmp_path)
    out = os.path.join(root, "out")
    delta = str(tmp_path / "delta")
    feed(root, 4, first=0)
    first = run(spark, root, [ParquetSink(out), DeltaSink(delta)], num_retained=2)
    parent = first.driver.query_id()
    older = sorted(n for n in os.listdir(os.path.join(root, "ckpt")) if n.startswith("chk-"))[0]
    path = os.path.join(root, "ckpt", older)
    assert resolve_snapshot(path).metadata.properties["batch_id"] == "2"  # of batches 0-3
    feed(root, 1, first=4)
    with pytest.raises(SinkRollbackError, match="batches 3") as refused:
        run(spark, root, [ParquetSink(out), DeltaSink(delta)], ckpt="ckpt-2",
            location="spark-2", restore_path=path)
    assert f"ParquetSink at {out}" in str(refused.value)
    assert f"DeltaSink at {delta}" in str(refused.value)
    query = run(spark, root, [ParquetSink(out), DeltaSink(delta)], ckpt="ckpt-2",
                location="spark-2", restore_path=path, on_rollback="branch")
    # The branch plans its batches as the parent did (one file each): the file source's log
    # is copied only up to the fork batch's log offset, not with the files A found later.
    assert [(s.batch_id, s.rows_in) for s in query.stats] == [(3, EVENTS), (4, EVENTS)]
    branch = query.driver.query_id()
    check_branch(root, parquet_branch(out, parent, branch, 2))
    check_branch(root, pd.concat([delta_rows(delta, parent, up_to=2), delta_rows(delta, branch)]))


# -- the normal path: a restore at the lineage's latest batch ----------------------------------

def test_restore_at_the_latest_batch_needs_no_option(spark, tmp_path, caplog):
    root = str(tmp_path)
    out = os.path.join(root, "out")
    delta = str(tmp_path / "delta")
    iceberg = catalog_properties(str(tmp_path / "iceberg"))

    def sinks() -> list[Any]:
        return [ParquetSink(out), DeltaSink(delta), IcebergSink(iceberg, TABLE)]

    feed(root, 2, first=0)
    first = run(spark, root, sinks(), savepoint=os.path.join(root, "sp"))
    parent = first.driver.query_id()
    feed(root, 2, first=2)
    with caplog.at_level("WARNING", logger="keyedstate"):
        query = restore(spark, root, sinks(), first.savepoint, "rocksdb")
    assert not [r for r in caplog.records if "branch" in r.getMessage()]
    assert [s.batch_id for s in query.stats] == [2]
    branch = query.driver.query_id()
    check_branch(root, parquet_branch(out, parent, branch, 1))
    check_branch(root, pd.concat([delta_rows(delta, parent), delta_rows(delta, branch)]))
    table = load_table(iceberg)
    check_branch(root, pd.concat([iceberg_rows(table, parent), iceberg_rows(table, branch)]))
