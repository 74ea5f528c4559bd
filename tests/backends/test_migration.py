"""State migration on restore (state schema evolution), on every backend and both RocksDB migration
modes: a state restored through a descriptor whose type evolved holds the old values mapped by the
rule, keeps them through later snapshots (incremental and full, rescaled), and refuses an
incompatible change before anything changes."""

from __future__ import annotations

import datetime as dt
import random
from typing import Any, Callable

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.backends.base.migration import EvolvedSerializer, recorded_value_type
from keyedstate.backends.rocksdb.backend import RocksDBStateBackend
from keyedstate.errors import ConfigurationError, StateTypeMismatchError
from keyedstate.serde import ArrowTypeSerializer
from keyedstate.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)
from keyedstate.state.evolution import SchemaEvolution
from tests.backends.contract.common import Harness
from tests.property_budget import budget

OLD = "struct<count:int,name:string,tags:array<struct<k:string,w:float>>>"
#: reordered, count widened to bigint, name removed, a field added with a default, and the
#: list element's w widened and a nullable field added
NEW = "struct<tags:array<struct<w:double,k:string,seen:date>>,count:bigint,score:double>"
EVOLUTION = SchemaEvolution(defaults={"score": 1.5})


def _old_value(rnd: random.Random) -> dict[str, Any]:
    return {"count": rnd.randint(-1000, 1000), "name": f"n{rnd.randint(0, 9)}",
            "tags": [{"k": f"k{i}", "w": float(i) / 4} for i in range(rnd.randint(0, 3))]}


def _expected(old: dict[str, Any] | None) -> dict[str, Any] | None:
    if old is None:
        return None
    return {"tags": [{"w": t["w"], "k": t["k"], "seen": None} for t in old["tags"]],
            "count": old["count"], "score": 1.5}


BACKENDS: dict[str, Callable[[], StateBackend]] = {
    "heap": lambda: load_backend("heap"),
    "rocksdb-lazy": lambda: RocksDBStateBackend(state_migration="lazy"),
    "rocksdb-eager": lambda: RocksDBStateBackend(state_migration="eager"),
}


@pytest.fixture(params=sorted(BACKENDS))
def harness(request: pytest.FixtureRequest, tmp_path) -> Any:
    h = Harness(BACKENDS[request.param](), tmp_path)
    yield h
    h.close_all()


def _descriptors(type_: str, ttl: StateTtlConfig | None = None,
                 evolution: SchemaEvolution | None = None) -> dict[str, StateDescriptor]:
    return {
        "value": ValueStateDescriptor("value", type_, ttl=ttl, evolution=evolution),
        "list": ListStateDescriptor("list", type_, ttl=ttl, evolution=evolution),
        "map": MapStateDescriptor("map", "string", type_, ttl=ttl, evolution=evolution),
    }


def _fill(harness: Harness, backend: KeyedStateBackend, keys: range,
          descriptors: dict[str, StateDescriptor]) -> dict[str, dict[Any, Any]]:
    """Random old values for ``keys``; returns what each state holds per key."""
    rnd = random.Random(7)
    held: dict[str, dict[Any, Any]] = {"value": {}, "list": {}, "map": {}}
    states = {n: backend.get_state(d) for n, d in descriptors.items()}
    for key in keys:
        backend.set_current_key(key)
        value = _old_value(rnd)
        states["value"].update(value)
        held["value"][key] = value
        items = [_old_value(rnd) for _ in range(rnd.randint(1, 3))]
        states["list"].update(items)
        held["list"][key] = items
        entries = {f"u{i}": _old_value(rnd) for i in range(rnd.randint(1, 3))}
        states["map"].put_all(entries)
        held["map"][key] = entries
    return held


def _read(backend: KeyedStateBackend, keys: range, descriptors: dict[str, StateDescriptor]
          ) -> dict[str, dict[Any, Any]]:
    states = {n: backend.get_state(d) for n, d in descriptors.items()}
    out: dict[str, dict[Any, Any]] = {"value": {}, "list": {}, "map": {}}
    for key in keys:
        backend.set_current_key(key)
        out["value"][key] = states["value"].value()
        out["list"][key] = states["list"].get()
        out["map"][key] = dict(states["map"].items())
    return out


def _migrated(held: dict[str, dict[Any, Any]]) -> dict[str, dict[Any, Any]]:
    return {
        "value": {k: _expected(v) for k, v in held["value"].items()},
        "list": {k: [_expected(x) for x in v] for k, v in held["list"].items()},
        "map": {k: {u: _expected(x) for u, x in v.items()} for k, v in held["map"].items()},
    }


@pytest.mark.parametrize("with_ttl", [False, True], ids=["plain", "ttl"])
def test_restore_with_an_evolved_type_migrates_every_state_kind(harness: Harness,
                                                                 with_ttl: bool) -> None:
    ttl = StateTtlConfig(dt.timedelta(days=1)) if with_ttl else None
    keys = range(60)
    b = harness.create()
    held = _fill(harness, b, keys, _descriptors(OLD, ttl))
    handle = harness.snapshot(b)
    new = _descriptors(NEW, ttl, EVOLUTION)
    restored = harness.create(handles=[handle])
    assert _read(restored, keys, new) == _migrated(held)
    # The snapshot after the migration restores with the new descriptors alone, as is;
    # an update of some keys after the migration mixes new values with migrated old ones.
    restored.set_current_key(3)
    restored.get_state(new["value"]).update({"tags": [], "count": 1 << 40, "score": 2.0})
    expected = _migrated(held)
    expected["value"][3] = {"tags": [], "count": 1 << 40, "score": 2.0}
    for full in (False, True):
        again = harness.create(handles=[harness.snapshot(restored, full=full)])
        assert _read(again, keys, _descriptors(NEW, ttl)) == expected
    # Recorded schema: exact, readable by Arrow.
    meta = {m.name: m for m in again.state_meta_infos()}["value"]
    assert recorded_value_type(meta) == ArrowTypeSerializer(NEW).arrow_type


def test_rescaled_restore_with_an_evolved_type(harness: Harness) -> None:
    keys = range(80)
    old = harness.create_all(2)
    held: dict[str, dict[Any, Any]] = {"value": {}, "list": {}, "map": {}}
    descriptors = _descriptors(OLD)
    for b in old:
        part = _fill(harness, b, range(0), descriptors)  # registers the states
        assert part == {"value": {}, "list": {}, "map": {}}
    rnd = random.Random(3)
    for key in keys:
        b = harness.at(old, key)
        value = _old_value(rnd)
        b.get_state(descriptors["value"]).update(value)
        held["value"][key] = value
    handles = harness.snapshot_all(old)
    new = _descriptors(NEW, evolution=EVOLUTION)
    for parallelism in (1, 3):
        backends = harness.create_all(parallelism, handles=handles)
        for key in keys:
            b = harness.at(backends, key)
            assert b.get_state(new["value"]).value() == _expected(held["value"][key])


def test_two_evolutions_in_a_row(harness: Harness) -> None:
    """A lazily migrated state evolves again: values of every generation read right (a field
    removed by the first step and added back by the second is null, not the old value)."""
    keys = range(30)
    first = "struct<count:int,name:string>"
    second = "struct<count:bigint>"
    third = "struct<count:bigint,name:string>"
    b = harness.create()
    state = b.get_state(ValueStateDescriptor("v", first))
    for key in keys:
        b.set_current_key(key)
        state.update({"count": key, "name": "x"})
    b2 = harness.create(handles=[harness.snapshot(b)])
    s2 = b2.get_state(ValueStateDescriptor("v", second))
    for key in keys[:10]:  # written in the second type
        b2.set_current_key(key)
        s2.update({"count": key * 100})
    b3 = harness.create(handles=[harness.snapshot(b2)])
    s3 = b3.get_state(ValueStateDescriptor("v", third))
    for key in keys:
        b3.set_current_key(key)
        assert s3.value() == {"count": key * 100 if key < 10 else key, "name": None}
    if isinstance(harness.state_backend, RocksDBStateBackend) \
            and harness.state_backend.state_migration == "lazy":
        assert isinstance(b3._states["v"].descriptor.value_serializer, EvolvedSerializer)


@pytest.mark.parametrize("new, what", [
    (ValueStateDescriptor("value", "struct<count:string>"), "count"),
    (ValueStateDescriptor("value", "struct<count:int,nick:string>"), "may be a rename"),
    (ListStateDescriptor("value", OLD), "kind"),
    (ValueStateDescriptor("value"), "untyped"),
])
def test_incompatible_change_is_refused_and_changes_nothing(harness: Harness,
                                                            new: StateDescriptor,
                                                            what: str) -> None:
    b = harness.create()
    held = _fill(harness, b, range(20), _descriptors(OLD))
    handle = harness.snapshot(b)
    restored = harness.create(handles=[handle])
    with pytest.raises(StateTypeMismatchError, match=what):
        restored.get_state(new)
    # Nothing changed: the old descriptor still reads every value.
    assert _read(restored, range(20), _descriptors(OLD)) == held


def test_an_evolution_naming_a_missing_field_is_refused(harness: Harness) -> None:
    b = harness.create()
    _fill(harness, b, range(5), _descriptors(OLD))
    restored = harness.create(handles=[harness.snapshot(b)])
    with pytest.raises(ConfigurationError, match="scroe"):
        restored.get_state(ValueStateDescriptor(
            "value", NEW, evolution=SchemaEvolution(defaults={"scroe": 1.0})))


def test_dropped_state_is_gone_from_the_next_snapshot(harness: Harness) -> None:
    b = harness.create()
    _fill(harness, b, range(20), _descriptors(OLD))
    restored = harness.create(handles=[harness.snapshot(b)])
    restored.get_state(_descriptors(OLD)["value"])
    with pytest.raises(ConfigurationError):
        restored.drop_state("value")
    assert restored.drop_state("list") is True
    assert restored.drop_state("list") is False
    for full in (False, True):
        again = harness.create(handles=[harness.snapshot(restored, full=full)])
        assert sorted(m.name for m in again.state_meta_infos()) == ["map", "value"]


def test_kept_state_no_descriptor_asks_for_survives(harness: Harness) -> None:
    b = harness.create()
    held = _fill(harness, b, range(20), _descriptors(OLD))
    restored = harness.create(handles=[harness.snapshot(b)])
    restored.get_state(_descriptors(OLD)["value"])  # only one of three asked for
    again = harness.create(handles=[harness.snapshot(restored)])
    assert _read(again, range(20), _descriptors(OLD)) == held


# --------------------------------------------------------------------------------------------
# random schemas (Hypothesis): values read after migration equal the old values mapped by the
# rule
# --------------------------------------------------------------------------------------------

_LEAVES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.float32(), pa.float64(),
           pa.string(), pa.date32()]
_WIDER = {pa.int8(): pa.int16(), pa.int16(): pa.int32(), pa.int32(): pa.int64(),
          pa.float32(): pa.float64(), pa.date32(): pa.timestamp("us")}


@st.composite
def _evolution(draw: st.DrawFn) -> tuple[pa.DataType, pa.DataType]:
    names = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=5, unique=True))
    old_fields = [pa.field(n, draw(st.sampled_from(_LEAVES))) for n in names]
    new_fields = []
    for f in old_fields:
        step = draw(st.sampled_from(["keep", "widen", "drop"]))
        if step == "drop":
            continue
        new_fields.append(pa.field(f.name, _WIDER.get(f.type, f.type) if step == "widen"
                                   else f.type))
    if draw(st.booleans()) or not new_fields:
        new_fields.append(pa.field("added", draw(st.sampled_from(_LEAVES))))
    new_fields = draw(st.permutations(new_fields))
    return pa.struct(old_fields), pa.struct(new_fields)


def _random_value(type_: pa.StructType, rnd: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(type_.num_fields):
        f = type_.field(i)
        t = f.type
        if rnd.random() < 0.2:
            out[f.name] = None
        elif pa.types.is_integer(t):
            out[f.name] = rnd.randint(-100, 100)
        elif pa.types.is_floating(t):
            out[f.name] = rnd.randint(-100, 100) / 8
        elif pa.types.is_string(t):
            out[f.name] = f"s{rnd.randint(0, 9)}"
        else:
            out[f.name] = dt.date(2026, 1, 1) + dt.timedelta(days=rnd.randint(0, 300))
    return out


@settings(max_examples=budget(15), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(change=_evolution(), seed=st.integers(0, 1000))
def test_random_evolution_reads_old_values_mapped_by_the_rule(tmp_path_factory, change,
                                                              seed: int) -> None:
    old_type, new_type = change
    # "added" is declared new (not a rename of a dropped field), null in old values.
    evolution = SchemaEvolution(defaults={"added": None}) \
        if new_type.get_field_index("added") >= 0 else SchemaEvolution()
    resolution = evolution.resolve("v", old_type, new_type)
    assert resolution.is_compatible
    rnd = random.Random(seed)
    for name, make in BACKENDS.items():
        harness = Harness(make(), tmp_path_factory.mktemp(name))
        try:
            b = harness.create()
            state = b.get_state(ValueStateDescriptor("v", old_type))
            old_values = {}
            for key in range(20):
                b.set_current_key(key)
                old_values[key] = _random_value(old_type, rnd)
                state.update(old_values[key])
            restored = harness.create(handles=[harness.snapshot(b)])
            new_state = restored.get_state(ValueStateDescriptor("v", new_type,
                                                                evolution=evolution))
            for key, old in old_values.items():
                restored.set_current_key(key)
                assert new_state.value() == resolution.migrate(old), name
        finally:
            harness.close_all()


@pytest.mark.parametrize("evolve", [False, True], ids=["same-type", "evolved-type"])
def test_ttl_switched_on_stamps_values_with_the_restore_time(harness: Harness,
                                                             evolve: bool) -> None:
    keys = range(30)
    b = harness.create()
    held = _fill(harness, b, keys, _descriptors(OLD))
    handle = harness.snapshot(b)
    harness.clock.advance(10_000)
    ttl = StateTtlConfig(dt.timedelta(seconds=60))
    new = _descriptors(NEW, ttl, EVOLUTION) if evolve else _descriptors(OLD, ttl)
    restored = harness.create(handles=[handle])
    assert _read(restored, keys, new) == (_migrated(held) if evolve else held)
    harness.clock.advance(59_000)  # not yet expired: stamped at the restore, not before
    again = harness.create(handles=[harness.snapshot(restored)])
    assert _read(again, keys, new) == (_migrated(held) if evolve else held)
    harness.clock.advance(2_000)
    assert _read(again, keys, new) == {"value": {k: None for k in keys},
                                       "list": {k: [] for k in keys},
                                       "map": {k: {} for k in keys}}


def test_ttl_switched_off_keeps_live_values_and_drops_expired_ones(harness: Harness) -> None:
    ttl = StateTtlConfig(dt.timedelta(seconds=60))
    b = harness.create()
    old = _descriptors(OLD, ttl)
    _fill(harness, b, range(0, 20), old)
    harness.clock.advance(50_000)
    later = _fill(harness, b, range(20, 40), old)  # written 50 s later
    handle = harness.snapshot(b)
    harness.clock.advance(20_000)  # the first 20 keys expired, the others live
    restored = harness.create(handles=[handle])
    got = _read(restored, range(40), _descriptors(NEW, evolution=EVOLUTION))
    expected = _migrated(later)
    for name, empty in (("value", None), ("list", []), ("map", {})):
        expected[name].update({k: empty for k in range(20)})
    assert got == expected
    harness.clock.advance(10**9)  # no TTL any more: nothing expires
    again = harness.create(handles=[harness.snapshot(restored)])
    assert _read(again, range(40), _descriptors(NEW, evolution=EVOLUTION)) == expected


def test_a_nested_default_is_never_shared_between_values(harness: Harness) -> None:
    b = harness.create()
    state = b.get_state(ValueStateDescriptor("v", "struct<a:int>"))
    for key in range(3):
        b.set_current_key(key)
        state.update({"a": key})
    restored = harness.create(handles=[harness.snapshot(b)])
    new = restored.get_state(ValueStateDescriptor(
        "v", "struct<a:int,tags:array<string>>",
        evolution=SchemaEvolution(defaults={"tags": ["x"]})))
    restored.set_current_key(0)
    first = new.value()
    first["tags"].append("changed by the caller")
    restored.set_current_key(1)
    assert new.value() == {"a": 1, "tags": ["x"]}
