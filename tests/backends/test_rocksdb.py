"""RocksDB-specific behaviour (the generic state contract is in ``tests/backends/contract/``).

Real RocksDB through rocksdict and real files through :class:`CheckpointStorage` on a tmp dir.
"""

from __future__ import annotations

import datetime as dt
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
import rocksdict

from keyedstate.backends import load_backend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.rocksdb import RocksDBOptions, RocksDBStateBackend
from keyedstate.backends.rocksdb.backend import RocksDBKeyedStateBackend
from keyedstate.backends.rocksdb.options import MiB, shared_resources
from keyedstate.backends.rocksdb.restore import (
    column_family_names,
    iter_column_family_keys,
    plan_instances,
)
from keyedstate.backends.rocksdb.snapshot import InstanceHandle, split_instances
from keyedstate.errors import (
    BackendError,
    ConfigurationError,
    CorruptCheckpointError,
    StateNotFoundError,
    StateTypeMismatchError,
    UserFunctionError,
)
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
)
from keyedstate.state.timers import TIMER_STATE_NAMES, TimeDomain
from keyedstate.state.ttl import ManualTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle, StateMetaInfo

MAX_P = 128
KEYS = KeySerializer(["bigint"])
#: This module tests one instance per fresh backend, and the instances a rescale makes; a
#: fresh backend of several key-group shards (the default) is tested in
#: test_rocksdb_shards.py (and by the contract suite).
ONE_SHARD = RocksDBOptions(key_group_shards=1)

VALUE = ValueStateDescriptor("count", "bigint", default=0)
LIST = ListStateDescriptor("events", "string")
MAP = MapStateDescriptor("attrs", "string", "double")
#: A state named as RocksDB's own column family must be clipped and moved like any other.
DEFAULT = ValueStateDescriptor("default", "string")


def _descriptors() -> list[Any]:
    return [VALUE, LIST, MAP, DEFAULT]


@pytest.fixture
def storage(tmp_path: Any) -> CheckpointStorage:
    return CheckpointStorage(str(tmp_path / "checkpoints"))


@pytest.fixture
def local_dir(tmp_path: Any) -> str:
    path = tmp_path / "local"
    path.mkdir()
    return str(path)


def _backend(backend: RocksDBStateBackend, kg_range: KeyGroupRange, local_dir: str,
             index: int = 0, **kwargs: Any) -> RocksDBKeyedStateBackend:
    return backend.create_keyed_backend(KeyedStateBackendParameters(
        subtask_index=index, key_group_range=kg_range, max_parallelism=MAX_P,
        key_serializer=KEYS, local_dir=local_dir, **kwargs))


def _state(kb: RocksDBKeyedStateBackend, descriptor: Any) -> Any:
    """A state, typed loosely (the API classes are checked by the contract suite)."""
    return kb.get_state(descriptor)


def _fill(kb: RocksDBKeyedStateBackend, keys: range, round_: int = 0) -> None:
    value, lst, map_, default = (_state(kb, d) for d in _descriptors())
    for key in keys:
        kg = KEYS.key_group(key, MAX_P)
        if kg not in kb.key_group_range:
            continue
        kb.set_current_key(key)
        value.update(key * 10 + round_)
        lst.add(f"e{key}-{round_}")
        map_.put(f"r{round_}", float(key))
        default.update(f"d{key}-{round_}")
        kb.timer_service.register_event_time_timer(1000 + key)


def _content(kb: RocksDBKeyedStateBackend) -> dict[str, set[Any]]:
    """Everything the backend holds, comparable across parallelisms."""
    out: dict[str, set[Any]] = {}
    for info in kb.state_meta_infos():
        out[info.name] = {
            (e.key_group, e.key_bytes, e.namespace_bytes, e.user_key,
             tuple(e.value) if isinstance(e.value, list) else e.value)
            for e in kb.iter_entries(info.name)
        }
    out["timers"] = set(kb.timer_service.timers(TimeDomain.EVENT_TIME))
    return out


def _merge(contents: list[dict[str, set[Any]]]) -> dict[str, set[Any]]:
    merged: dict[str, set[Any]] = {}
    for content in contents:
        for name, entries in content.items():
            merged.setdefault(name, set()).update(entries)
    return merged


def _checkpoint(kb: RocksDBKeyedStateBackend, storage: CheckpointStorage, cid: int,
                confirm: bool = True, full: bool = False) -> KeyedStateHandle:
    handle = kb.snapshot(cid, storage.location(cid, kb.subtask_index), full=full).materialize()
    if confirm:
        kb.notify_checkpoint_complete(cid)
    return handle


def _ssts(handle: KeyedStateHandle) -> dict[str, str]:
    return {name: h.path for name, h in handle.shared.items()}


# -- configuration ---------------------------------------------------------------------------


def test_backend_pickles_and_loads_by_name() -> None:
    backend = load_backend("rocksdb", options=RocksDBOptions(block_cache_size=8 * MiB),
                           incremental=False, rescale_strategy="copy", max_instances=2)
    assert isinstance(backend, RocksDBStateBackend) and backend.name == "rocksdb"
    clone = pickle.loads(pickle.dumps(backend))
    assert clone == backend and clone.options.block_cache_size == 8 * MiB
    assert clone.max_instances == 2 and clone != RocksDBStateBackend(
        RocksDBOptions(block_cache_size=8 * MiB), incremental=False, rescale_strategy="copy")
    # A configuration pickled before max_instances existed gets the default.
    old = RocksDBStateBackend.__new__(RocksDBStateBackend)
    old.__setstate__({"options": RocksDBOptions(), "incremental": True,
                      "rescale_strategy": "ingest"})
    assert old == RocksDBStateBackend()
    with pytest.raises(ConfigurationError, match="rescale_strategy"):
        RocksDBStateBackend(rescale_strategy="delete")
    with pytest.raises(ConfigurationError, match="compression"):
        RocksDBOptions(compression="brotli")
    with pytest.raises(ConfigurationError, match="max_file_opening_threads"):
        RocksDBOptions(max_file_opening_threads=0)


def test_memory_options_are_applied_and_the_cache_is_shared(local_dir: str) -> None:
    options = RocksDBOptions(block_cache_size=24 * MiB, write_buffer_size=4 * MiB,
                             max_write_buffer_number=3, write_buffer_manager_size=12 * MiB,
                             block_size=8 * 1024, compression="zstd",
                             max_file_opening_threads=3)
    backend = RocksDBStateBackend(options)
    with _backend(backend, KeyGroupRange(0, 63), local_dir) as a, \
            _backend(backend, KeyGroupRange(64, 127), local_dir, 1) as b:
        _state(a, VALUE)
        assert a.db.property_int_value("rocksdb.block-cache-capacity") == 24 * MiB
        db_dir = os.path.join(a.instance_dir, "db")
        options_file = max(f for f in os.listdir(db_dir) if f.startswith("OPTIONS-"))
        text = open(os.path.join(db_dir, options_file)).read()
        assert "max_file_opening_threads=3" in text.split("[CFOptions")[0]  # a DB option
        state_cf = text.split('[CFOptions "count"]')[1]  # the state's own column family
        for setting in ("write_buffer_size=4194304", "max_write_buffer_number=3",
                        "compression=kZSTD", "block_size=8192", "filter_policy=bloomfilter",
                        "cache_index_and_filter_blocks=true"):
            assert setting in state_cf, setting
        wal_off: Any = a.write_options.disable_wal  # a property, though stubbed as a method
        assert wal_off is True
        # Two subtasks of one process share one cache and one write buffer manager.
        assert b.db.property_int_value("rocksdb.block-cache-capacity") == 24 * MiB
        cache, manager = shared_resources(options)
        assert shared_resources(options)[0] is cache and manager is not None
        assert manager.get_buffer_size() == 12 * MiB
        assert a.instance_dir != b.instance_dir
        # In this process's own directory below the local dir (removed once it ended).
        assert os.path.dirname(os.path.dirname(a.instance_dir)) == local_dir
    assert not os.path.exists(a.instance_dir) and not os.path.exists(b.instance_dir)


def test_state_kind_mismatch_and_unknown_state(local_dir: str) -> None:
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir) as kb:
        _state(kb, VALUE)
        assert _state(kb, ValueStateDescriptor("count", "bigint", default=0)) \
            is _state(kb, VALUE)
        with pytest.raises(StateTypeMismatchError, match="count"):
            _state(kb, ListStateDescriptor("count", "bigint"))
        with pytest.raises(StateNotFoundError, match="nope"):
            kb.iter_entries("nope")
        assert [m.name for m in kb.state_meta_infos()] == ["count"]  # no internal CFs


def test_user_function_errors_name_the_state(local_dir: str) -> None:
    class Broken:
        def create_accumulator(self) -> int:
            return 0

        def add(self, value: int, acc: int) -> int:
            raise ValueError("boom")

        def get_result(self, acc: int) -> int:
            return acc

    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir) as kb:
        kb.set_current_key(1)
        reducing = _state(kb, ReducingStateDescriptor("sum", lambda a, b: a / 0, "bigint"))
        reducing.add(1)
        with pytest.raises(UserFunctionError, match="'sum'"):
            reducing.add(2)
        assert reducing.get() == 1
        with pytest.raises(UserFunctionError, match="'agg'"):
            _state(kb, AggregatingStateDescriptor("agg", Broken(), "bigint")).add(1)


class _NoneAfterZero:
    """An untyped aggregate function whose accumulator is None after adding 0."""

    def create_accumulator(self) -> int:
        return 100

    def add(self, value: int, acc: int | None) -> int | None:
        return None if value == 0 else (acc or 0) + value

    def get_result(self, acc: int | None) -> tuple[str, int | None]:
        return ("result", acc)


@pytest.mark.parametrize("value_cache_size", [0, 32 << 20])
def test_an_accumulator_stored_as_none_is_present_to_bulk_calls(local_dir: str,
                                                                value_cache_size: int) -> None:
    """Absent means nothing stored: a bulk call treats an accumulator that decodes to None
    as its per-key call does, with the value cache or without it."""
    from keyedstate.state.batch_keys import BatchKeys

    backend = RocksDBStateBackend(ONE_SHARD, value_cache_size=value_cache_size)
    with _backend(backend, KeyGroupRange(0, 127), local_dir) as kb:
        state = _state(kb, AggregatingStateDescriptor("acc", _NoneAfterZero()))
        keys = BatchKeys.of([1], KEYS, MAX_P)
        kb.set_current_key(1)
        state.add(0)
        assert state.get() == ("result", None)
        assert state.get_many(keys) == [("result", None)]
        state.add_many(keys, [5])  # add(5, None), as state.add(5) would; no new accumulator
        kb.set_current_key(1)
        assert state.get() == ("result", 5)


# -- incremental snapshots (Flink's incremental checkpoints) ---------------------------------


def test_second_checkpoint_uploads_only_new_ssts(storage: CheckpointStorage,
                                                 local_dir: str) -> None:
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir) as kb:
        _fill(kb, range(200))
        first = _checkpoint(kb, storage, 1)
        assert first.incremental_size == first.full_size
        _fill(kb, range(10), round_=1)
        second = _checkpoint(kb, storage, 2)
    old, new = first.shared, second.shared
    reused = set(old) & set(new)
    assert reused and set(new) - reused
    for name in reused:  # the same StreamHandle: same file, size and checksum
        assert new[name] == old[name]
    uploaded = [h for n, h in new.items() if n not in reused] + list(second.private.values())
    assert second.incremental_size == sum(h.size for h in uploaded)
    assert second.full_size == sum(h.size for h in second.files())
    assert second.incremental_size < second.full_size
    assert second.properties["rocksdb.base-checkpoint-id"] == "1"
    # Private files belong to one checkpoint each.
    assert set(first.private) == set(second.private)
    assert not {h.path for h in first.private.values()} & {h.path for h in second.private.values()}
    assert all(h.path.startswith("chk-2/sub-0/") for h in second.private.values())


def test_private_files_under_names_without_uuid_still_restore(storage: CheckpointStorage,
                                                               local_dir: str) -> None:
    """Checkpoints written before private names carried a uuid (``chk-N/sub-i/<name>``,
    format version 2) restore as recorded: a reference is a path, never rebuilt from a name."""
    import msgspec

    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir) as kb:
        _fill(kb, range(20))
        handle = _checkpoint(kb, storage, 1)
        expected = _content(kb)
    old_private = {}
    for name, stream in handle.private.items():
        old_path = f"chk-1/sub-0/{name}"
        os.rename(storage.path(stream.path), storage.path(old_path))
        old_private[name] = msgspec.structs.replace(stream, path=old_path)
    old = msgspec.structs.replace(handle, private=old_private)
    old = msgspec.json.decode(msgspec.json.encode(old), type=KeyedStateHandle)
    assert old.private and all(h.path == f"chk-1/sub-0/{n}" for n, h in old.private.items())
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir,
                  restore_handles=[old], storage=storage) as restored:
        assert _content(restored) == expected


def test_unconfirmed_and_aborted_snapshots_are_never_the_base(storage: CheckpointStorage,
                                                               local_dir: str) -> None:
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir) as kb:
        _fill(kb, range(100))
        unconfirmed = _checkpoint(kb, storage, 1, confirm=False)
        _fill(kb, range(5), round_=1)
        second = _checkpoint(kb, storage, 2, confirm=False)
        assert not set(_ssts(unconfirmed).values()) & set(_ssts(second).values())
        assert second.incremental_size == second.full_size
        kb.notify_checkpoint_complete(2)
        _fill(kb, range(5), round_=2)
        aborted = _checkpoint(kb, storage, 3, confirm=False)
        kb.notify_checkpoint_aborted(3)
        _fill(kb, range(5), round_=3)
        fourth = _checkpoint(kb, storage, 4)
    paths = set(_ssts(fourth).values())
    assert set(_ssts(second).values()) & paths  # built on the confirmed checkpoint 2 ...
    assert not (set(_ssts(aborted).values()) - set(_ssts(second).values())) & paths  # not 3
    assert fourth.properties["rocksdb.base-checkpoint-id"] == "2"


def test_full_and_non_incremental_snapshots_upload_everything(storage: CheckpointStorage,
                                                              local_dir: str) -> None:
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir) as kb:
        _fill(kb, range(50))
        first = _checkpoint(kb, storage, 1)
        full = _checkpoint(kb, storage, 2, full=True)
    assert not set(_ssts(first).values()) & set(_ssts(full).values())
    assert full.incremental_size == full.full_size
    with _backend(RocksDBStateBackend(ONE_SHARD, incremental=False), KeyGroupRange(0, 127),
                  local_dir) as kb:
        _fill(kb, range(50))
        one, two = _checkpoint(kb, storage, 11), _checkpoint(kb, storage, 12)
    assert not set(_ssts(one).values()) & set(_ssts(two).values())


def test_restore_reuses_restored_files_only_when_shared(storage: CheckpointStorage,
                                                        local_dir: str) -> None:
    backend, kg = RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127)
    with _backend(backend, kg, local_dir) as kb:
        _fill(kb, range(100))
        handle = _checkpoint(kb, storage, 1)
        expected = _content(kb)
    for share, cid in ((True, 2), (False, 3)):
        with _backend(backend, kg, local_dir, restore_handles=[handle], storage=storage,
                      share_restored_files=share) as kb:
            assert _content(kb) == expected
            after = _checkpoint(kb, storage, cid)
        reused = set(_ssts(handle).values()) & set(_ssts(after).values())
        assert bool(reused) is share
        assert (after.incremental_size < after.full_size) is share


def test_corrupt_sst_fails_restore_with_a_typed_error(storage: CheckpointStorage,
                                                      local_dir: str) -> None:
    backend, kg = RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127)
    with _backend(backend, kg, local_dir) as kb:
        _fill(kb, range(100))
        handle = _checkpoint(kb, storage, 1)
    victim = next(iter(handle.shared.values()))
    path = storage.path(victim.path)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=victim.path):
        _backend(backend, kg, local_dir, restore_handles=[handle], storage=storage)
    # The failed instance left nothing behind (but this process's empty directory).
    assert [os.listdir(os.path.join(local_dir, d)) for d in os.listdir(local_dir)] in ([], [[]])


# -- rescaling (clip + SST ingest, Flink's DeleteRange rescaling) ----------------------------


def _check_instances(kb: RocksDBKeyedStateBackend) -> None:
    """The instances cover the backend's range in order, and each DB holds only keys of its
    own instance's key groups."""
    assert kb.instances[0].key_group_range.start == kb.key_group_range.start
    assert kb.instances[-1].key_group_range.end == kb.key_group_range.end
    for left, right in zip(kb.instances, kb.instances[1:]):
        assert left.key_group_range.end + 1 == right.key_group_range.start
    for inst in kb.instances:
        for name in column_family_names(inst.path, kb.options):
            groups = {k[0] for k in iter_column_family_keys(inst.db, name)}
            assert groups <= set(inst.key_group_range), \
                f"{name} of instance {inst.index} kept key groups outside {inst.key_group_range}"


def _snapshot_job(backend: RocksDBStateBackend, parallelism: int, storage: CheckpointStorage,
                  local_dir: str, cid: int, restore: list[KeyedStateHandle] | None = None,
                  fill: bool = True) -> tuple[list[KeyedStateHandle], dict[str, set[Any]]]:
    """Run every subtask of one parallelism (restored or fresh), checkpoint, return the handles
    and the merged content."""
    handles, contents = [], []
    for index in range(parallelism):
        kg = KeyGroupRange.of_operator(MAX_P, parallelism, index)
        with _backend(backend, kg, local_dir, index, restore_handles=restore or (),
                      storage=storage) as kb:
            if fill:
                _fill(kb, range(300))
                _fill(kb, range(0, 300, 7), round_=1)
            _check_instances(kb)
            contents.append(_content(kb))
            handles.append(_checkpoint(kb, storage, cid))
    return handles, _merge(contents)


@pytest.mark.parametrize("old_p,new_p", [(2, 3), (3, 2)])
def test_rescale_ingest_equals_copy_equals_original(storage: CheckpointStorage, local_dir: str,
                                                    old_p: int, new_p: int) -> None:
    ingest, copy = RocksDBStateBackend(ONE_SHARD), RocksDBStateBackend(ONE_SHARD, rescale_strategy="copy")
    handles, original = _snapshot_job(ingest, old_p, storage, local_dir, 1)
    assert len(original["count"]) == len(original["default"]) == len(original["timers"]) == 300
    assert all(len(e[4]) in (1, 2) for e in original["events"])
    _, by_ingest = _snapshot_job(ingest, new_p, storage, local_dir, 2, handles, fill=False)
    _, by_copy = _snapshot_job(copy, new_p, storage, local_dir, 3, handles, fill=False)
    assert by_ingest == original
    assert by_copy == original


def test_list_order_survives_restore_and_rescale(storage: CheckpointStorage,
                                                 local_dir: str) -> None:
    backend = RocksDBStateBackend(ONE_SHARD)
    with _backend(backend, KeyGroupRange(0, 127), local_dir) as kb:
        kb.set_current_key(42)
        _state(kb, LIST).add_all(["a", "b"])
        handle = _checkpoint(kb, storage, 1)
    half = KeyGroupRange.of_operator(MAX_P, 2, KEYS.key_group(42, MAX_P) * 2 // MAX_P)
    with _backend(backend, half, local_dir, restore_handles=[handle], storage=storage) as kb:
        kb.set_current_key(42)
        events = _state(kb, LIST)
        events.add("c")
        assert events.get() == ["a", "b", "c"]


def test_timers_fire_in_time_order_across_key_groups(local_dir: str) -> None:
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir) as kb:
        timers = kb.timer_service
        for key, ts in [(1, 30), (2, 10), (3, 20), (4, -5), (5, 10)]:
            kb.set_current_key(key)
            timers.register_event_time_timer(ts)
            timers.register_event_time_timer(ts)  # deduplicated
        kb.set_current_key(3)
        timers.delete_event_time_timer(20)
        assert [t.timestamp for t in timers.timers(TimeDomain.EVENT_TIME)] == [-5, 10, 10, 30]
        fired = []
        for timer in timers.pop_due(TimeDomain.EVENT_TIME, 25):
            fired.append(timer.timestamp)
            if timer.timestamp == -5:  # registered while firing, due, in another key group
                kb.set_current_key(6)
                timers.register_event_time_timer(12)
        assert fired == [-5, 10, 10, 12]
        assert timers.next_timestamp(TimeDomain.EVENT_TIME) == 30
        assert timers.next_timestamp(TimeDomain.PROCESSING_TIME) is None
        assert set(TIMER_STATE_NAMES.values()) <= set(
            column_family_names(os.path.join(kb.instance_dir, "db"), kb.options))


# -- TTL -------------------------------------------------------------------------------------


def _ttl(update: TtlUpdateType = TtlUpdateType.ON_CREATE_AND_WRITE,
         cleanup: int = 5) -> StateTtlConfig:
    return StateTtlConfig(dt.timedelta(seconds=10), update, incremental_cleanup_size=cleanup)


def _raw_count(kb: RocksDBKeyedStateBackend, name: str) -> int:
    return sum(1 for _ in iter_column_family_keys(kb.db, name))


def test_ttl_expiry_per_value_entry_and_element(local_dir: str) -> None:
    clock = ManualTimeProvider(1_000)
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir,
                  time_provider=clock) as kb:
        value = _state(kb, ValueStateDescriptor("v", "bigint", default=-1, ttl=_ttl()))
        read = _state(kb, ValueStateDescriptor("r", "bigint",
                                                 ttl=_ttl(TtlUpdateType.ON_READ_AND_WRITE)))
        lst = _state(kb, ListStateDescriptor("l", "bigint", ttl=_ttl()))
        map_ = _state(kb, MapStateDescriptor("m", "string", "bigint", ttl=_ttl()))
        kb.set_current_key(7)
        value.update(1)
        read.update(2)
        lst.add(1)
        map_.put("a", 1)
        clock.advance(6_000)
        lst.add(2)
        map_.put("b", 2)
        assert read.value() == 2  # refreshes r's timestamp to 7_000
        clock.advance(3_999)  # 10_999: nothing expired yet
        assert value.value() == 1 and lst.get() == [1, 2]
        clock.advance(1)  # 11_000: entries written at 1_000 expire
        assert value.value() == -1
        assert lst.get() == [2] and dict(map_.items()) == {"b": 2}
        assert map_.get("a") is None and not map_.contains("a")
        assert read.value() == 2
        assert [e.value for e in kb.iter_entries("l")] == [[2]]
        clock.advance(10_000)
        assert list(kb.iter_entries("m")) == [] and lst.get() == []
        assert read.value() is None


def test_ttl_incremental_cleanup_removes_expired_entries(local_dir: str) -> None:
    # The cursor walks what RocksDB holds: the value cache off, every write is there at once
    # (with it: test_rocksdb_cache.py).
    clock = ManualTimeProvider(0)
    with _backend(RocksDBStateBackend(ONE_SHARD, value_cache_size=0), KeyGroupRange(0, 127),
                  local_dir, time_provider=clock) as kb:
        state = _state(kb, ValueStateDescriptor("v", "bigint", ttl=_ttl(cleanup=5)))
        for key in range(20):
            kb.set_current_key(key)
            state.update(key)
        clock.advance(20_000)
        kb.set_current_key(100)
        state.update(100)
        assert _raw_count(kb, "v") == 21 - 5  # this access already checked 5 entries
        for _ in range(5):
            state.value()
        assert _raw_count(kb, "v") == 1
        assert [e.value for e in kb.iter_entries("v")] == [100]


def test_closed_backend_refuses_use(local_dir: str) -> None:
    kb = _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir)
    state = _state(kb, VALUE)
    kb.set_current_key(1)
    kb.close()
    kb.close()
    with pytest.raises(BackendError, match="closed"):
        state.value()
    with pytest.raises(BackendError, match="closed"):
        kb.timer_service.register_event_time_timer(1)
    with pytest.raises(BackendError, match="closed"):
        list(kb.iter_entries("count"))
    assert not os.path.exists(kb.instance_dir)



# -- working directories of ended processes ----------------------------------------------------

_CREATE_AND_DIE = """
import os, sys
from keyedstate.backends.rocksdb import RocksDBStateBackend
from keyedstate.keygroups import KeyGroupRange
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.keys import KeySerializer
kb = RocksDBStateBackend().create_keyed_backend(KeyedStateBackendParameters(
    subtask_index=3, key_group_range=KeyGroupRange(0, 127), max_parallelism=128,
    key_serializer=KeySerializer(["bigint"]), local_dir=sys.argv[1]))
print(kb.instance_dir, flush=True)
os.kill(os.getpid(), 9)  # killed with its backend open: close() never runs
"""


def _killed_process_instance_dir(local_dir: str) -> str:
    """The instance directory a process left when it was killed with its backend open."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _CREATE_AND_DIE, local_dir],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    left = proc.stdout.strip()
    assert os.path.isdir(left)
    return left


def test_instance_dirs_live_in_a_directory_of_their_process(local_dir: str) -> None:
    from keyedstate.backends.base.working_dirs import process_start_time

    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir, index=2) as kb:
        parent, name = os.path.split(kb.instance_dir)
        assert name.startswith("rocksdb-2-")
        assert os.path.dirname(parent) == local_dir
        assert os.path.basename(parent) == (
            f"worker-{os.getpid()}-{process_start_time(os.getpid())}")
    assert not os.path.exists(kb.instance_dir)


def test_directories_of_a_killed_process_are_removed_by_the_next_one(local_dir: str) -> None:
    """A Python worker killed with its RocksDB open (task kill, executor or driver loss)
    leaves its instance directory; the next process that creates its own directory beside it
    removes it (pid gone). Directories of live processes and other entries stay."""
    left = _killed_process_instance_dir(local_dir)
    dead_worker = os.path.dirname(left)
    parent = os.getppid()  # alive, with its start time: its directory stays
    from keyedstate.backends.base.working_dirs import process_start_time

    alive = os.path.join(local_dir, f"worker-{parent}-{process_start_time(parent)}")
    reused = os.path.join(local_dir, f"worker-{parent}-1")  # the pid now names another process
    other = os.path.join(local_dir, "not-a-worker")
    for path in (alive, reused, other):
        os.makedirs(os.path.join(path, "rocksdb-0-x"))
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir) as kb:
        assert not os.path.exists(dead_worker)
        assert not os.path.exists(reused)
        assert os.path.isdir(alive) and os.path.isdir(other)
        assert os.path.isdir(kb.instance_dir)


def test_directories_of_a_killed_process_go_without_a_local_dir(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``state.backend.local-dir`` the instance directories go below the temp dir
    (``$TMPDIR/keyedstate-work/worker-...``), and are removed the same way."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = os.path.join(str(tmp_path), "keyedstate-work")
    import subprocess
    import sys

    script = _CREATE_AND_DIE.replace("local_dir=sys.argv[1]", "local_dir=None")
    proc = subprocess.run([sys.executable, "-c", script, ""], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == -9, proc.stderr
    left = proc.stdout.strip()
    assert os.path.dirname(os.path.dirname(left)) == base
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), None) as kb:  # type: ignore[arg-type]
        assert os.path.dirname(os.path.dirname(kb.instance_dir)) == base
        assert not os.path.exists(os.path.dirname(left))


def test_a_script_run_from_the_temp_dir_still_imports_keyedstate(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default working root is not named ``keyedstate``: in the temp dir that directory
    would be a namespace package, and a script started there after a job ran would fail with
    ``ImportError: cannot import name 'JobConfig' from 'keyedstate' (unknown location)``."""
    import subprocess
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), None) as kb:  # type: ignore[arg-type]
        assert kb.instance_dir.startswith(str(tmp_path) + os.sep)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run(
            [sys.executable, "-c", "import keyedstate; from keyedstate import JobConfig; "
             "print(keyedstate.__file__)"],
            cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(os.path.join("keyedstate", "__init__.py"))
    assert not os.path.exists(os.path.join(str(tmp_path), "keyedstate"))


def test_the_former_default_working_root_is_retired(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$TMPDIR/keyedstate`` (the default of earlier versions) loses its ended processes'
    directories and goes once empty; a live process's directory keeps it."""
    import tempfile

    from keyedstate.backends.base.working_dirs import _this_process

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    former = os.path.join(str(tmp_path), "keyedstate")
    left = _killed_process_instance_dir(former)
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), None):  # type: ignore[arg-type]
        pass
    assert not os.path.exists(os.path.dirname(left)) and not os.path.exists(former)

    # in another temp dir (this process's own directory of the default exists already)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "other"))
    pid, start = _this_process()
    alive = os.path.join(str(tmp_path / "other"), "keyedstate", f"worker-{pid}-{start}")
    os.makedirs(alive)
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), None):  # type: ignore[arg-type]
        pass
    assert os.path.isdir(alive)


# -- key-group shards: several RocksDB instances per keyed backend ---------------------------


def _no_sst_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any key-by-key rewrite into SST files fail the test."""
    def forbidden(*_: Any, **__: Any) -> Any:
        raise AssertionError("a restore rewrote keys with SstFileWriter")
    monkeypatch.setattr(rocksdict, "SstFileWriter", forbidden)


def _restore_job(backend: RocksDBStateBackend, parallelism: int, storage: CheckpointStorage,
                 local_dir: str, cid: int, handles: list[KeyedStateHandle]
                 ) -> tuple[list[KeyedStateHandle], dict[str, set[Any]], list[int], int]:
    """Restore every subtask at ``parallelism`` and checkpoint it: the new handles, the merged
    content, the instance count per subtask and how many sub-handles were rewritten."""
    out, contents, counts, ingested = [], [], [], 0
    for index in range(parallelism):
        kg = KeyGroupRange.of_operator(MAX_P, parallelism, index)
        with _backend(backend, kg, local_dir, index, restore_handles=handles,
                      storage=storage) as kb:
            _check_instances(kb)
            counts.append(len(kb.instances))
            ingested += kb.ingested_on_restore
            contents.append(_content(kb))
            out.append(_checkpoint(kb, storage, cid))
    return out, _merge(contents), counts, ingested


@pytest.mark.parametrize("old_p,new_p,counts", [(4, 2, [2, 2]), (8, 3, [3, 4, 3])])
def test_scaling_in_reopens_every_old_instance_without_rewriting(
        storage: CheckpointStorage, local_dir: str, monkeypatch: pytest.MonkeyPatch,
        old_p: int, new_p: int, counts: list[int]) -> None:
    backend = RocksDBStateBackend(ONE_SHARD)
    handles, original = _snapshot_job(backend, old_p, storage, local_dir, 1)
    _no_sst_rewrite(monkeypatch)
    new, content, got, ingested = _restore_job(backend, new_p, storage, local_dir, 2, handles)
    assert got == counts and ingested == 0
    assert content == original
    # The handle lists its instances; each instance's files are named with its prefix.
    for handle in new:
        layout = handle.properties["rocksdb.instances"].split(",")
        assert len(layout) > 1
        prefixes = {n.split("/")[0] for n in [*handle.shared, *handle.private] if "/" in n}
        assert prefixes == {f"i{k}" for k in range(len(layout))}
        assert "KEYEDSTATE-META" in handle.private
    # ... and restores again at the same parallelism: every instance reopened as it was.
    _, again, got, ingested = _restore_job(backend, new_p, storage, local_dir, 3, new)
    assert got == counts and ingested == 0 and again == original


def test_multi_instance_handles_restore_same_and_rescaled_with_the_cap(
        storage: CheckpointStorage, local_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 -> 4 -> 3 -> 3 -> 1: scaling out keeps one instance, 4 -> 3 gives two per subtask,
    3 -> 3 reopens them, 3 -> 1 meets six old instances with a cap of four (two ingested)."""
    backend = RocksDBStateBackend(ONE_SHARD)
    handles, original = _snapshot_job(backend, 2, storage, local_dir, 1)
    with monkeypatch.context() as m:
        _no_sst_rewrite(m)
        handles, content, counts, _ = _restore_job(backend, 4, storage, local_dir, 2, handles)
        assert counts == [1, 1, 1, 1] and content == original
        handles, content, counts, _ = _restore_job(backend, 3, storage, local_dir, 3, handles)
        assert counts == [2, 2, 2] and content == original
        handles, content, counts, _ = _restore_job(backend, 3, storage, local_dir, 4, handles)
        assert counts == [2, 2, 2] and content == original
    _, content, counts, ingested = _restore_job(backend, 1, storage, local_dir, 5, handles)
    assert counts == [4] and ingested == 2 and content == original
    # A lower cap merges more; a cap of one is a single instance built by ingestion.
    for cap, instances in ((2, 2), (1, 1)):
        capped = RocksDBStateBackend(ONE_SHARD, max_instances=cap)
        _, content, counts, ingested = _restore_job(capped, 1, storage, local_dir, 6 + cap,
                                                    handles)
        assert counts == [instances] and ingested == 6 - instances and content == original


def test_plan_instances_cuts_even_groups_opened_from_their_largest() -> None:
    def sub(start: int, end: int) -> InstanceHandle:
        handle = KeyedStateHandle("rocksdb", 0, start, end, 1, [], {}, {}, 0, 0)
        return split_instances(handle)[0]

    subs = [sub(0, 9), sub(10, 12), sub(13, 40), sub(41, 42), sub(43, 80)]
    plans = plan_instances(subs, KeyGroupRange(5, 70), 2)
    # Overlaps of 5, 3, 28, 2 and 28 key groups: [5, 40] (36) and [41, 70] (30) is the most
    # even cut, each opened from its 28-key-group sub-handle, the others ingested.
    assert [(p.key_group_range.start, p.key_group_range.end) for p in plans] == [(5, 40), (41, 70)]
    assert [p.initial.key_group_range.start for p in plans if p.initial] == [13, 43]
    assert [[s.key_group_range.start for s in p.ingested] for p in plans] == [[0, 10], [41]]
    # 24 equal sub-handles (3 -> 1 with 8 shards each) under a cap of 16: pairs, then singles,
    # never one instance holding the nine last ones.
    plans = plan_instances([sub(k * 8, k * 8 + 7) for k in range(24)], KeyGroupRange(0, 191),
                           16)
    assert [len(p.key_group_range) for p in plans] == [16] * 8 + [8] * 8
    # Uncovered key groups go to a neighbour; nothing overlapping: one empty instance.
    plans = plan_instances([sub(10, 20)], KeyGroupRange(0, 30), 4)
    assert [(p.key_group_range.start, p.key_group_range.end) for p in plans] == [(0, 30)]
    assert plan_instances([], KeyGroupRange(0, 30), 4)[0].initial is None
    with pytest.raises(ConfigurationError, match="max_instances"):
        RocksDBStateBackend(max_instances=0)


def _sharded(storage: CheckpointStorage, local_dir: str, value_cache_size: int = 32 << 20,
             **kwargs: Any) -> RocksDBKeyedStateBackend:
    """Subtask 0 of 2, restored from four subtasks: two instances."""
    backend = RocksDBStateBackend(ONE_SHARD, value_cache_size=value_cache_size)
    handles = []
    for index in range(4):
        kg = KeyGroupRange.of_operator(MAX_P, 4, index)
        with _backend(backend, kg, local_dir, index) as kb:
            _fill(kb, range(200))
            handles.append(_checkpoint(kb, storage, 1))
    kb = _backend(backend, KeyGroupRange.of_operator(MAX_P, 2, 0), local_dir,
                  restore_handles=handles, storage=storage, **kwargs)
    assert len(kb.instances) == 2
    return kb


def test_timers_across_instances_fire_in_timestamp_order(storage: CheckpointStorage,
                                                         local_dir: str) -> None:
    with _sharded(storage, local_dir) as kb:
        timers = kb.timer_service
        restored = sorted(t.timestamp for t in timers.timers(TimeDomain.EVENT_TIME))
        by_instance: dict[int, list[int]] = {0: [], 1: []}
        for key in range(1000):
            kg = KEYS.key_group(key, MAX_P)
            if kg in kb.key_group_range and len(by_instance[kb.instance_of(kg).index]) < 3:
                by_instance[kb.instance_of(kg).index].append(key)
        first, second = by_instance[0], by_instance[1]
        # Interleaved timestamps, alternating between the instances.
        plan = [(second[0], -50), (first[0], -40), (second[1], -30), (first[1], -20)]
        for key, ts in plan:
            kb.set_current_key(key)
            timers.register_event_time_timer(ts)
            timers.register_processing_time_timer(ts)
        assert [t.timestamp for t in timers.timers(TimeDomain.EVENT_TIME)] \
            == [-50, -40, -30, -20, *restored]
        assert timers.next_timestamp(TimeDomain.PROCESSING_TIME) == -50
        fired = []
        for timer in timers.pop_due(TimeDomain.EVENT_TIME, -10):
            fired.append((timer.timestamp, kb.instance_of(timer.key_group).index))
            if timer.timestamp == -50:  # registered while firing, due, in the other instance
                kb.set_current_key(first[2])
                timers.register_event_time_timer(-45)
        assert fired == [(-50, 1), (-45, 0), (-40, 0), (-30, 1), (-20, 0)]
        assert timers.next_timestamp(TimeDomain.EVENT_TIME) == restored[0]
        assert [t.timestamp for t in timers.pop_due(TimeDomain.EVENT_TIME, 10**9)] == restored
        assert timers.next_timestamp(TimeDomain.EVENT_TIME) is None


def test_incremental_snapshots_of_several_instances_upload_only_new_ssts(
        storage: CheckpointStorage, local_dir: str) -> None:
    with _sharded(storage, local_dir) as kb:
        first = _checkpoint(kb, storage, 2)
        # The restored SSTs of both instances are referenced, not uploaded again.
        restored = {h.path for h in first.shared.values()} & set(_ssts_of(storage, 1))
        assert {n.split("/")[0] for n, h in first.shared.items() if h.path in restored} \
            == {"i0", "i1"}
        assert first.properties["rocksdb.base-checkpoint-id"] == "1,1"
        # Change keys of instance 1 only: instance 0 uploads nothing new.
        keys = [k for k in range(200) if KEYS.key_group(k, MAX_P) in
                kb.instances[1].key_group_range]
        _fill(kb, keys[:5], round_=7)
        second = _checkpoint(kb, storage, 3)
        assert second.properties["rocksdb.base-checkpoint-id"] == "2,2"
        new = {n for n in second.shared if n not in first.shared
               or second.shared[n] != first.shared[n]}
        assert new and all(n.startswith("i1/") for n in new)
        assert {n for n in second.shared if n.startswith("i0/")} \
            == {n for n in first.shared if n.startswith("i0/")}
        uploaded = [second.shared[n] for n in new] + list(second.private.values())
        assert second.incremental_size == sum(h.size for h in uploaded)
        assert second.incremental_size < second.full_size
        expected = _content(kb)
    # The handle restores at the same parallelism into two instances again.
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange.of_operator(MAX_P, 2, 0), local_dir,
                  restore_handles=[second], storage=storage) as kb:
        assert len(kb.instances) == 2 and kb.ingested_on_restore == 0
        assert _content(kb) == expected


def _ssts_of(storage: CheckpointStorage, cid: int) -> list[str]:
    return sorted(f"shared/{p.name}" for p in Path(storage.path("shared")).iterdir()
                  if p.name.startswith(f"chk-{cid}-"))


def test_ttl_cleanup_and_full_snapshot_cover_every_instance(storage: CheckpointStorage,
                                                            local_dir: str) -> None:
    clock = ManualTimeProvider(0)
    # The value cache off: the cursor walks what RocksDB holds (see the test above).
    with _sharded(storage, local_dir, value_cache_size=0, time_provider=clock) as kb:
        state = _state(kb, ValueStateDescriptor("v", "bigint", ttl=_ttl(cleanup=3)))
        keys = [k for k in range(200) if KEYS.key_group(k, MAX_P) in kb.key_group_range][:12]
        assert {kb.instance_of(KEYS.key_group(k, MAX_P)).index for k in keys} == {0, 1}
        for key in keys:
            kb.set_current_key(key)
            state.update(key)
        clock.advance(20_000)
        live = [k for k in range(200, 400) if KEYS.key_group(k, MAX_P) in kb.key_group_range][0]
        kb.set_current_key(live)
        state.update(live)
        for _ in range(10):  # each read of a live value checks 3 entries: around both instances
            state.value()
        assert sum(_raw_count_in(inst, "v") for inst in kb.instances) == 1
        assert [e.value for e in kb.iter_entries("v")] == [live]
        for key in keys:
            kb.set_current_key(key)
            state.update(key)
        clock.advance(20_000)
        handle = _checkpoint(kb, storage, 2, full=True)  # purges every instance first
        assert sum(_raw_count_in(inst, "v") for inst in kb.instances) == 0
    with _backend(RocksDBStateBackend(ONE_SHARD), kb.key_group_range, local_dir, restore_handles=[handle],
                  storage=storage, time_provider=ManualTimeProvider(0)) as kb:
        assert list(kb.iter_entries("v")) == []


def _raw_count_in(instance: Any, name: str) -> int:
    return sum(1 for _ in iter_column_family_keys(instance.db, name))


def test_load_records_routes_by_key_group(storage: CheckpointStorage, local_dir: str) -> None:
    with _sharded(storage, local_dir) as kb:
        records = list(kb.iter_records("count"))
        assert {kb.instance_of(r.key_group).index for r in records} == {0, 1}
        meta = next(m for m in kb.state_meta_infos() if m.name == "count")
        copy = StateMetaInfo("copy", meta.kind, meta.value_type, meta.user_key_type, None)
        assert kb.load_records(copy, VALUE.value_serializer, None, records) == len(records)
        assert [(e.key_group, e.key_bytes, e.value) for e in kb.iter_entries("copy")] \
            == [(e.key_group, e.key_bytes, e.value) for e in kb.iter_entries("count")]
        _check_instances(kb)


FIXTURE = Path(__file__).parent / "fixtures" / "rocksdb-single-instance"


def _fixture_content() -> dict[int, Any]:
    """What ``fixtures/make_rocksdb_single_instance.py`` wrote: keys 0-39."""
    return {key: (key * 10, [f"a{key}", f"b{key}"], {"x": float(key)}, 1000 + key)
            for key in range(40)}


@pytest.mark.parametrize("parallelism", [2, 1, 3])
def test_a_handle_written_before_instances_still_restores(tmp_path: Path, local_dir: str,
                                                          parallelism: int) -> None:
    """Handles of keyedstate before key-group shards (a fixture written by that code): no
    instance property, unprefixed names; one instance covering the handle's range."""
    root = tmp_path / "fixture"
    shutil.copytree(FIXTURE, root)
    handles = msgspec.json.decode((root / "handles.json").read_bytes(),
                                  type=list[KeyedStateHandle])
    assert all("rocksdb.instances" not in h.properties for h in handles)
    assert not any("/" in n for h in handles for n in [*h.shared, *h.private])
    storage = CheckpointStorage(str(root / "checkpoints"))
    found = {}
    for index in range(parallelism):
        kg = KeyGroupRange.of_operator(MAX_P, parallelism, index)
        with _backend(RocksDBStateBackend(ONE_SHARD), kg, local_dir, index, restore_handles=handles,
                      storage=storage) as kb:
            # one instance per overlapping old subtask, none rewritten
            assert len(kb.instances) == sum(1 for h in handles
                                            if h.key_group_range.intersection(kg))
            assert kb.ingested_on_restore == 0
            value, lst = _state(kb, VALUE), _state(kb, LIST)
            attrs = _state(kb, MAP)
            stamps = {t.key_bytes: t.timestamp for t in kb.timer_service.timers(
                TimeDomain.EVENT_TIME)}
            for key in range(40):
                if KEYS.key_group(key, MAX_P) in kg:
                    kb.set_current_key(key)
                    found[key] = (value.value(), lst.get(), dict(attrs.items()),
                                  stamps[KEYS.serialize(key)])
    assert found == _fixture_content()


def test_single_instance_backends_write_the_layout_of_before(storage: CheckpointStorage,
                                                              local_dir: str) -> None:
    with _backend(RocksDBStateBackend(ONE_SHARD), KeyGroupRange(0, 127), local_dir) as kb:
        _fill(kb, range(20))
        handle = _checkpoint(kb, storage, 1)
    assert "rocksdb.instances" not in handle.properties
    assert "KEYEDSTATE-META" in handle.private
    assert not any("/" in n for n in [*handle.shared, *handle.private])


def test_state_sizes_of_a_multi_instance_handle_add_up(storage: CheckpointStorage,
                                                       local_dir: str) -> None:
    from keyedstate.backends.base.backend import OTHER_FILES

    with _sharded(storage, local_dir) as kb:
        handle = _checkpoint(kb, storage, 2)
    sizes = RocksDBStateBackend(ONE_SHARD).state_sizes(storage, handle)
    assert sizes["count"] > 0 and sizes["events"] > 0 and sizes[OTHER_FILES] > 0
    assert sum(sizes.values()) == handle.full_size


def test_lazy_map_iteration_writes_to_its_own_instance(storage: CheckpointStorage,
                                                        local_dir: str) -> None:
    """A map's ``items()`` refreshes TTL timestamps as it goes; switching the current key to
    another instance mid-iteration must not send those writes there."""
    clock = ManualTimeProvider(0)
    with _sharded(storage, local_dir, time_provider=clock) as kb:
        attrs = _state(kb, MapStateDescriptor("m", "string", "bigint",
                                              ttl=_ttl(TtlUpdateType.ON_READ_AND_WRITE, 0)))
        keys = [k for k in range(200) if KEYS.key_group(k, MAX_P) in kb.key_group_range]
        a = next(k for k in keys if kb.instance_of(KEYS.key_group(k, MAX_P)).index == 0)
        b = next(k for k in keys if kb.instance_of(KEYS.key_group(k, MAX_P)).index == 1)
        kb.set_current_key(a)
        attrs.put_all({"x": 1, "y": 2})
        clock.advance(5_000)
        items = attrs.items()
        first = next(items)
        kb.set_current_key(b)  # another instance, which the state now uses
        assert attrs.get("x") is None
        assert [first, *items] == [("x", 1), ("y", 2)]
        _check_instances(kb)
        assert _raw_count_in(kb.instances[1], "m") == 0
        clock.advance(6_000)  # 11 s after the put, 6 s after the refresh: still live
        kb.set_current_key(a)
        assert dict(attrs.items()) == {"x": 1, "y": 2}


def test_every_method_as_first_access_after_a_key_switch_uses_that_keys_instance(
        storage: CheckpointStorage, local_dir: str) -> None:
    """A state is rebound to the current key's instance when it computes its key; a method
    that took the bound ``put`` / ``delete`` before computing the key would use the previous
    key's instance. The chaos soak (seed 1) found it: a map ``remove`` as the first access of
    a key, right after a key of another instance, deleted nothing, so the entry stayed (and
    later puts added to its old value)."""
    with _sharded(storage, local_dir) as kb:
        keys = [k for k in range(200) if KEYS.key_group(k, MAX_P) in kb.key_group_range]
        a = next(k for k in keys if kb.instance_of(KEYS.key_group(k, MAX_P)).index == 0)
        b = next(k for k in keys if kb.instance_of(KEYS.key_group(k, MAX_P)).index == 1)
        value = _state(kb, ValueStateDescriptor("v", "bigint"))
        lst = _state(kb, ListStateDescriptor("l", "bigint"))
        map_ = _state(kb, MapStateDescriptor("m", "string", "bigint"))
        # (what, its state, set-up under the key, the method under test, check of what it did)
        cases: list[tuple[str, Any, Any, Any, Any]] = [
            ("value.update", value, lambda: value.update(1), lambda: value.update(2),
             lambda: value.value() == 2),
            ("value.clear", value, lambda: value.update(1), value.clear,
             lambda: value.value() is None),
            ("list.add", lst, lambda: lst.add(1), lambda: lst.add(2), lambda: lst.get() == [1, 2]),
            ("list.add_all", lst, lambda: lst.add(1), lambda: lst.add_all([2]),
             lambda: lst.get() == [1, 2]),
            ("list.update", lst, lambda: lst.add(1), lambda: lst.update([3]),
             lambda: lst.get() == [3]),
            ("list.clear", lst, lambda: lst.add(1), lst.clear, lambda: lst.get() == []),
            ("map.put", map_, lambda: map_.put("x", 1), lambda: map_.put("x", 2),
             lambda: dict(map_.items()) == {"x": 2}),
            ("map.put_all", map_, lambda: map_.put("x", 1), lambda: map_.put_all({"x": 2}),
             lambda: dict(map_.items()) == {"x": 2}),
            ("map.remove", map_, lambda: map_.put("x", 1), lambda: map_.remove("x"),
             lambda: dict(map_.items()) == {}),
            ("map.clear", map_, lambda: map_.put("x", 1), map_.clear,
             lambda: dict(map_.items()) == {}),
        ]
        for name, state, set_up, method, check in cases:
            for this, other in [(a, b), (b, a)]:
                kb.set_current_key(this)
                state.clear()
                set_up()
                kb.set_current_key(other)
                state.clear()  # the state is now bound to the other key's instance
                kb.set_current_key(this)
                method()  # the first access under this key
                assert check(), f"{name} after a switch to instance " \
                                f"{kb.instance_of(KEYS.key_group(this, MAX_P)).index}"
                _check_instances(kb)


@pytest.mark.parametrize("ttl", [None, "ttl-on-write", "ttl-on-read"])
def test_bulk_calls_store_the_bytes_per_key_calls_store(tmp_path: Any, ttl: str | None
                                                        ) -> None:
    """Beyond the contract's equal live records: the raw key and value bytes of every live
    entry (TTL timestamps and list sequence numbers included) are equal. Expired entries not
    yet removed may differ: the incremental cleanup of a bulk call's accesses runs at once."""
    from keyedstate.backends.rocksdb.key_layout import unpack_timestamp

    from .contract.bulk import TTLS, Script
    from .contract.common import Harness

    harness = Harness(RocksDBStateBackend(ONE_SHARD), tmp_path)
    config = TTLS[ttl] if ttl else None
    try:
        per_key, bulk = harness.create(), harness.create()
        Script(harness, config, 11, range(50)).run(per_key, bulk, 10)
        assert isinstance(per_key, RocksDBKeyedStateBackend)
        assert isinstance(bulk, RocksDBKeyedStateBackend)
        now = harness.clock.now_ms()

        def live(raw: bytes) -> bool:
            return config is None or unpack_timestamp(raw) + config.ttl_ms > now

        for name in per_key.instances[0].cfs:
            stored = [[(k, v) for k, v in b.instances[0].cf(name).items()
                       if name.startswith("_timers") or live(v)] for b in (per_key, bulk)]
            assert stored[0] == stored[1], name
        assert any(per_key.instances[0].cf("list").items())
    finally:
        harness.close_all()
