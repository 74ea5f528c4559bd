"""Reading a snapshot's state in an evolved type without Spark (the local runtime's state
processor: ``processor.canonical.read_range_tables`` given a descriptor): every rule of
``tests/state/test_schema_evolution_job.py`` × backend × snapshot kind (checkpoint, native
savepoint, canonical savepoint), each value the recorded one migrated by the rule; an
incompatible descriptor refused before anything is read; the TTL column as the snapshot
records it. ``tests/spark/test_schema_evolution_spark.py`` reads the same snapshots with
``SavepointReader`` and expects the same rows."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.errors import StateTypeMismatchError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.processor.canonical import read_range_tables
from keyedstate.serde import type_from_string
from keyedstate.state.descriptors import StateDescriptor, StateTtlConfig, ValueStateDescriptor
from tests.state.test_schema_evolution_job import (
    KINDS,
    RULES,
    V1,
    Totals,
    _batches,
    _first_run,
    _job,
)

pytestmark = pytest.mark.integration

DAY = StateTtlConfig(dt.timedelta(days=1))


def snapshot_path(tmp_path: Path, backend: str, kind: str, fn: Totals | None = None) -> str:
    """Two batches of ``fn`` (default ``Totals`` of ``V1``) on the local runtime: the job's
    checkpoint directory, or its native or canonical savepoint."""
    _, cfg = _first_run(tmp_path, backend, kind, fn)
    return cfg.restore_path or cfg.checkpoint_dir


def descriptor(rule: str, ttl: StateTtlConfig | None = None) -> ValueStateDescriptor:
    type_, evolution, _ = RULES[rule]
    return ValueStateDescriptor("totals", type_, ttl=ttl, evolution=evolution)


def migrated(rule: str, old: dict[str, Any]) -> dict[str, Any]:
    """``old`` (a value of ``V1``) in the rule's type: fields by name, renamed fields from
    their old name, added fields their default (or null)."""
    type_, evolution, _ = RULES[rule]
    new = type_from_string(type_)
    renames = evolution.renames if evolution else {}
    defaults = evolution.defaults if evolution else {}
    value = {}
    for f in new:
        source = renames.get(f.name, f.name)
        value[f.name] = old[source] if source in old else defaults.get(f.name)
    return value


def read_local(path: str, state: str | StateDescriptor) -> pa.Table:
    """Every row of ``state`` in the snapshot at ``path``, sorted by key."""
    snapshot = resolve_snapshot(path)
    everything = KeyGroupRange(0, snapshot.metadata.max_parallelism - 1)
    tables = list(read_range_tables(snapshot, everything, state,
                                    now_ms=time.time_ns() // 1_000_000))
    assert tables
    return pa.concat_tables(tables).sort_by("user_id")


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_read_in_the_new_type(tmp_path, backend, kind, rule):
    path = snapshot_path(tmp_path, backend, kind)
    old = read_local(path, "totals")
    new = read_local(path, descriptor(rule))
    assert new.schema.field("value").type == type_from_string(RULES[rule][0])
    assert new.column("user_id").to_pylist() == old.column("user_id").to_pylist()
    assert new.column("key_group").to_pylist() == old.column("key_group").to_pylist()
    assert new.column("value").to_pylist() == \
        [migrated(rule, v) for v in old.column("value").to_pylist()]
    # By the descriptor of the recorded type: the recorded values.
    assert read_local(path, ValueStateDescriptor("totals", V1)).equals(old)


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("kind", KINDS)
def test_incompatible_descriptor_is_refused_before_reading(tmp_path, backend, kind):
    path = snapshot_path(tmp_path, backend, kind)
    snapshot = resolve_snapshot(path)
    narrowed = ValueStateDescriptor("totals", "struct<count:int,total:float,peak:float>")
    everything = KeyGroupRange(0, snapshot.metadata.max_parallelism - 1)
    with pytest.raises(StateTypeMismatchError, match="'totals'.*'total'"):
        next(read_range_tables(snapshot, everything, narrowed, now_ms=0))


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_checkpoint_after_a_migration_reads_in_the_new_type(tmp_path, backend, rule):
    """A checkpoint written after the job restarted with the rule's type (RocksDB: lazily
    migrated, values of both generations in its files) reads in the new type by name."""
    data = _batches()
    _, cfg = _first_run(tmp_path, backend, "checkpoint")
    type_, evolution, count = RULES[rule]
    with _job(cfg, Totals(type_, evolution, count)) as job:
        job.process_batch(data[2])
    by_name = read_local(cfg.checkpoint_dir, "totals")
    assert by_name.schema.field("value").type == type_from_string(type_)
    assert read_local(cfg.checkpoint_dir, descriptor(rule)).equals(by_name)
    seen = [u for t in data[:3] for u in t.column("user_id").to_pylist()]
    assert {r["user_id"]: r["value"][count] for r in by_name.to_pylist()} == \
        {u: seen.count(u) for u in set(seen)}


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recorded, read", [(DAY, None), (None, DAY)],
                         ids=["ttl-recorded", "ttl-in-descriptor"])
def test_ttl_column_follows_the_snapshot(tmp_path, backend, kind, recorded, read):
    """The descriptor gives the values' type; the TTL timestamps are the snapshot's (a state
    recorded without TTL has none to give, one recorded with TTL keeps them)."""
    path = snapshot_path(tmp_path, backend, kind, Totals(ttl=recorded))
    old = read_local(path, "totals")
    new = read_local(path, descriptor("widen", ttl=read))
    assert ("ttl_timestamp" in new.column_names) == (recorded is not None)
    assert new.column_names == old.column_names
    if recorded is not None:
        assert new.column("ttl_timestamp").equals(old.column("ttl_timestamp"))
    assert new.column("value").to_pylist() == \
        [migrated("widen", v) for v in old.column("value").to_pylist()]

