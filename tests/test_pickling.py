"""Everything the driver ships to executors pickles, and works after unpickling.

Spark pickles task closures with cloudpickle (lambdas included) and data with pickle; both are
checked. The last test unpickles in a fresh interpreter, as an executor does.
"""

from __future__ import annotations

import datetime as dt
import decimal
import operator
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from pyspark import cloudpickle

import keyedstate
from keyedstate.backends import backend_names, load_backend
from keyedstate.backends.base.backend import StateBackend, StateEntry
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.serde import ArrowTypeSerializer, PickleSerializer
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
)
from keyedstate.state.timers import Timer
from keyedstate.state.ttl import ManualTimeProvider, SystemTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import (
    CheckpointMetadata,
    KeyedStateHandle,
    SnapshotKind,
    StateMetaInfo,
    StreamHandle,
    deserialize_metadata,
    serialize_metadata,
)
from keyedstate.storage.location import CheckpointStorageLocation

DUMPS: dict[str, Callable[[Any], bytes]] = {
    "pickle": lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
    "cloudpickle": cloudpickle.dumps,
}


@pytest.fixture(params=sorted(DUMPS))
def ship(request: pytest.FixtureRequest) -> Callable[[Any], Any]:
    """Pickle and unpickle, as the trip to an executor does."""
    dumps = DUMPS[request.param]
    return lambda obj: pickle.loads(dumps(obj))


class Average:
    def create_accumulator(self):
        return {"sum": 0.0, "count": 0}

    def add(self, value, acc):
        return {"sum": acc["sum"] + value, "count": acc["count"] + 1}

    def get_result(self, acc):
        return acc["sum"] / acc["count"]


TTL = StateTtlConfig(dt.timedelta(seconds=3), TtlUpdateType.ON_READ_AND_WRITE,
                     incremental_cleanup_size=2, cleanup_in_full_snapshot=False)


# --------------------------------------------------------------------------------------------
# serializers, descriptors, TTL, clocks
# --------------------------------------------------------------------------------------------

def test_key_serializer(ship):
    ks = KeySerializer(["string", "bigint", "decimal(10,2)"])
    clone = ship(ks)
    key = ("k", 7, decimal.Decimal("1.25"))
    assert clone == ks
    assert clone.serialize(key) == ks.serialize(key)
    assert clone.key_group(key, 128) == ks.key_group(key, 128)
    assert clone.deserialize(ks.serialize(key)) == key
    inferred = KeySerializer()
    inferred.serialize(5)
    assert ship(inferred).type_strings == ["int64"]
    assert ship(KeySerializer()).type_strings == []


@pytest.mark.parametrize("type_", ["bigint", "struct<a:int,b:array<string>>",
                                   "map<string,timestamp>", "decimal(10,2)"])
def test_arrow_type_serializer(ship, type_):
    ser = ArrowTypeSerializer(type_)
    clone = ship(ser)
    assert clone == ser and clone.type_string == ser.type_string
    value = {"bigint": 5, "decimal(10,2)": decimal.Decimal("1.50"),
             "struct<a:int,b:array<string>>": {"a": 1, "b": ["x"]},
             "map<string,timestamp>": {"t": dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)},
             }[type_]
    assert clone.serialize(value) == ser.serialize(value)
    assert clone.deserialize(ser.serialize(value)) == value


def test_pickle_serializer(ship):
    clone = ship(PickleSerializer())
    assert clone == PickleSerializer()
    assert clone.deserialize(PickleSerializer().serialize({"a": (1, 2)})) == {"a": (1, 2)}


def test_value_list_map_descriptors(ship):
    for d in (ValueStateDescriptor("v", "bigint", default=5, ttl=TTL),
              ValueStateDescriptor("p"),
              ListStateDescriptor("l", "string"),
              MapStateDescriptor("m", "string", "array<bigint>", ttl=TTL),
              MapStateDescriptor("pm")):
        clone = ship(d)
        assert type(clone) is type(d)
        assert (clone.name, clone.kind, clone.type, clone.ttl) == (d.name, d.kind, d.type, d.ttl)
        assert clone.value_serializer == d.value_serializer
        assert clone.user_key_serializer == d.user_key_serializer
    assert ship(ValueStateDescriptor("v", "bigint", default=5)).default == 5
    m = ship(MapStateDescriptor("m", "string", "array<bigint>"))
    assert m.key_type == "string"
    assert m.value_serializer.deserialize(m.value_serializer.serialize([1, 2])) == [1, 2]


def test_reducing_descriptor_with_a_function(ship):
    d = ship(ReducingStateDescriptor("r", operator.add, "bigint", ttl=TTL))
    assert d.reduce_function(2, 3) == 5
    assert d.ttl == TTL


def test_descriptors_with_lambdas_via_cloudpickle():
    offset = 10  # captured by the closure
    r = pickle.loads(cloudpickle.dumps(
        ReducingStateDescriptor("r", lambda a, b: a + b + offset, "bigint")))
    assert r.reduce_function(1, 2) == 13

    class LocalAgg:  # defined in a function: only cloudpickle can ship it
        def create_accumulator(self):
            return 0

        def add(self, value, acc):
            return acc + value * offset

        def get_result(self, acc):
            return -acc

    a = pickle.loads(cloudpickle.dumps(AggregatingStateDescriptor("a", LocalAgg(), "bigint")))
    f = a.aggregate_function
    assert f.get_result(f.add(2, f.create_accumulator())) == -20


def test_aggregating_descriptor(ship):
    d = ship(AggregatingStateDescriptor("a", Average(), "struct<sum:double,count:bigint>"))
    f = d.aggregate_function
    assert f.get_result(f.add(4.0, f.add(2.0, f.create_accumulator()))) == 3.0
    assert d.value_serializer == ArrowTypeSerializer("struct<sum:double,count:bigint>")


def test_ttl_config(ship):
    clone = ship(TTL)
    assert clone == TTL
    assert clone.ttl_ms == 3000
    assert clone.update_type is TtlUpdateType.ON_READ_AND_WRITE
    assert (clone.incremental_cleanup_size, clone.cleanup_in_full_snapshot) == (2, False)


def test_time_providers(ship):
    clock = ManualTimeProvider(1234)
    clone = ship(clock)
    assert clone.now_ms() == 1234
    clone.advance(6)
    assert clone.now_ms() == 1240 and clock.now_ms() == 1234
    system = ship(SystemTimeProvider())
    assert abs(system.now_ms() - SystemTimeProvider().now_ms()) < 60_000


# --------------------------------------------------------------------------------------------
# checkpoint storage and metadata
# --------------------------------------------------------------------------------------------

def test_checkpoint_storage_and_location(ship, tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"), {"auto_mkdir": True})
    handle = storage.write("chk-1/x", b"payload")
    assert storage.fs is not None  # connected before pickling: the connection isn't shipped
    clone = ship(storage)
    assert (clone.url, clone.storage_options) == (storage.url, storage.storage_options)
    assert clone.read_verified(handle) == b"payload"
    location = storage.location(3, 1)
    location.write_private(b"before", "a")
    loc = ship(location)
    assert isinstance(loc, CheckpointStorageLocation)
    assert (loc.checkpoint_id, loc.subtask_index) == (3, 1)
    written = loc.write_shared(b"shared bytes", "s.sst")
    assert storage.read_verified(written) == b"shared bytes"
    assert loc.storage.read_verified(written) == b"shared bytes"


def _handle() -> KeyedStateHandle:
    return KeyedStateHandle(
        backend="heap", subtask_index=2, key_group_start=64, key_group_end=95, checkpoint_id=7,
        states=[StateMetaInfo("v", "value", "int64", None, 1000),
                StateMetaInfo("m", "map", "pickle", "string")],
        shared={"000001.sst": StreamHandle("shared/abc-000001.sst", 10, "00ff")},
        private={"MANIFEST": StreamHandle("chk-7/sub-2/MANIFEST", 3, "0a0b")},
        full_size=13, incremental_size=3, properties={"k": "v"})


def test_keyed_state_handle(ship):
    handle = _handle()
    clone = ship(handle)
    assert clone == handle
    assert clone.key_group_range == KeyGroupRange(64, 95)
    assert clone.files() == handle.files()


def test_checkpoint_metadata(ship):
    metadata = CheckpointMetadata(
        checkpoint_id=7, timestamp_ms=1, backend="heap", parallelism=4, max_parallelism=128,
        key_types=["int64"], handles=[_handle()], kind=SnapshotKind.SAVEPOINT)
    clone = ship(metadata)
    assert clone == metadata
    assert deserialize_metadata(serialize_metadata(clone)) == metadata
    assert clone.full_size == 13


def test_small_values_returned_by_executors(ship):
    assert ship(KeyGroupRange(3, 9)) == KeyGroupRange(3, 9)
    assert ship(Timer(5, 1, b"k", b"n")) == Timer(5, 1, b"k", b"n")
    entry = StateEntry(1, b"k", b"\xc0", "uk", [1, 2])
    assert ship(entry) == entry


# --------------------------------------------------------------------------------------------
# state backends
# --------------------------------------------------------------------------------------------

def _use(backend: StateBackend, tmp_path: Path, tag: str) -> list[Any]:
    """Create a keyed backend, write, snapshot, restore: what an executor does with it."""
    storage = CheckpointStorage(str(tmp_path / f"ckpt-{tag}"))
    ks = KeySerializer(["bigint"])
    common: dict[str, Any] = dict(subtask_index=0, key_group_range=KeyGroupRange(0, 127), max_parallelism=128,
                  key_serializer=ks, storage=storage, time_provider=ManualTimeProvider(0))
    (tmp_path / f"local-{tag}-1").mkdir()
    (tmp_path / f"local-{tag}-2").mkdir()
    keyed = backend.create_keyed_backend(KeyedStateBackendParameters(**common, local_dir=str(tmp_path / f"local-{tag}-1")))
    try:
        d = ReducingStateDescriptor("r", operator.add, "bigint")
        state: Any = keyed.get_state(d)
        for k in range(10):
            keyed.set_current_key(k)
            state.add(k)
            state.add(1)
        handle = keyed.snapshot(1, storage.location(1, 0)).materialize()
        keyed.notify_checkpoint_complete(1)
    finally:
        keyed.close()
    restored = backend.create_keyed_backend(KeyedStateBackendParameters(**common, restore_handles=[handle],
                                            local_dir=str(tmp_path / f"local-{tag}-2")))
    try:
        state = restored.get_state(d)
        values = []
        for k in range(10):
            restored.set_current_key(k)
            values.append(state.get())
        return values
    finally:
        restored.close()


@pytest.mark.parametrize("name", backend_names())
def test_state_backend(ship, name, tmp_path):
    backend = load_backend(name)
    clone = ship(backend)
    assert type(clone) is type(backend)
    assert clone.name == backend.name == name
    assert _use(clone, tmp_path, "clone") == [k + 1 for k in range(10)]
    # still pickles after it has been used (no native handle may stick to it)
    assert _use(ship(clone), tmp_path, "again") == [k + 1 for k in range(10)]


EXECUTOR = r"""
import operator, pickle, sys
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.keygroups import KeyGroupRange
payload = pickle.loads(sys.stdin.buffer.read())
out = {}
for name, backend in payload["backends"].items():
    keyed = backend.create_keyed_backend(KeyedStateBackendParameters(
        subtask_index=1, key_group_range=KeyGroupRange.of_operator(128, 2, 1),
        max_parallelism=128, key_serializer=payload["keys"], storage=payload["storages"][name],
        time_provider=payload["clock"], local_dir=payload["local"] + "/" + name))
    state = keyed.get_state(payload["descriptor"])
    keyed.set_current_key(payload["key"])
    state.add(20)
    state.add(22)
    out[name] = (state.get(), keyed.snapshot(1, payload["locations"][name]).materialize())
    keyed.close()
sys.stdout.buffer.write(pickle.dumps(out))
"""


def test_unpickled_in_a_fresh_interpreter(tmp_path):
    """An executor has none of the driver's state: ship backends, key serializer, descriptor
    (with a lambda), storage location and clock with cloudpickle, use them, ship handles back."""
    storages = {name: CheckpointStorage(str(tmp_path / f"ckpt-{name}")) for name in backend_names()}
    ks = KeySerializer(["string"])
    key = next(f"user-{i}" for i in range(1000)
               if ks.key_group(f"user-{i}", 128) in KeyGroupRange.of_operator(128, 2, 1))
    for name in backend_names():
        (tmp_path / "local" / name).mkdir(parents=True)
    payload = cloudpickle.dumps({
        "backends": {name: load_backend(name) for name in backend_names()},
        "keys": ks,
        "storages": storages,
        "locations": {name: s.location(1, 1) for name, s in storages.items()},
        "clock": ManualTimeProvider(5),
        "descriptor": ReducingStateDescriptor("sum", lambda a, b: a + b, "bigint"),
        "key": key,
        "local": str(tmp_path / "local"),
    })
    env = dict(os.environ, PYTHONPATH=str(Path(keyedstate.__file__).parent.parent))
    done = subprocess.run([sys.executable, "-c", EXECUTOR], input=payload, env=env,
                          capture_output=True, check=False, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr.decode()
    out = pickle.loads(done.stdout)
    assert set(out) == set(backend_names())
    for name, (total, handle) in out.items():
        assert total == 42
        assert handle.backend == name and handle.subtask_index == 1
        for f in handle.files():
            storages[name].read_verified(f)
