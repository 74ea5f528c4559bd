"""Schema evolution on Spark (docs/schema-evolution.md): a job restarted with an evolved state type
continues from its checkpoints (both backends, rescaled) and its output equals pandas over the whole
input; an incompatible change fails at start(); the state processor API reads a snapshot in the new
type: a Spark job's checkpoint, and the local runtime's checkpoints, native and canonical savepoints
of both backends by every rule (the values ``tests/processor/test_read_evolved.py`` reads without Spark)."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from keyedstate.errors import StateTypeMismatchError
from keyedstate.runtime.function import Context
from keyedstate.state.descriptors import ValueStateDescriptor
from tests.processor.test_read_evolved import DAY, descriptor, migrated, snapshot_path
from tests.spark.jobs import RunningTotals
from tests.spark.test_job import check_against_pandas, run_job, write_files
from tests.spark.test_savepoints_spark import start
from tests.state.test_schema_evolution_job import KINDS, RULES, Totals

pytestmark = pytest.mark.spark


class EvolvedTotals(RunningTotals):
    """RunningTotals after its state type evolved: fields reordered, count widened from the
    same bigint, a nullable field added (null in restored values)."""

    totals = ValueStateDescriptor("totals", "total double, count bigint, first_batch bigint")

    def open(self, ctx: Context) -> None:
        self.state = ctx.get_state(self.totals)

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        now = self.state.value() or {"count": 0, "total": 0.0, "first_batch": ctx.batch_id}
        amounts = rows.column("amount").to_pylist()
        self.state.update({"count": now["count"] + len(amounts),
                           "total": now["total"] + sum(amounts),
                           "first_batch": now["first_batch"]})
        return [{"user_id": key, "count": now["count"] + len(amounts),
                 "total": now["total"] + sum(amounts), "batch_id": ctx.batch_id}]


class NarrowedTotals(RunningTotals):
    totals = ValueStateDescriptor("totals", "count int, total double")


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_restart_with_an_evolved_state_type_continues(spark, tmp_path, backend):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    run_job(spark, root, RunningTotals(), parallelism=2, backend=backend)
    # Narrowing bigint to int is refused at start, before any batch.
    write_files(os.path.join(root, "input"), 1, first=2)
    with pytest.raises(StateTypeMismatchError, match="'totals'.*'count'"):
        run_job(spark, root, NarrowedTotals(), parallelism=2, backend=backend)
    run_job(spark, root, EvolvedTotals(), parallelism=3, backend=backend)
    check_against_pandas(root)  # every batch exactly once, totals carried across the change


def test_savepoint_reader_reads_in_the_new_type(spark, tmp_path):
    from keyedstate.spark.processor import SavepointReader

    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 1)
    run_job(spark, root, RunningTotals(), parallelism=2)
    reader = SavepointReader.read(spark, os.path.join(root, "ckpt"))
    old = reader.state("totals").toPandas().sort_values("user_id")
    new = reader.state(EvolvedTotals.totals).toPandas().sort_values("user_id")
    assert list(new["user_id"]) == list(old["user_id"])
    assert [v["count"] for v in new["value"]] == [v["count"] for v in old["value"]]
    assert [v["total"] for v in new["value"]] == [v["total"] for v in old["value"]]
    assert all(v["first_batch"] is None for v in new["value"])
    with pytest.raises(StateTypeMismatchError, match="'count'"):
        reader.state(NarrowedTotals.totals)


@pytest.mark.parametrize("fmt", ["native", "canonical"])
def test_savepoint_restored_with_an_evolved_state_type(spark, tmp_path, fmt):
    """Stop with a savepoint, start a new job from it with the evolved function at another
    parallelism: it resumes after the savepoint's batch and its totals carry on."""
    input_dir = str(tmp_path / "input")
    write_files(input_dir, 2)
    job1, job2 = str(tmp_path / "job1"), str(tmp_path / "job2")
    query = start(spark, job1, 2, input_dir)
    query.process_all_available()
    query.stop(savepoint=str(tmp_path / "sp"), format=fmt)
    # One more file, appearing whole (written aside, then renamed; see test_savepoints_spark).
    write_files(str(tmp_path / "later"), 1, first=2)
    for name in os.listdir(tmp_path / "later"):
        os.rename(tmp_path / "later" / name, os.path.join(input_dir, name))
    restored = start(spark, job2, 3, input_dir, EvolvedTotals(),
                     restore_path=str(tmp_path / "sp"))
    restored.process_all_available()
    restored.stop()
    out = pd.concat([pd.read_parquet(os.path.join(job1, "out")),
                     pd.read_parquet(os.path.join(job2, "out"))])
    assert sorted(set(out.batch_id)) == [0, 1, 2]
    check_against_pandas(str(tmp_path), out)  # reads <tmp_path>/input


def _rows(frame: Any) -> list[dict[str, Any]]:
    """The DataFrame's rows as dicts (structs as dicts), sorted by key."""
    return sorted((r.asDict(recursive=True) for r in frame.collect()),
                  key=lambda r: r["user_id"])


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("kind", KINDS)
def test_savepoint_reader_reads_every_rule(spark, tmp_path, backend, kind):
    """A local runtime's checkpoint, native or canonical savepoint read by SavepointReader in
    each rule's type: every value is the recorded one migrated by the rule."""
    from keyedstate.spark.processor import SavepointReader

    reader = SavepointReader.read(spark, snapshot_path(tmp_path, backend, kind))
    old = _rows(reader.state("totals"))
    for rule in sorted(RULES):
        new = _rows(reader.state(descriptor(rule)))
        assert [r["user_id"] for r in new] == [r["user_id"] for r in old]
        assert [r["value"] for r in new] == [migrated(rule, r["value"]) for r in old], rule
    with pytest.raises(StateTypeMismatchError, match="'total'"):
        reader.state(ValueStateDescriptor("totals", "struct<count:int,total:float>"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recorded, read", [(DAY, None), (None, DAY)],
                         ids=["ttl-recorded", "ttl-in-descriptor"])
def test_savepoint_reader_ttl_column_follows_the_snapshot(spark, tmp_path, kind, recorded,
                                                          read):
    """Read in another type by a descriptor that switches TTL: the values in its type, the
    TTL timestamps as the snapshot records them (as ``read_range_tables``)."""
    from keyedstate.spark.processor import SavepointReader

    reader = SavepointReader.read(spark, snapshot_path(tmp_path, "rocksdb", kind,
                                                       Totals(ttl=recorded)))
    old = _rows(reader.state("totals"))
    new = _rows(reader.state(descriptor("widen", ttl=read)))
    assert [sorted(r) for r in new] == [sorted(r) for r in old]  # the same columns
    assert ("ttl_timestamp" in new[0]) == (recorded is not None)
    assert [r.get("ttl_timestamp") for r in new] == [r.get("ttl_timestamp") for r in old]
    assert [r["value"] for r in new] == [migrated("widen", r["value"]) for r in old]
