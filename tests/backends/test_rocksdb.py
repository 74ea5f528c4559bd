"""RocksDB-specific behaviour (the generic state contract is in ``tests/backends/contract.py``).

Real RocksDB through rocksdict and real files through :class:`CheckpointStorage` on a tmp dir.
"""

from __future__ import annotations

import datetime as dt
import os
import pickle
from typing import Any

import pytest

from keyedstate.backends import load_backend
from keyedstate.backends.rocksdb import RocksDBOptions, RocksDBStateBackend
from keyedstate.backends.rocksdb.backend import RocksDBKeyedStateBackend
from keyedstate.backends.rocksdb.options import MiB, shared_resources
from keyedstate.backends.rocksdb.restore import (
    choose_the_best_state_handle_for_initial,
    column_family_names,
    iter_column_family_keys,
)
from keyedstate.checkpoint.metadata import KeyedStateHandle
from keyedstate.checkpoint.storage import CheckpointStorage
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

MAX_P = 128
KEYS = KeySerializer(["bigint"])

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
    return backend.create_keyed_backend(
        subtask_index=index, key_group_range=kg_range, max_parallelism=MAX_P,
        key_serializer=KEYS, local_dir=local_dir, **kwargs)


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
                           incremental=False, rescale_strategy="copy")
    assert isinstance(backend, RocksDBStateBackend) and backend.name == "rocksdb"
    clone = pickle.loads(pickle.dumps(backend))
    assert clone == backend and clone.options.block_cache_size == 8 * MiB
    with pytest.raises(ConfigurationError, match="rescale_strategy"):
        RocksDBStateBackend(rescale_strategy="delete")
    with pytest.raises(ConfigurationError, match="compression"):
        RocksDBOptions(compression="brotli")


def test_memory_options_are_applied_and_the_cache_is_shared(local_dir: str) -> None:
    options = RocksDBOptions(block_cache_size=24 * MiB, write_buffer_size=4 * MiB,
                             max_write_buffer_number=3, write_buffer_manager_size=12 * MiB,
                             block_size=8 * 1024, compression="zstd")
    backend = RocksDBStateBackend(options)
    with _backend(backend, KeyGroupRange(0, 63), local_dir) as a, \
            _backend(backend, KeyGroupRange(64, 127), local_dir, 1) as b:
        _state(a, VALUE)
        assert a.db.property_int_value("rocksdb.block-cache-capacity") == 24 * MiB
        db_dir = os.path.join(a.instance_dir, "db")
        options_file = max(f for f in os.listdir(db_dir) if f.startswith("OPTIONS-"))
        text = open(os.path.join(db_dir, options_file)).read()
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
    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir) as kb:
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

    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir) as kb:
        kb.set_current_key(1)
        reducing = _state(kb, ReducingStateDescriptor("sum", lambda a, b: a / 0, "bigint"))
        reducing.add(1)
        with pytest.raises(UserFunctionError, match="'sum'"):
            reducing.add(2)
        assert reducing.get() == 1
        with pytest.raises(UserFunctionError, match="'agg'"):
            _state(kb, AggregatingStateDescriptor("agg", Broken(), "bigint")).add(1)


# -- incremental snapshots (seed 003) --------------------------------------------------------


def test_second_checkpoint_uploads_only_new_ssts(storage: CheckpointStorage,
                                                 local_dir: str) -> None:
    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir) as kb:
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

    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir) as kb:
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
    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir,
                  restore_handles=[old], storage=storage) as restored:
        assert _content(restored) == expected


def test_unconfirmed_and_aborted_snapshots_are_never_the_base(storage: CheckpointStorage,
                                                               local_dir: str) -> None:
    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir) as kb:
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
    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir) as kb:
        _fill(kb, range(50))
        first = _checkpoint(kb, storage, 1)
        full = _checkpoint(kb, storage, 2, full=True)
    assert not set(_ssts(first).values()) & set(_ssts(full).values())
    assert full.incremental_size == full.full_size
    with _backend(RocksDBStateBackend(incremental=False), KeyGroupRange(0, 127),
                  local_dir) as kb:
        _fill(kb, range(50))
        one, two = _checkpoint(kb, storage, 11), _checkpoint(kb, storage, 12)
    assert not set(_ssts(one).values()) & set(_ssts(two).values())


def test_restore_reuses_restored_files_only_when_shared(storage: CheckpointStorage,
                                                        local_dir: str) -> None:
    backend, kg = RocksDBStateBackend(), KeyGroupRange(0, 127)
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
    backend, kg = RocksDBStateBackend(), KeyGroupRange(0, 127)
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


# -- rescaling (seed 001) --------------------------------------------------------------------


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
            for name in column_family_names(os.path.join(kb.instance_dir, "db"),
                                             backend.options):
                groups = {k[0] for k in iter_column_family_keys(kb.db, name)}
                assert all(g in kg for g in groups), f"{name} kept key groups outside {kg}"
            contents.append(_content(kb))
            handles.append(_checkpoint(kb, storage, cid))
    return handles, _merge(contents)


@pytest.mark.parametrize("old_p,new_p", [(2, 3), (3, 2)])
def test_rescale_ingest_equals_copy_equals_original(storage: CheckpointStorage, local_dir: str,
                                                    old_p: int, new_p: int) -> None:
    ingest, copy = RocksDBStateBackend(), RocksDBStateBackend(rescale_strategy="copy")
    handles, original = _snapshot_job(ingest, old_p, storage, local_dir, 1)
    assert len(original["count"]) == len(original["default"]) == len(original["timers"]) == 300
    assert all(len(e[4]) in (1, 2) for e in original["events"])
    _, by_ingest = _snapshot_job(ingest, new_p, storage, local_dir, 2, handles, fill=False)
    _, by_copy = _snapshot_job(copy, new_p, storage, local_dir, 3, handles, fill=False)
    assert by_ingest == original
    assert by_copy == original


def test_choose_the_best_state_handle_for_initial() -> None:
    def handle(start: int, end: int) -> KeyedStateHandle:
        return KeyedStateHandle("rocksdb", 0, start, end, 1, [], {}, {}, 0, 0)

    target = KeyGroupRange(40, 80)
    a, b, c = handle(0, 63), handle(64, 127), handle(30, 50)
    # fractions: a 24/64, b 17/64, c 11/21 -> c has least to clip away
    assert choose_the_best_state_handle_for_initial([a, b, c], target) is c
    assert choose_the_best_state_handle_for_initial([a, b], target) is a
    assert choose_the_best_state_handle_for_initial([a, b], target, 0.5) is None


# -- list order, timers ----------------------------------------------------------------------


def test_list_order_survives_restore_and_rescale(storage: CheckpointStorage,
                                                 local_dir: str) -> None:
    backend = RocksDBStateBackend()
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
    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir) as kb:
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
    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir,
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
    clock = ManualTimeProvider(0)
    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir,
                  time_provider=clock) as kb:
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
    kb = _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir)
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
from keyedstate.keys import KeySerializer
kb = RocksDBStateBackend().create_keyed_backend(
    subtask_index=3, key_group_range=KeyGroupRange(0, 127), max_parallelism=128,
    key_serializer=KeySerializer(["bigint"]), local_dir=sys.argv[1])
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
    from keyedstate.backends.local_dirs import process_start_time

    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir, index=2) as kb:
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
    from keyedstate.backends.local_dirs import process_start_time

    alive = os.path.join(local_dir, f"worker-{parent}-{process_start_time(parent)}")
    reused = os.path.join(local_dir, f"worker-{parent}-1")  # the pid now names another process
    other = os.path.join(local_dir, "not-a-worker")
    for path in (alive, reused, other):
        os.makedirs(os.path.join(path, "rocksdb-0-x"))
    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), local_dir) as kb:
        assert not os.path.exists(dead_worker)
        assert not os.path.exists(reused)
        assert os.path.isdir(alive) and os.path.isdir(other)
        assert os.path.isdir(kb.instance_dir)


def test_directories_of_a_killed_process_go_without_a_local_dir(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``state.backend.local-dir`` the instance directories go below the temp dir
    (``$TMPDIR/keyedstate/worker-...``), and are removed the same way."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = os.path.join(str(tmp_path), "keyedstate")
    import subprocess
    import sys

    script = _CREATE_AND_DIE.replace("local_dir=sys.argv[1]", "local_dir=None")
    proc = subprocess.run([sys.executable, "-c", script, ""], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == -9, proc.stderr
    left = proc.stdout.strip()
    assert os.path.dirname(os.path.dirname(left)) == base
    with _backend(RocksDBStateBackend(), KeyGroupRange(0, 127), None) as kb:  # type: ignore[arg-type]
        assert os.path.dirname(os.path.dirname(kb.instance_dir)) == base
        assert not os.path.exists(os.path.dirname(left))
