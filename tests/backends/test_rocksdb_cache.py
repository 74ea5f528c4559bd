"""The RocksDB backend's value cache (docs/rocksdb-backend.md, "The value cache"): what a
snapshot, a rescale, a scan, TTL, a load and a closed backend see of values still buffered,
values of mutable types, and the setting's errors. The whole contract and the state machine
run with the cache tiny and large in ``test_rocksdb_cache_contract.py``.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import KeyedStateBackend, meta_info_of
from keyedstate.backends.rocksdb import RocksDBOptions, RocksDBStateBackend
from keyedstate.backends.rocksdb.keyed_backend import RocksDBKeyedStateBackend
from keyedstate.backends.rocksdb.value_cache import (
    ABSENT,
    DEFAULT_VALUE_CACHE_SIZE,
    ValueCache,
)
from keyedstate.config import JobConfig
from keyedstate.errors import BackendError, ConfigurationError
from keyedstate.keygroups import key_group_prefix_bytes
from keyedstate.serde import serialize_namespace, serializer_for
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
)

from .contract.common import Average, Harness, dump

# --------------------------------------------------------------------------------------------
# targeted tests
# --------------------------------------------------------------------------------------------

CACHED = RocksDBStateBackend(value_cache_size="32 mb")
UNCACHED = RocksDBStateBackend(value_cache_size=0)

TTL = StateTtlConfig(dt.timedelta(seconds=10), update_type=TtlUpdateType.ON_READ_AND_WRITE)


def _sum(a: int, b: int) -> int:
    return a + b


def descriptors() -> dict[str, Any]:
    return {
        "count": ValueStateDescriptor("count", "bigint", default=0),
        "seen": ValueStateDescriptor("seen", "array<bigint>"),  # mutable: entries hold bytes
        "total": ReducingStateDescriptor("total", _sum, "bigint"),
        "avg": AggregatingStateDescriptor("avg", Average(), "struct<sum:double,count:bigint>"),
        "last": ValueStateDescriptor("last", "string", ttl=TTL),
        "pickled": ValueStateDescriptor("pickled"),  # untyped
    }


def cache_of(backend: KeyedStateBackend) -> ValueCache:
    assert isinstance(backend, RocksDBKeyedStateBackend)
    assert backend.value_cache is not None
    return backend.value_cache


def workload(harness: Harness, backend: KeyedStateBackend, keys: range) -> None:
    """Every cached state kind, TTL expiry and refresh, clears and bulk-free rewrites, with the
    harness clock moving."""
    states = {name: backend.get_state(d) for name, d in descriptors().items()}
    for round_ in range(3):
        for k in keys:
            backend.set_current_key(k)
            states["count"].update(states["count"].value() + k)
            seen = states["seen"].value() or []
            states["seen"].update([*seen, round_])
            states["total"].add(k)
            states["avg"].add(float(k))
            if k % 3 == round_:
                states["last"].value()  # refreshes the stamp
            else:
                states["last"].update(f"{k}-{round_}")
            states["pickled"].update({"k": k, "r": round_})
            if k % 7 == round_:
                states["count"].clear()
        harness.clock.advance(6_000)  # TTL 10 s: some values expire between rounds


def records(harness: Harness, backends: list[KeyedStateBackend]) -> dict[str, list[Any]]:
    out = {}
    for name in descriptors():
        rows = [(r.key_group, r.key_bytes, r.namespace_bytes, r.user_key, repr(r.value),
                 r.ttl_timestamp) for b in backends for r in b.iter_records(name)]
        out[name] = sorted(rows)
    return out


def restored(harness: Harness, handles: list[Any], parallelism: int) -> list[KeyedStateBackend]:
    backends = harness.create_all(parallelism, handles=handles, state_backend=UNCACHED)
    for b in backends:
        for d in descriptors().values():
            b.get_state(d)
    return backends


def test_a_snapshot_after_buffered_writes_restores_what_no_cache_stores(
        tmp_path: Path) -> None:
    """The same calls with and without the cache: their snapshots, restored without a cache,
    hold the same records, TTL stamps included; the cached run's writes were buffered until the
    snapshot."""
    stored = {}
    for name, backend_config in (("cached", CACHED), ("uncached", UNCACHED)):
        harness = Harness(backend_config, tmp_path / name)
        try:
            backend = harness.create()
            workload(harness, backend, range(40))
            if name == "cached":
                assert cache_of(backend).dirty  # buffered, not yet in RocksDB
            handles = harness.snapshot_all([backend])
            if name == "cached":
                assert not cache_of(backend).dirty
            stored[name] = records(harness, restored(harness, handles, 1))
        finally:
            harness.close_all()
    assert stored["cached"]["count"] and stored["cached"]["last"]
    assert stored["cached"] == stored["uncached"]


def test_rescaling_and_scans_see_buffered_writes(tmp_path: Path) -> None:
    harness = Harness(CACHED, tmp_path)
    try:
        backend = harness.create()
        state = backend.get_state(ValueStateDescriptor("value", "bigint"))
        for k in range(300):
            backend.set_current_key(k)
            state.update(k * 10)
        assert len(cache_of(backend).dirty) == 300
        expected = {k: k * 10 for k in range(300)}
        # iter_entries (canonical savepoints, the state processor) writes the buffer out first
        seen = {harness.key_serializer.deserialize(e.key_bytes): e.value
                for e in backend.iter_entries("value")}
        assert seen == expected
        state.update(-1)  # key 299, buffered again
        expected[299] = -1
        handles = harness.snapshot_all([backend])
        # restored at parallelism 3: each subtask clips its key groups out of the snapshot
        backends = harness.create_all(3, handles=handles, state_backend=CACHED)
        for b in backends:
            b.get_state(ValueStateDescriptor("value", "bigint"))
        rescaled = dump(harness, backends, ["value"])["value"]
        assert {harness.key_serializer.deserialize(kb): v
                for (kb, _, _), v in rescaled.items()} == expected
        for k in range(300):
            b = harness.at(backends, k)
            assert b.get_state(ValueStateDescriptor("value", "bigint")).value() == expected[k]
    finally:
        harness.close_all()


def test_a_restored_state_is_read_back_by_one_scan(tmp_path: Path) -> None:
    """Restored at parallelism 2 (each subtask clips its key groups out of the snapshot),
    every cached state but the TTL one is filled by a scan when the job first gets it: its
    keys read as hits, and every value as the same restore without a cache reads it; the
    cache holds no key of another subtask's key groups."""
    harness = Harness(CACHED, tmp_path)
    try:
        backend = harness.create()
        workload(harness, backend, range(60))
        handles = harness.snapshot_all([backend])
        cached = harness.create_all(2, handles=handles, state_backend=CACHED)
        uncached = harness.create_all(2, handles=handles, state_backend=UNCACHED)
        for b in cached:
            cache = cache_of(b)
            states = {name: b.get_state(d) for name, d in descriptors().items()}
            assert cache.warmed > 0 and cache.misses == 0 and not cache.dirty
            n = key_group_prefix_bytes(b.max_parallelism)  # a cache key: state id, then
            assert {int.from_bytes(ck[2:2 + n], "big")  # the stored key: key group first
                    for ck in cache.entries} <= set(b.key_group_range)
            warmed = set(cache.entries)
            for k in range(60):
                if harness.at(cached, k) is not b:
                    continue
                b.set_current_key(k)
                other = harness.at(uncached, k)
                other.set_current_key(k)
                for name, d in descriptors().items():
                    assert _read(states[name], d) == _read(other.get_state(d), d), (name, k)
            ttl_id = cache.state_id("last")
            assert not any(ck[:2] == ttl_id for ck in warmed)  # TTL states are not warmed
            # Read since: the TTL state's values and the keys with no value (cleared) only.
            assert all(ck[:2] == ttl_id or cache.entries[ck][0] is ABSENT
                       for ck in set(cache.entries) - warmed)
    finally:
        harness.close_all()


def _read(state: Any, descriptor: Any) -> Any:
    return state.value() if isinstance(descriptor, ValueStateDescriptor) else state.get()


def test_a_state_larger_than_the_cache_is_not_warmed_past_its_room(tmp_path: Path) -> None:
    """A cache of 16 kb. 2,000 small values: RocksDB's estimate of their keys does not fit,
    nothing is warmed. Then 20 values of 2 kb: the estimate fits, the sizes do not, and the
    warm-up stops part-way. Neither evicts or writes, the cache stays below the point where it
    makes room, and every value still reads as stored."""
    harness = Harness(UNCACHED, tmp_path)
    try:
        backend = harness.create()
        counts = ValueStateDescriptor("count", "bigint")
        texts = ValueStateDescriptor("text", "string")
        for k in range(2000):
            backend.set_current_key(k)
            backend.get_state(counts).update(k)
            if k < 20:
                backend.get_state(texts).update(str(k) * 2048)
        handles = harness.snapshot_all([backend])
        small = RocksDBStateBackend(value_cache_size="16 kb")
        restored_backend = harness.create(handles=handles, state_backend=small)
        cache = cache_of(restored_backend)
        restored_backend.get_state(counts)
        assert cache.warmed == 0
        restored_backend.get_state(texts)
        assert 0 < cache.warmed < 20
        assert cache.evictions == 0 and cache.written == 0
        assert cache.bytes <= cache.capacity - cache.capacity // 8
        for k in range(2000):
            restored_backend.set_current_key(k)
            assert restored_backend.get_state(counts).value() == k
            assert restored_backend.get_state(texts).value() == (str(k) * 2048 if k < 20
                                                                 else None)
    finally:
        harness.close_all()


def test_a_state_rewritten_in_many_runs_is_warmed_by_its_distinct_keys(
        tmp_path: Path) -> None:
    """One shard, 1,000 keys rewritten and snapshotted six times: six sorted runs, each holding
    every key, so RocksDB's ``estimate-num-keys`` counts 6,000 keys, whose 260 bytes each would
    not fit a 1 MB cache, while the 1,000 do. The warm-up counts each key once and fills the
    cache with all of them."""
    one_shard = RocksDBOptions(key_group_shards=1)
    harness = Harness(RocksDBStateBackend(one_shard, value_cache_size=0), tmp_path)
    try:
        backend = harness.create()
        counts = ValueStateDescriptor("count", "bigint")
        for rewrite in range(6):
            for k in range(1000):
                backend.set_current_key(k)
                backend.get_state(counts).update(rewrite * k)
            handles = harness.snapshot_all([backend])
        cached = RocksDBStateBackend(one_shard, value_cache_size="1 mb")
        restored_backend = harness.create(handles=handles, state_backend=cached)
        cache = cache_of(restored_backend)
        assert isinstance(restored_backend, RocksDBKeyedStateBackend)
        cf, _ = restored_backend.instances[0].column_family(counts.name)
        stored_keys = cf.property_int_value("rocksdb.estimate-num-keys")
        assert stored_keys >= 5000 and not cache.room_for(stored_keys)  # the runs, counted
        restored_backend.get_state(counts)
        assert cache.warmed == 1000 and cache.misses == 0
        for k in range(1000):
            restored_backend.set_current_key(k)
            assert restored_backend.get_state(counts).value() == 5 * k
        assert cache.misses == 0
    finally:
        harness.close_all()


def test_ttl_is_honoured_through_the_cache(tmp_path: Path) -> None:
    harness = Harness(CACHED, tmp_path)
    try:
        backend = harness.create()
        d = ValueStateDescriptor("last", "string", ttl=TTL)
        state = backend.get_state(d)
        backend.set_current_key(1)
        state.update("a")  # stamp T0
        harness.clock.advance(8_000)
        assert state.value() == "a"  # read and write: the stamp moves to T0 + 8 s
        harness.clock.advance(8_000)
        assert state.value() == "a"  # 8 s after the refresh: alive, refreshed again
        backend.set_current_key(2)
        state.update("b")
        harness.clock.advance(11_000)
        assert state.value() is None  # expired: a tombstone in the cache
        handles = harness.snapshot_all([backend])
        [back] = restored(harness, handles, 1)
        recs = {harness.key_serializer.deserialize(r.key_bytes): (r.value, r.ttl_timestamp)
                for r in back.iter_records("last")}
        # key 1 expired too by now (last refreshed at T0 + 16 s); iter_records leaves it out
        assert recs == {}
        harness.clock.advance(-11_000)
        recs = {harness.key_serializer.deserialize(r.key_bytes): (r.value, r.ttl_timestamp)
                for r in back.iter_records("last")}
        # key 2 was deleted when its read found it expired; key 1 carries its refreshed stamp
        assert recs == {1: ("a", harness.clock.now_ms())}
    finally:
        harness.close_all()


def test_the_incremental_ttl_cleanup_reaches_values_once_written_out(tmp_path: Path) -> None:
    """The cleanup cursor walks what RocksDB holds: buffered values join it at the write-out,
    then expire and go as without the cache."""
    harness = Harness(RocksDBStateBackend(value_cache_size="1 mb"), tmp_path)
    try:
        backend = harness.create()
        assert isinstance(backend, RocksDBKeyedStateBackend)
        ttl = StateTtlConfig(dt.timedelta(seconds=10), incremental_cleanup_size=5)
        state = backend.get_state(ValueStateDescriptor("v", "bigint", ttl=ttl))
        for key in range(20):
            backend.set_current_key(key)
            state.update(key)
        assert stored_count(backend, "v") == 0  # buffered
        harness.snapshot_all([backend])
        assert stored_count(backend, "v") == 20
        harness.clock.advance(20_000)
        backend.set_current_key(100)
        state.update(100)  # buffered; its cleanup step deleted 5 expired entries
        assert stored_count(backend, "v") == 15
        for _ in range(3):
            state.value()
        assert stored_count(backend, "v") == 0
        assert [e.value for e in backend.iter_entries("v")] == [100]
        assert stored_count(backend, "v") == 1
    finally:
        harness.close_all()


def stored_count(backend: RocksDBKeyedStateBackend, name: str) -> int:
    """Entries of state ``name`` in RocksDB (expired ones included), the cache aside."""
    return sum(1 for inst in backend.instances for _ in inst.cf(name).keys())


def test_values_of_mutable_types_are_private_to_each_read(tmp_path: Path) -> None:
    harness = Harness(CACHED, tmp_path)
    try:
        backend = harness.create()
        state = backend.get_state(ValueStateDescriptor("seen", "array<bigint>"))
        backend.set_current_key(1)
        mine = [1, 2]
        state.update(mine)
        mine.append(3)  # the caller's list after the write
        read = state.value()
        assert read == [1, 2]
        read.append(4)  # a read list changed without update
        assert state.value() == [1, 2]
        assert state.value() is not state.value()
    finally:
        harness.close_all()


@pytest.mark.parametrize("type_, written", [
    ("double", 3),
    ("bigint", np.int64(4)),
    ("int", np.int32(5)),
    ("timestamp", dt.datetime(2020, 1, 1)),
    ("string", "plain"),
    ("decimal(10,2)", 1),
])
def test_a_cached_value_reads_as_rocksdb_would_return_it(
        tmp_path: Path, type_: str, written: Any) -> None:
    """Written values are cached as their bytes decode: a read returns the same value of the
    same type as a read from RocksDB."""
    harness = Harness(CACHED, tmp_path)
    try:
        got = {}
        for name, config in (("cached", CACHED), ("uncached", UNCACHED)):
            backend = harness.create(state_backend=config)
            state = backend.get_state(ValueStateDescriptor("v", type_))
            backend.set_current_key(1)
            state.update(written)
            got[name] = state.value()
        assert got["cached"] == got["uncached"]
        assert type(got["cached"]) is type(got["uncached"])
    finally:
        harness.close_all()


def test_evictions_write_buffered_values_out(tmp_path: Path) -> None:
    harness = Harness(RocksDBStateBackend(value_cache_size="4 kb"), tmp_path)
    try:
        backend = harness.create()
        state = backend.get_state(ReducingStateDescriptor("total", _sum, "bigint"))
        for _ in range(2):
            for k in range(200):
                backend.set_current_key(k)
                state.add(k)
        cache = cache_of(backend)
        assert cache.evictions > 0 and cache.written > 0
        assert cache.bytes <= cache.capacity
        for k in range(200):
            backend.set_current_key(k)
            assert state.get() == 2 * k
        assert {harness.key_serializer.deserialize(e.key_bytes): e.value
                for e in backend.iter_entries("total")} == {k: 2 * k for k in range(200)}
    finally:
        harness.close_all()


def test_loaded_records_are_not_hidden_by_cached_entries(tmp_path: Path) -> None:
    from keyedstate.backends.base.backend import StateRecord

    harness = Harness(CACHED, tmp_path)
    try:
        backend = harness.create()
        d = ValueStateDescriptor("count", "bigint")
        state = backend.get_state(d)
        backend.set_current_key(7)
        state.update(1)
        backend.set_current_key(8)
        assert state.value() is None  # cached as absent
        ks = harness.key_serializer
        kg = ks.key_group(8, backend.max_parallelism)
        backend.load_records(meta_info_of(d), serializer_for("bigint"), None, [
            StateRecord(kg, ks.serialize(8), serialize_namespace(None), None, 80, None)])
        assert state.value() == 80
        backend.set_current_key(7)
        assert state.value() == 1
    finally:
        harness.close_all()


def test_a_closed_backend_refuses_cached_calls(tmp_path: Path) -> None:
    harness = Harness(CACHED, tmp_path)
    backend = harness.create()
    state = backend.get_state(ValueStateDescriptor("count", "bigint"))
    backend.set_current_key(1)
    state.update(1)
    assert state.value() == 1
    backend.close()
    with pytest.raises(BackendError, match="closed"):
        state.value()
    with pytest.raises(BackendError, match="closed"):
        state.update(2)


# --------------------------------------------------------------------------------------------
# the setting
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, "lots", True, 1.5, "-2 mb", None])
def test_a_bad_cache_size_is_a_typed_error_at_start(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="value-cache-size") as raised:
        load_backend("rocksdb", value_cache_size=bad)
    assert isinstance(raised.value, ValueError)
    assert repr(bad) in str(raised.value)


@pytest.mark.parametrize("bad", ["-1", "lots"])
def test_a_bad_cache_size_key_is_a_typed_error_at_start(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="value-cache-size"):
        JobConfig.from_mapping({"execution.checkpointing.dir": "/tmp/x",
                                "keyedstate.backend.rocksdb.value-cache-size": bad})


def test_the_cache_size_key_reaches_the_backend() -> None:
    def backend_of(**settings: Any) -> Any:
        config = JobConfig.from_mapping({"execution.checkpointing.dir": "/tmp/x", **settings})
        return load_backend(config.backend, **config.backend_options)

    assert backend_of().value_cache_size == DEFAULT_VALUE_CACHE_SIZE
    assert backend_of(**{"keyedstate.backend.rocksdb.value-cache-size": "16 mb"}
                      ).value_cache_size == 16 << 20
    assert backend_of(**{"keyedstate.backend.rocksdb.value-cache-size": 0}
                      ).value_cache_size == 0
    # the heap backend ignores it
    assert backend_of(**{"state.backend.type": "heap",
                         "keyedstate.backend.rocksdb.value-cache-size": "1 mb"}).name == "heap"


def test_a_cache_off_builds_no_cache(tmp_path: Path) -> None:
    harness = Harness(UNCACHED, tmp_path)
    try:
        backend = harness.create()
        assert isinstance(backend, RocksDBKeyedStateBackend)
        assert backend.value_cache is None
    finally:
        harness.close_all()
