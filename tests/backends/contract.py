"""The contract every state backend passes (Flink's ``StateBackendTestBase``).

A backend opts in with a few lines (fsspec's ``tests/abstract`` pattern)::

    @pytest.fixture
    def state_backend():
        return MyStateBackend()

    class TestMyBackend(StateBackendContract):
        pass

:class:`Harness` builds the keyed backends of one job (subtask ``i`` of ``p`` under a max
parallelism, one :class:`CheckpointStorage` in ``tmp_path``, one :class:`ManualTimeProvider`)
and runs the snapshot protocol the way the coordinator does. Everything is real: real backends,
real files; nothing is mocked.

Conventions: ``dump`` is the union of ``iter_entries`` over a set of backends, keyed by
``(key_bytes, namespace_bytes, user_key)``; the snapshot tests compare a restored ``dump`` with
the ``dump`` taken when ``snapshot()`` was called, and the semantics tests pin ``dump`` and the
state API to explicit values.
"""

from __future__ import annotations

import copy
import datetime as dt
import decimal
import operator
import os
import random
import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

import pytest

from keyedstate.backends import backend_names, load_backend
from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    KeyGroupRangeError,
    MissingCheckpointFileError,
    SerializationError,
    StateNotFoundError,
    StateTypeMismatchError,
    UserFunctionError,
)
from keyedstate.keygroups import KeyGroupRange, operator_index_for_key_group
from keyedstate.keys import KeySerializer
from keyedstate.serde import serialize_namespace
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateTtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
)
from keyedstate.state.timers import TimeDomain
from keyedstate.state.ttl import ManualTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata, KeyedStateHandle
from keyedstate.storage.location import CheckpointStorageLocation

EVENT = TimeDomain.EVENT_TIME
PROC = TimeDomain.PROCESSING_TIME
T0 = 1_000_000  # the harness clock's start (ms)

# --------------------------------------------------------------------------------------------
# user functions (module level: they pickle by reference)
# --------------------------------------------------------------------------------------------


class Average:
    """An AggregateFunction whose accumulator is a ``struct<sum:double,count:bigint>``."""

    def create_accumulator(self) -> dict[str, Any]:
        return {"sum": 0.0, "count": 0}

    def add(self, value: float, acc: dict[str, Any]) -> dict[str, Any]:
        return {"sum": acc["sum"] + value, "count": acc["count"] + 1}

    def get_result(self, acc: dict[str, Any]) -> float:
        return acc["sum"] / acc["count"]


class Boom(Exception):
    pass


class FailingAggregate(Average):
    """Raises from the method named ``where``."""

    def __init__(self, where: str) -> None:
        self.where = where

    def create_accumulator(self) -> dict[str, Any]:
        if self.where == "create_accumulator":
            raise Boom("create_accumulator failed")
        return super().create_accumulator()

    def add(self, value: float, acc: dict[str, Any]) -> dict[str, Any]:
        if self.where == "add":
            raise Boom("add failed")
        return super().add(value, acc)

    def get_result(self, acc: dict[str, Any]) -> float:
        if self.where == "get_result":
            raise Boom("get_result failed")
        return super().get_result(acc)


class WrongAccumulator(Average):
    """Returns an accumulator that is not a ``struct<sum:double,count:bigint>``."""

    def add(self, value: float, acc: dict[str, Any]) -> dict[str, Any]:
        return {"sum": str(value), "count": 1}


def failing_reduce(a: int, b: int) -> int:
    raise Boom("reduce failed")


class Point:
    """An arbitrary user object for untyped (pickled) state."""

    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    def __hash__(self) -> int:
        return hash((self.x, self.y))

    def __repr__(self) -> str:
        return f"Point({self.x}, {self.y})"


def all_kinds() -> dict[str, StateDescriptor]:
    """One descriptor per state kind, typed and untyped."""
    return {
        "value": ValueStateDescriptor("value", "bigint"),
        "pickled": ValueStateDescriptor("pickled"),
        "list": ListStateDescriptor("list", "string"),
        "map": MapStateDescriptor("map", "string", "struct<a:int,b:array<string>>"),
        "pmap": MapStateDescriptor("pmap"),
        "reducing": ReducingStateDescriptor("reducing", operator.add, "bigint"),
        "aggregating": AggregatingStateDescriptor(
            "aggregating", Average(), "struct<sum:double,count:bigint>"),
    }


ALL_NAMES = sorted(all_kinds())
NAMESPACES: list[Any] = [None, "w1", 7, ("win", 1000, 2000)]

# --------------------------------------------------------------------------------------------
# the harness
# --------------------------------------------------------------------------------------------


class Harness:
    """Keyed backends of one job, one checkpoint storage, one manual clock; runs the snapshot
    protocol as the coordinator does and closes every backend it made."""

    def __init__(self, state_backend: StateBackend, tmp_path: Path,
                 key_types: Sequence[Any] = ("bigint",), max_parallelism: int = 128) -> None:
        self.state_backend = state_backend
        self.tmp_path = Path(tmp_path)
        self.storage = CheckpointStorage(str(self.tmp_path / "checkpoints"))
        self.clock = ManualTimeProvider(T0)
        self.key_serializer = KeySerializer(list(key_types))
        self.max_parallelism = max_parallelism
        self.backends: list[KeyedStateBackend] = []
        self.locations: dict[tuple[int, int], CheckpointStorageLocation] = {}
        self._last_id = 0

    # -- backends -------------------------------------------------------------------------------

    def create(self, index: int = 0, parallelism: int = 1, *,
               max_parallelism: int | None = None,
               handles: Sequence[KeyedStateHandle] = (),
               share_restored_files: bool = True,
               time_provider: Any = None,
               state_backend: StateBackend | None = None,
               key_group_range: KeyGroupRange | None = None) -> KeyedStateBackend:
        """Subtask ``index`` of ``parallelism``, restored from ``handles`` when given."""
        max_p = max_parallelism or self.max_parallelism
        rng = key_group_range or KeyGroupRange.of_operator(max_p, parallelism, index)
        local_dir = self.tmp_path / "local" / f"b{len(self.backends)}-sub{index}"
        local_dir.mkdir(parents=True, exist_ok=True)  # a failed create() reuses its name
        backend = (state_backend or self.state_backend).create_keyed_backend(KeyedStateBackendParameters(
            subtask_index=index,
            key_group_range=rng,
            max_parallelism=max_p,
            key_serializer=self.key_serializer,
            restore_handles=list(handles),
            storage=self.storage,
            share_restored_files=share_restored_files,
            time_provider=time_provider or self.clock,
            local_dir=str(local_dir),
        ))
        self.backends.append(backend)
        return backend

    def create_all(self, parallelism: int, **kwargs: Any) -> list[KeyedStateBackend]:
        return [self.create(i, parallelism, **kwargs) for i in range(parallelism)]

    def owner(self, backends: Sequence[KeyedStateBackend], key: Any) -> KeyedStateBackend:
        """The backend whose key-group range holds ``key`` (Flink's routing)."""
        max_p = backends[0].max_parallelism
        kg = self.key_serializer.key_group(key, max_p)
        backend = backends[operator_index_for_key_group(max_p, len(backends), kg)]
        assert kg in backend.key_group_range
        return backend

    def at(self, backends: Sequence[KeyedStateBackend], key: Any) -> KeyedStateBackend:
        """The owner of ``key`` with ``key`` made current."""
        backend = self.owner(backends, key)
        backend.set_current_key(key)
        return backend

    def close_all(self) -> None:
        for backend in self.backends:
            backend.close()

    # -- snapshots ------------------------------------------------------------------------------

    def next_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def location(self, checkpoint_id: int, backend: KeyedStateBackend) -> CheckpointStorageLocation:
        loc = self.storage.location(checkpoint_id, backend.subtask_index)
        self.locations[(checkpoint_id, backend.subtask_index)] = loc
        return loc

    def snapshot(self, backend: KeyedStateBackend, checkpoint_id: int | None = None, *,
                 full: bool = False, confirm: bool = True) -> KeyedStateHandle:
        """Synchronous part, materialize, and (``confirm``) notify_checkpoint_complete."""
        cid = checkpoint_id if checkpoint_id is not None else self.next_id()
        result = backend.snapshot(cid, self.location(cid, backend), full=full)
        assert result.checkpoint_id == cid
        handle = result.materialize()
        if confirm:
            backend.notify_checkpoint_complete(cid)
        return handle

    def snapshot_all(self, backends: Sequence[KeyedStateBackend], *, full: bool = False,
                     confirm: bool = True) -> list[KeyedStateHandle]:
        """One checkpoint of every subtask; the handles go through ``_metadata`` and back, as a
        restore reads them."""
        cid = self.next_id()
        handles = [self.snapshot(b, cid, full=full, confirm=False) for b in backends]
        metadata = CheckpointMetadata(
            checkpoint_id=cid, timestamp_ms=self.clock.now_ms(),
            backend=backends[0].name, parallelism=len(backends),
            max_parallelism=backends[0].max_parallelism,
            key_types=self.key_serializer.type_strings, handles=handles)
        relative = self.storage.write_metadata(metadata)
        if confirm:
            for b in backends:
                b.notify_checkpoint_complete(cid)
        read_back = self.storage.read_metadata(relative).handles
        assert read_back == handles
        return read_back

    def written_by(self, checkpoint_id: int) -> set[str]:
        """Files the locations of ``checkpoint_id`` wrote."""
        return {p for (cid, _), loc in self.locations.items() if cid == checkpoint_id
                for p in loc.written}

    def delete_all_but(self, handles: Iterable[KeyedStateHandle]) -> set[str]:
        """Delete every snapshot file not referenced by ``handles`` (what the shared-state
        registry does once older checkpoints are subsumed); returns what was deleted."""
        keep = {f.path for h in handles for f in h.files()}
        doomed = {p for p in self.storage.list_files()
                  if p not in keep and not p.endswith("/_metadata")}
        self.storage.delete(doomed)
        return doomed


# --------------------------------------------------------------------------------------------
# reading everything back
# --------------------------------------------------------------------------------------------

Ident = tuple[bytes, bytes, Any]


def dump(harness: Harness, backends: Sequence[KeyedStateBackend],
         names: Iterable[str] = ALL_NAMES) -> dict[str, dict[Ident, Any]]:
    """Union of ``iter_entries`` per state, checking what every entry must satisfy."""
    out: dict[str, dict[Ident, Any]] = {}
    ks = harness.key_serializer
    for name in names:
        entries: dict[Ident, Any] = {}
        for backend in backends:
            last_kg = -1
            for entry in backend.iter_entries(name):
                assert entry.key_group >= last_kg, f"{name}: iter_entries not ordered by key group"
                last_kg = entry.key_group
                assert entry.key_group in backend.key_group_range, (
                    f"{name}: entry of key group {entry.key_group} in subtask "
                    f"{backend.subtask_index} ({backend.key_group_range})")
                key = ks.deserialize(entry.key_bytes)
                assert ks.key_group(key, backend.max_parallelism) == entry.key_group, (
                    f"{name}: entry of key {key!r} filed under the wrong key group")
                ident = (entry.key_bytes, entry.namespace_bytes, entry.user_key)
                assert ident not in entries, f"{name}: duplicate entry {ident!r}"
                # a copy: the model must not change when the backend's objects do
                entries[ident] = copy.deepcopy(entry.value)
        out[name] = entries
    return out


def dump_timers(harness: Harness,
                backends: Sequence[KeyedStateBackend]) -> set[tuple[str, int, bytes, bytes]]:
    out: set[tuple[str, int, bytes, bytes]] = set()
    ks = harness.key_serializer
    for backend in backends:
        for domain in (EVENT, PROC):
            timers = list(backend.timer_service.timers(domain))
            # The promise (InternalTimerService.timers): timestamp order, ties by key group;
            # same-timestamp timers of one key group come in an order of the backend's (RocksDB:
            # its length-prefixed key bytes), not necessarily Timer's field order.
            order = [(t.timestamp, t.key_group) for t in timers]
            assert order == sorted(order), "timers() must be in timestamp, key-group order"
            for t in timers:
                assert t.key_group in backend.key_group_range, (
                    f"timer of key group {t.key_group} in subtask {backend.subtask_index} "
                    f"({backend.key_group_range})")
                assert ks.key_group(ks.deserialize(t.key_bytes), backend.max_parallelism) == \
                    t.key_group
                ident = (str(domain), t.timestamp, t.key_bytes, t.namespace_bytes)
                assert ident not in out, f"duplicate timer {ident!r}"
                out.add(ident)
    return out


def everything(harness: Harness, backends: Sequence[KeyedStateBackend],
               names: Iterable[str] = ALL_NAMES) -> tuple[Any, Any]:
    return dump(harness, backends, names), dump_timers(harness, backends)


def ident(harness: Harness, key: Any, namespace: Any = None, user_key: Any = None) -> Ident:
    return (harness.key_serializer.serialize(key), serialize_namespace(namespace), user_key)


def register_all(backends: Sequence[KeyedStateBackend]) -> dict[str, StateDescriptor]:
    descriptors = all_kinds()
    for backend in backends:
        for d in descriptors.values():
            backend.get_state(d)
    return descriptors


def write(harness: Harness, backends: Sequence[KeyedStateBackend], keys: Iterable[Any],
          seed: int, *, timers: bool = True) -> None:
    """Random writes, clears and timers on every state kind (deterministic per seed)."""
    rnd = random.Random(seed)
    descriptors = all_kinds()
    for key in keys:
        backend = harness.at(backends, key)
        for _ in range(rnd.randint(1, 3)):
            ns = rnd.choice(NAMESPACES)
            states: dict[str, Any] = {n: backend.get_state(d) for n, d in descriptors.items()}
            for s in states.values():
                s.set_current_namespace(ns)
            op = rnd.random()
            k = key if isinstance(key, int) else len(str(key))
            if op < 0.1:
                for s in states.values():
                    s.clear()
                continue
            states["value"].update(rnd.randint(-10**12, 10**12))
            states["pickled"].update((Point(k, seed), {"set": frozenset({k})}))
            states["list"].add_all([f"{k}-{seed}-{i}" for i in range(rnd.randint(1, 3))])
            states["map"].put(f"m{rnd.randint(0, 4)}", {"a": k % 1000, "b": [str(seed)]})
            if rnd.random() < 0.3:
                states["map"].remove(f"m{rnd.randint(0, 4)}")
            states["pmap"].put((k, "t"), Point(seed, k))
            states["reducing"].add(rnd.randint(0, 100))
            states["aggregating"].add(float(rnd.randint(0, 100)))
            if timers:
                ts = T0 + rnd.randint(0, 1000)
                backend.timer_service.register_event_time_timer(ts, ns)
                backend.timer_service.register_processing_time_timer(ts + 7, ns)
                if rnd.random() < 0.2:
                    backend.timer_service.delete_event_time_timer(ts, ns)


def exercise(backend: KeyedStateBackend) -> None:
    """Read everything a restored backend holds (a lazy restore must fail here at the latest)."""
    for info in backend.state_meta_infos():
        list(backend.iter_entries(info.name))
    for domain in (EVENT, PROC):
        list(backend.timer_service.timers(domain))


def ttl(ms: int, update_type: TtlUpdateType = TtlUpdateType.ON_CREATE_AND_WRITE,
        ) -> StateTtlConfig:
    return StateTtlConfig(dt.timedelta(milliseconds=ms), update_type)


def key_outside(harness: Harness, backend: KeyedStateBackend) -> int:
    return next(k for k in range(10_000)
                if harness.key_serializer.key_group(k, backend.max_parallelism)
                not in backend.key_group_range)


def keys_inside(harness: Harness, backend: KeyedStateBackend, n: int) -> list[int]:
    keys = (k for k in range(100_000)
            if harness.key_serializer.key_group(k, backend.max_parallelism)
            in backend.key_group_range)
    return [next(keys) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# the contract
# --------------------------------------------------------------------------------------------


class StateBackendContract:
    """Subclass it and provide a ``state_backend`` fixture returning a :class:`StateBackend`."""

    @pytest.fixture
    def harness(self, state_backend: StateBackend, tmp_path: Path):
        h = Harness(state_backend, tmp_path)
        yield h
        h.close_all()

    @pytest.fixture
    def make_harness(self, state_backend: StateBackend, tmp_path: Path):
        made: list[Harness] = []

        def make(**kwargs: Any) -> Harness:
            h = Harness(state_backend, tmp_path / f"h{len(made)}", **kwargs)
            made.append(h)
            return h

        yield make
        for h in made:
            h.close_all()

    # ========================================================================================
    # value state
    # ========================================================================================

    def test_value_state_default_update_clear(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint", default=-1))
        plain = b.get_state(ValueStateDescriptor("plain", "bigint"))
        b.set_current_key(1)
        assert v.value() == -1
        assert plain.value() is None
        v.update(10)
        assert v.value() == 10
        v.update(11)
        assert v.value() == 11
        b.set_current_key(2)
        assert v.value() == -1
        v.update(20)
        b.set_current_key(1)
        assert v.value() == 11
        v.clear()
        assert v.value() == -1
        b.set_current_key(2)
        assert v.value() == 20
        assert dump(harness, [b], ["v", "plain"]) == {
            "v": {ident(harness, 2): 20}, "plain": {}}

    def test_value_state_update_none_clears(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "string", default="dflt"))
        b.set_current_key(5)
        v.update("x")
        v.update(None)
        assert v.value() == "dflt"
        assert dump(harness, [b], ["v"]) == {"v": {}}
        v.clear()  # clearing nothing is fine
        assert v.value() == "dflt"

    def test_reading_a_default_stores_nothing(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint", default=3))
        for k in range(20):
            b.set_current_key(k)
            assert v.value() == 3
        assert dump(harness, [b], ["v"]) == {"v": {}}

    # ========================================================================================
    # list state
    # ========================================================================================

    def test_list_state(self, harness):
        b = harness.create()
        lst = b.get_state(ListStateDescriptor("l", "bigint"))
        b.set_current_key(1)
        assert lst.get() == []
        lst.add(1)
        lst.add(2)
        lst.add_all([3, 4])
        lst.add_all([])
        assert lst.get() == [1, 2, 3, 4]
        b.set_current_key(2)
        assert lst.get() == []
        lst.add_all(iter([9, 8]))  # any iterable
        b.set_current_key(1)
        lst.update([7])
        assert lst.get() == [7]
        lst.update(x for x in [5, 6])
        assert lst.get() == [5, 6]
        assert dump(harness, [b], ["l"]) == {
            "l": {ident(harness, 1): [5, 6], ident(harness, 2): [9, 8]}}
        lst.update([])
        assert lst.get() == []
        b.set_current_key(2)
        lst.clear()
        assert lst.get() == []
        assert dump(harness, [b], ["l"]) == {"l": {}}

    def test_list_add_all_to_empty_stores_nothing(self, harness):
        b = harness.create()
        lst = b.get_state(ListStateDescriptor("l", "string"))
        b.set_current_key(1)
        lst.add_all([])
        lst.update([])
        assert lst.get() == []
        assert dump(harness, [b], ["l"]) == {"l": {}}

    # ========================================================================================
    # map state
    # ========================================================================================

    def test_map_state(self, harness):
        b = harness.create()
        m = b.get_state(MapStateDescriptor("m", "string", "bigint"))
        b.set_current_key(1)
        assert m.is_empty()
        assert m.get("a") is None
        assert not m.contains("a")
        assert list(m.items()) == [] and list(m.keys()) == [] and list(m.values()) == []
        m.put("a", 1)
        m.put("b", 2)
        m.put_all({"c": 3, "d": 4})
        m.put("a", 10)
        assert m.get("a") == 10
        assert m.contains("c") and not m.contains("z")
        assert not m.is_empty()
        assert dict(m.items()) == {"a": 10, "b": 2, "c": 3, "d": 4}
        assert sorted(m.keys()) == ["a", "b", "c", "d"]
        assert sorted(m.values()) == [2, 3, 4, 10]
        m.remove("b")
        m.remove("nope")  # removing a missing key is fine
        assert m.get("b") is None and not m.contains("b")
        b.set_current_key(2)
        assert m.is_empty()
        m.put("a", -1)
        assert dump(harness, [b], ["m"]) == {"m": {
            ident(harness, 1, None, "a"): 10, ident(harness, 1, None, "c"): 3,
            ident(harness, 1, None, "d"): 4, ident(harness, 2, None, "a"): -1}}
        b.set_current_key(1)
        m.clear()
        assert m.is_empty() and dict(m.items()) == {}
        b.set_current_key(2)
        assert dict(m.items()) == {"a": -1}

    def test_map_state_untyped_keys_and_values(self, harness):
        b = harness.create()
        m = b.get_state(MapStateDescriptor("m"))
        b.set_current_key(1)
        m.put((1, "x"), Point(1, 2))
        m.put(Point(3, 4), [1, {"a"}])
        m.put(None, "none-key")
        assert m.get((1, "x")) == Point(1, 2)
        assert m.get(Point(3, 4)) == [1, {"a"}]
        assert m.get(None) == "none-key"
        assert m.contains(Point(3, 4)) and not m.contains(Point(4, 3))
        assert dict(m.items()) == {(1, "x"): Point(1, 2), Point(3, 4): [1, {"a"}],
                                   None: "none-key"}

    # ========================================================================================
    # reducing and aggregating state
    # ========================================================================================

    def test_reducing_state(self, harness):
        b = harness.create()
        r = b.get_state(ReducingStateDescriptor("r", operator.add, "bigint"))
        b.set_current_key(1)
        assert r.get() is None
        r.add(1)
        assert r.get() == 1
        r.add(2)
        r.add(39)
        assert r.get() == 42
        b.set_current_key(2)
        assert r.get() is None
        r.add(5)
        assert dump(harness, [b], ["r"]) == {
            "r": {ident(harness, 1): 42, ident(harness, 2): 5}}
        r.clear()
        assert r.get() is None
        b.set_current_key(1)
        assert r.get() == 42

    def test_reducing_state_untyped(self, harness):
        b = harness.create()
        r = b.get_state(ReducingStateDescriptor("r", lambda a, c: a | c))
        b.set_current_key(1)
        r.add(frozenset({1}))
        r.add(frozenset({2}))
        assert r.get() == frozenset({1, 2})

    def test_aggregating_state(self, harness):
        b = harness.create()
        agg = b.get_state(AggregatingStateDescriptor(
            "a", Average(), "struct<sum:double,count:bigint>"))
        b.set_current_key(1)
        assert agg.get() is None
        agg.add(1.0)
        agg.add(2.0)
        agg.add(6.0)
        assert agg.get() == 3.0
        b.set_current_key(2)
        assert agg.get() is None
        agg.add(10)
        assert agg.get() == 10.0
        # iter_entries shows the accumulator
        assert dump(harness, [b], ["a"]) == {"a": {
            ident(harness, 1): {"sum": 9.0, "count": 3},
            ident(harness, 2): {"sum": 10.0, "count": 1}}}
        agg.clear()
        assert agg.get() is None
        b.set_current_key(1)
        assert agg.get() == 3.0

    def test_raising_reduce_function_is_a_user_function_error(self, harness):
        b = harness.create()
        r = b.get_state(ReducingStateDescriptor("r", failing_reduce, "bigint"))
        b.set_current_key(1)
        r.add(1)  # nothing to reduce with yet
        with pytest.raises(UserFunctionError) as info:
            r.add(2)
        assert isinstance(info.value.__cause__, Boom)
        assert r.get() == 1  # the failed add changed nothing

    @pytest.mark.parametrize("where", ["create_accumulator", "add"])
    def test_raising_aggregate_function_is_a_user_function_error(self, harness, where):
        b = harness.create()
        agg = b.get_state(AggregatingStateDescriptor(
            "a", FailingAggregate(where), "struct<sum:double,count:bigint>"))
        b.set_current_key(1)
        with pytest.raises(UserFunctionError) as info:
            agg.add(1.0)
        assert isinstance(info.value.__cause__, Boom)
        assert agg.get() is None
        assert dump(harness, [b], ["a"]) == {"a": {}}

    def test_raising_get_result_is_a_user_function_error(self, harness):
        b = harness.create()
        agg = b.get_state(AggregatingStateDescriptor(
            "a", FailingAggregate("get_result"), "struct<sum:double,count:bigint>"))
        b.set_current_key(1)
        agg.add(1.0)
        with pytest.raises(UserFunctionError):
            agg.get()

    # ========================================================================================
    # isolation: keys, namespaces, states
    # ========================================================================================

    def test_keys_are_isolated(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint"))
        lst = b.get_state(ListStateDescriptor("l", "bigint"))
        m = b.get_state(MapStateDescriptor("m", "bigint", "bigint"))
        for k in range(200):
            b.set_current_key(k)
            v.update(k * 3)
            lst.add_all([k, -k])
            m.put(k % 7, k)
        for k in reversed(range(200)):
            b.set_current_key(k)
            assert v.value() == k * 3
            assert lst.get() == [k, -k]
            assert dict(m.items()) == {k % 7: k}
        assert len(dump(harness, [b], ["v"])["v"]) == 200

    def test_namespaces_are_isolated(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint"))
        other = b.get_state(ValueStateDescriptor("other", "bigint"))
        m = b.get_state(MapStateDescriptor("m", "string", "bigint"))
        b.set_current_key(1)
        for i, ns in enumerate(NAMESPACES):
            v.set_current_namespace(ns)
            m.set_current_namespace(ns)
            v.update(i)
            m.put("x", i)
        # each state has its own current namespace
        other.update(100)
        v.set_current_namespace("w1")
        assert other.value() == 100
        other.set_current_namespace("w1")
        assert other.value() is None
        for i, ns in enumerate(NAMESPACES):
            v.set_current_namespace(ns)
            m.set_current_namespace(ns)
            assert v.value() == i
            assert dict(m.items()) == {"x": i}
        v.set_current_namespace(("win", 1000, 2000))
        v.clear()
        v.set_current_namespace(("win", 1000, 2001))
        assert v.value() is None
        v.set_current_namespace("w1")
        assert v.value() == 1
        b.set_current_key(2)
        assert v.value() is None  # namespace stays, key changed
        assert dump(harness, [b], ["v"]) == {"v": {
            ident(harness, 1, None): 0, ident(harness, 1, "w1"): 1, ident(harness, 1, 7): 2}}

    def test_same_key_in_two_states_is_isolated(self, harness):
        b = harness.create()
        a = b.get_state(ValueStateDescriptor("a", "bigint"))
        c = b.get_state(ValueStateDescriptor("c", "bigint"))
        b.set_current_key(1)
        a.update(1)
        assert c.value() is None
        c.update(2)
        a.clear()
        assert c.value() == 2
        assert dump(harness, [b], ["a", "c"]) == {"a": {}, "c": {ident(harness, 1): 2}}

    def test_string_and_composite_keys(self, make_harness):
        h = make_harness(key_types=("string", "bigint"))
        b = h.create()
        v = b.get_state(ValueStateDescriptor("v", "string"))
        keys = [("a", 1), ("a", 2), ("b", 1), (None, 1), ("a", None), ("", 0)]
        for k in keys:
            b.set_current_key(k)
            v.update(repr(k))
        for k in keys:
            b.set_current_key(k)
            assert v.value() == repr(k)
            assert b.get_current_key() == k
        assert dump(h, [b], ["v"]) == {"v": {ident(h, k): repr(k) for k in keys}}

    def test_set_current_key_bytes(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint"))
        b.set_current_key(42)
        v.update(1)
        kb = harness.key_serializer.serialize(42)
        b.set_current_key(7)
        b.set_current_key_bytes(kb, harness.key_serializer.key_group(42, 128))
        assert v.value() == 1
        assert b.get_current_key() == 42

    # ========================================================================================
    # typed and untyped values
    # ========================================================================================

    @pytest.mark.parametrize(
        ("type_", "good", "bad"),
        [
            ("bigint", 1 << 40, "1"),
            ("bigint", -5, 1.5),
            ("string", "s", b"s"),
            ("struct<a:int,b:string>", {"a": 1, "b": "x"}, {"a": "1", "b": "x"}),
            ("struct<a:int,b:string>", {"a": 1, "b": "x"}, {"a": 1, "zzz": "x"}),
            ("array<date>", [dt.date(2020, 1, 1)], [dt.datetime(2020, 1, 1)]),
            ("map<string,double>", {"x": 1.5}, {"x": "1.5"}),
            ("decimal(10,2)", decimal.Decimal("3.14"), 3.14),
            ("timestamp", dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc), dt.date(2024, 1, 1)),
        ],
    )
    def test_typed_value_state_rejects_wrong_values(self, harness, type_, good, bad):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", type_))
        b.set_current_key(1)
        v.update(good)
        with pytest.raises(SerializationError):
            v.update(bad)
        assert v.value() == good

    def test_pyarrow_typed_states(self, harness):
        import pyarrow as pa

        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", pa.int16()))
        lst = b.get_state(ListStateDescriptor("l", pa.struct([("x", pa.float64())])))
        b.set_current_key(1)
        v.update(300)
        with pytest.raises(SerializationError):
            v.update(1 << 20)
        lst.add({"x": 1.0})
        with pytest.raises(SerializationError):
            lst.add({"x": "no"})
        assert v.value() == 300
        assert lst.get() == [{"x": 1.0}]

    def test_typed_list_map_reducing_reject_wrong_values(self, harness):
        b = harness.create()
        lst = b.get_state(ListStateDescriptor("l", "string"))
        m = b.get_state(MapStateDescriptor("m", "string", "bigint"))
        r = b.get_state(ReducingStateDescriptor("r", operator.add, "bigint"))
        bad = b.get_state(AggregatingStateDescriptor(
            "a", WrongAccumulator(), "struct<sum:double,count:bigint>"))
        b.set_current_key(1)
        lst.add("ok")
        with pytest.raises(SerializationError):
            lst.add(1)
        with pytest.raises(SerializationError):
            lst.add_all([2])
        with pytest.raises(SerializationError):
            lst.update([3])
        assert lst.get() == ["ok"]
        m.put("a", 1)
        with pytest.raises(SerializationError):
            m.put(1, 1)  # bad map key
        with pytest.raises(SerializationError):
            m.put("b", "1")  # bad value
        with pytest.raises(SerializationError):
            m.put_all({"c": "x"})
        assert dict(m.items()) == {"a": 1}
        r.add(1)
        with pytest.raises(SerializationError):
            r.add("x")
        assert r.get() == 1
        with pytest.raises(SerializationError):
            bad.add(1.0)  # the accumulator it returns doesn't fit the declared type
        assert bad.get() is None

    def test_keys_of_the_wrong_type_are_refused(self, harness):
        b = harness.create()
        with pytest.raises(SerializationError):
            b.set_current_key("not a bigint")

    def test_untyped_values_are_pickled(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v"))
        lst = b.get_state(ListStateDescriptor("l"))
        values = [Point(1, 2), {"a": [1, (2, 3)], "s": {4}}, 10 ** 30, None, "s"]
        b.set_current_key(1)
        v.update({"p": Point(5, 6)})
        lst.add_all(values)
        lst.add(Point(0, 0))
        assert v.value() == {"p": Point(5, 6)}
        assert lst.get() == [*values, Point(0, 0)]

    def test_unpicklable_untyped_value_is_a_serialization_error(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v"))
        b.set_current_key(1)
        with pytest.raises(SerializationError):
            v.update(threading.Lock())
        assert v.value() is None

    # ========================================================================================
    # registration
    # ========================================================================================

    def test_get_state_twice_returns_the_same_state(self, harness):
        b = harness.create()
        for d in all_kinds().values():
            first = b.get_state(d)
            assert b.get_state(d) is first
        again = all_kinds()  # equal descriptors, new objects
        for name, d in again.items():
            assert b.get_state(d) is b.get_state(all_kinds()[name])

    @pytest.mark.parametrize(
        "other",
        [
            ListStateDescriptor("v", "bigint"),
            MapStateDescriptor("v", "bigint", "bigint"),
            ReducingStateDescriptor("v", operator.add, "bigint"),
            AggregatingStateDescriptor("v", Average(), "bigint"),
            ValueStateDescriptor("v", "string"),
            ValueStateDescriptor("v", "int"),
            ValueStateDescriptor("v"),
        ],
        ids=["list", "map", "reducing", "aggregating", "string", "int", "pickled"],
    )
    def test_same_name_other_kind_or_type_is_refused(self, harness, other):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint"))
        b.set_current_key(1)
        v.update(3)
        with pytest.raises(StateTypeMismatchError):
            b.get_state(other)
        assert b.get_state(ValueStateDescriptor("v", "bigint")).value() == 3

    def test_map_key_type_mismatch_is_refused(self, harness):
        b = harness.create()
        b.get_state(MapStateDescriptor("m", "string", "bigint"))
        with pytest.raises(StateTypeMismatchError):
            b.get_state(MapStateDescriptor("m", "bigint", "bigint"))
        with pytest.raises(StateTypeMismatchError):
            b.get_state(MapStateDescriptor("m", "string", "string"))

    def test_state_meta_infos(self, harness):
        b = harness.create()
        descriptors = register_all([b])
        b.set_current_key(1)
        b.timer_service.register_event_time_timer(5)
        infos = {i.name: i for i in b.state_meta_infos()}
        assert set(infos) == set(descriptors)  # internal (timer) states excluded
        assert infos["map"].kind == "map"
        assert infos["map"].user_key_type == "string"
        assert infos["value"].value_type == "int64"
        assert infos["pickled"].value_type == "pickle"

    def test_unknown_state_is_not_found(self, harness):
        b = harness.create()
        b.get_state(ValueStateDescriptor("v", "bigint"))
        with pytest.raises(StateNotFoundError):
            list(b.iter_entries("nope"))

    # ========================================================================================
    # key groups
    # ========================================================================================

    def test_keys_outside_the_key_group_range_are_refused(self, harness):
        b = harness.create(1, 3)
        outside = key_outside(harness, b)
        inside = keys_inside(harness, b, 1)[0]
        v = b.get_state(ValueStateDescriptor("v", "bigint"))
        b.set_current_key(inside)
        v.update(1)
        with pytest.raises(KeyGroupRangeError):
            b.set_current_key(outside)
        with pytest.raises(KeyGroupRangeError):
            b.set_current_key(inside, key_group=b.key_group_range.end + 1)
        with pytest.raises(KeyGroupRangeError):
            b.set_current_key_bytes(harness.key_serializer.serialize(outside),
                                    harness.key_serializer.key_group(outside, 128))
        b.set_current_key(inside, key_group=harness.key_serializer.key_group(inside, 128))
        assert v.value() == 1
        assert all(e.key_group in b.key_group_range for e in b.iter_entries("v"))

    def test_key_group_range_must_fit_max_parallelism(self, harness):
        with pytest.raises(ConfigurationError):
            harness.create(max_parallelism=8, key_group_range=KeyGroupRange(0, 8))

    # ========================================================================================
    # TTL
    # ========================================================================================

    def test_ttl_value_on_create_and_write(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint", default=-1, ttl=ttl(100)))
        clock = harness.clock
        b.set_current_key(1)
        v.update(1)
        clock.advance(60)
        assert v.value() == 1  # a read does not refresh under OnCreateAndWrite
        clock.advance(39)
        assert v.value() == 1
        clock.advance(1)
        assert v.value() == -1  # last access + ttl <= now: expired
        assert dump(harness, [b], ["v"]) == {"v": {}}
        v.update(2)
        clock.advance(60)
        v.update(3)  # a write refreshes
        clock.advance(60)
        assert v.value() == 3
        assert dump(harness, [b], ["v"]) == {"v": {ident(harness, 1): 3}}

    def test_ttl_value_on_read_and_write(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor(
            "v", "bigint", ttl=ttl(100, TtlUpdateType.ON_READ_AND_WRITE)))
        clock = harness.clock
        b.set_current_key(1)
        v.update(1)
        clock.advance(60)
        assert v.value() == 1  # refreshed at +60
        clock.advance(99)
        assert v.value() == 1  # +159 < +160; refreshed at +159
        clock.advance(99)
        assert v.value() == 1  # +258; refreshed
        clock.advance(100)
        assert v.value() is None
        assert dump(harness, [b], ["v"]) == {"v": {}}

    def test_ttl_list_elements_expire_one_by_one(self, harness):
        b = harness.create()
        lst = b.get_state(ListStateDescriptor("l", "string", ttl=ttl(100)))
        clock = harness.clock
        b.set_current_key(1)
        lst.add("a")
        clock.advance(50)
        lst.add_all(["b", "c"])
        clock.advance(49)
        assert lst.get() == ["a", "b", "c"]
        clock.advance(1)
        assert lst.get() == ["b", "c"]
        assert dump(harness, [b], ["l"]) == {"l": {ident(harness, 1): ["b", "c"]}}
        lst.add("d")
        clock.advance(50)
        assert lst.get() == ["d"]
        clock.advance(50)
        assert lst.get() == []
        assert dump(harness, [b], ["l"]) == {"l": {}}

    def test_ttl_map_entries_expire_one_by_one(self, harness):
        b = harness.create()
        m = b.get_state(MapStateDescriptor("m", "string", "bigint", ttl=ttl(100)))
        clock = harness.clock
        b.set_current_key(1)
        m.put("a", 1)
        clock.advance(50)
        m.put_all({"b": 2, "c": 3})
        clock.advance(50)
        assert m.get("a") is None
        assert not m.contains("a")
        assert m.get("b") == 2
        assert dict(m.items()) == {"b": 2, "c": 3}
        assert sorted(m.keys()) == ["b", "c"]
        assert sorted(m.values()) == [2, 3]
        assert not m.is_empty()
        assert dump(harness, [b], ["m"]) == {"m": {
            ident(harness, 1, None, "b"): 2, ident(harness, 1, None, "c"): 3}}
        clock.advance(50)
        assert m.is_empty()
        assert dict(m.items()) == {}
        assert dump(harness, [b], ["m"]) == {"m": {}}

    def test_ttl_map_on_read_and_write_refreshes_the_read_entry(self, harness):
        b = harness.create()
        m = b.get_state(MapStateDescriptor(
            "m", "string", "bigint", ttl=ttl(100, TtlUpdateType.ON_READ_AND_WRITE)))
        b.set_current_key(1)
        m.put_all({"a": 1, "b": 2})
        harness.clock.advance(60)
        assert m.get("a") == 1
        harness.clock.advance(60)
        assert m.get("a") == 1
        assert m.get("b") is None

    def test_ttl_reducing_and_aggregating_start_over_after_expiry(self, harness):
        b = harness.create()
        r = b.get_state(ReducingStateDescriptor("r", operator.add, "bigint", ttl=ttl(100)))
        agg = b.get_state(AggregatingStateDescriptor(
            "a", Average(), "struct<sum:double,count:bigint>", ttl=ttl(100)))
        b.set_current_key(1)
        r.add(1)
        agg.add(1.0)
        harness.clock.advance(100)
        assert r.get() is None
        assert agg.get() is None
        r.add(5)
        agg.add(5.0)
        assert r.get() == 5  # the expired 1 is not reduced in
        assert agg.get() == 5.0
        assert dump(harness, [b], ["a"]) == {"a": {ident(harness, 1): {"sum": 5.0, "count": 1}}}

    def test_ttl_expired_entries_are_not_in_a_full_snapshot(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint", ttl=ttl(100)))
        lst = b.get_state(ListStateDescriptor("l", "bigint", ttl=ttl(100)))
        m = b.get_state(MapStateDescriptor("m", "bigint", "bigint", ttl=ttl(100)))
        for k in range(40):  # old entries, written at T0
            b.set_current_key(k)
            v.update(k)
            lst.add(k)
            m.put(k, k)
        harness.clock.advance(60)
        for k in range(20, 60):  # fresh entries, written at T0 + 60
            b.set_current_key(k)
            v.update(-k)
            lst.add(-k)
            m.put(-k, -k)
        harness.clock.advance(40)  # T0 + 100: everything written at T0 expired
        live = dump(harness, [b], ["v", "l", "m"])
        assert len(live["v"]) == 40 and len(live["l"]) == 40 and len(live["m"]) == 40
        handle = harness.snapshot(b, full=True)
        # Restore with the clock back at T0 + 50: expired entries, had they been written, would
        # be alive again (timestamps survive a restore); they must simply not be there.
        restored = harness.create(handles=[handle], time_provider=ManualTimeProvider(T0 + 50))
        assert dump(harness, [restored], ["v", "l", "m"]) == live

    def test_ttl_restored_entries_keep_their_timestamps(self, harness):
        b = harness.create()
        d = ValueStateDescriptor("v", "bigint", ttl=ttl(100))
        v = b.get_state(d)
        b.set_current_key(1)
        v.update(1)
        harness.clock.advance(60)
        handle = harness.snapshot(b)
        restored = harness.create(handles=[handle])
        rv = restored.get_state(d)
        restored.set_current_key(1)
        assert rv.value() == 1
        harness.clock.advance(39)
        assert rv.value() == 1
        harness.clock.advance(1)  # T0 + 100: expired, as it would have without the restore
        assert rv.value() is None
        assert dump(harness, [restored], ["v"]) == {"v": {}}

    def test_ttl_duration_may_change_on_restore(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint", ttl=ttl(100)))
        b.set_current_key(1)
        v.update(1)
        handle = harness.snapshot(b)
        restored = harness.create(handles=[handle])
        rv = restored.get_state(ValueStateDescriptor("v", "bigint", ttl=ttl(1000)))
        restored.set_current_key(1)
        harness.clock.advance(500)
        assert rv.value() == 1
        harness.clock.advance(500)
        assert rv.value() is None

    def test_ttl_can_be_switched_on_or_off_on_restore(self, harness):
        """Switched on, restored values live ``ttl`` from the restore; switched off, they stay
        (docs/schema-evolution.md). A registered state keeps its TTL setting."""
        b = harness.create()
        b.set_current_key(1)
        b.get_state(ValueStateDescriptor("plain", "bigint")).update(1)
        b.get_state(ValueStateDescriptor("expiring", "bigint", ttl=ttl(100))).update(2)
        handle = harness.snapshot(b)
        harness.clock.advance(50)
        restored = harness.create(handles=[handle])
        restored.set_current_key(1)
        now_expiring = restored.get_state(ValueStateDescriptor("plain", "bigint", ttl=ttl(100)))
        never_expiring = restored.get_state(ValueStateDescriptor("expiring", "bigint"))
        assert (now_expiring.value(), never_expiring.value()) == (1, 2)
        harness.clock.advance(99)
        assert (now_expiring.value(), never_expiring.value()) == (1, 2)
        harness.clock.advance(1)
        assert (now_expiring.value(), never_expiring.value()) == (None, 2)
        with pytest.raises(StateTypeMismatchError):
            restored.get_state(ValueStateDescriptor("plain", "bigint"))

    # ========================================================================================
    # timers
    # ========================================================================================

    def test_timer_registration_is_deduplicated(self, harness):
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        ts.register_event_time_timer(10)
        ts.register_event_time_timer(10)
        ts.register_event_time_timer(10, "w")
        ts.register_event_time_timer(11)
        b.set_current_key(2)
        ts.register_event_time_timer(10)
        timers = list(ts.timers(EVENT))
        assert [t.timestamp for t in timers] == [10, 10, 10, 11]
        kb1 = harness.key_serializer.serialize(1)
        assert {(t.timestamp, t.key_bytes, t.namespace_bytes) for t in timers} == {
            (10, kb1, serialize_namespace(None)), (10, kb1, serialize_namespace("w")),
            (11, kb1, serialize_namespace(None)),
            (10, harness.key_serializer.serialize(2), serialize_namespace(None))}
        for t in timers:
            assert t.key_group == harness.key_serializer.key_group(
                harness.key_serializer.deserialize(t.key_bytes), 128)
        assert ts.next_timestamp(EVENT) == 10
        assert ts.next_timestamp(PROC) is None

    def test_timer_delete(self, harness):
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        ts.register_event_time_timer(10)
        ts.register_event_time_timer(10, "w")
        ts.register_processing_time_timer(10)
        ts.delete_event_time_timer(10)
        ts.delete_event_time_timer(99)  # deleting a missing timer is fine
        b.set_current_key(2)
        ts.delete_event_time_timer(10, "w")  # other key: nothing to delete
        assert [(t.timestamp, t.namespace_bytes) for t in ts.timers(EVENT)] == [
            (10, serialize_namespace("w"))]
        assert len(list(ts.timers(PROC))) == 1  # domains are separate
        b.set_current_key(1)
        ts.delete_processing_time_timer(10)
        assert list(ts.timers(PROC)) == []

    def test_pop_due_in_timestamp_order_across_keys_and_key_groups(self, harness):
        b = harness.create()
        ts = b.timer_service
        rnd = random.Random(7)
        expected = set()
        for k in range(300):
            b.set_current_key(k)
            for _ in range(2):
                t = rnd.randint(0, 1000)
                ns = rnd.choice(NAMESPACES)
                ts.register_event_time_timer(t, ns)
                expected.add((t, harness.key_serializer.serialize(k), serialize_namespace(ns)))
        assert len({harness.key_serializer.key_group(k, 128) for k in range(300)}) > 100
        popped = list(ts.pop_due(EVENT, 500))
        assert [t.timestamp for t in popped] == sorted(t.timestamp for t in popped)
        assert popped == sorted(popped)
        assert {(t.timestamp, t.key_bytes, t.namespace_bytes) for t in popped} == {
            e for e in expected if e[0] <= 500}
        rest = list(ts.timers(EVENT))
        assert {(t.timestamp, t.key_bytes, t.namespace_bytes) for t in rest} == {
            e for e in expected if e[0] > 500}
        assert ts.next_timestamp(EVENT) == min(e[0] for e in expected if e[0] > 500)
        assert list(ts.pop_due(EVENT, 500)) == []
        assert list(ts.pop_due(PROC, 10_000)) == []  # the other domain is untouched
        assert len(list(ts.pop_due(EVENT, 10_000))) == len(rest)
        assert list(ts.timers(EVENT)) == []

    def test_pop_due_removes_each_timer_before_yielding_it(self, harness):
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        ts.register_event_time_timer(5)
        ts.register_event_time_timer(6)
        it = ts.pop_due(EVENT, 10)
        first = next(it)
        assert first.timestamp == 5
        assert [t.timestamp for t in ts.timers(EVENT)] == [6]
        assert [t.timestamp for t in it] == [6]

    def test_timers_registered_while_popping_fire_when_due(self, harness):
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        ts.register_event_time_timer(5)
        fired = []
        for timer in ts.pop_due(EVENT, 10):
            fired.append(timer.timestamp)
            b.set_current_key_bytes(timer.key_bytes, timer.key_group)
            if timer.timestamp == 5:
                ts.register_event_time_timer(8)  # due: fires in this pass
                ts.register_event_time_timer(20)  # not due
                b.set_current_key(2)
                ts.register_processing_time_timer(6)  # other domain: not in this pass
        assert fired == [5, 8]
        assert [t.timestamp for t in ts.timers(EVENT)] == [20]
        assert [t.timestamp for t in ts.timers(PROC)] == [6]

    def test_timers_registered_below_fired_ones_still_fire(self, harness):
        # RocksDB reads a key group's head from its last fired timer (not through the
        # tombstones of the fired ones); a timer registered below that point must lower it.
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        for t in range(100, 200):
            ts.register_event_time_timer(t)
        assert [t.timestamp for t in ts.pop_due(EVENT, 149)] == list(range(100, 150))
        ts.register_event_time_timer(120)  # below every fired timer
        ts.register_event_time_timer(149)  # the last fired one, again
        ts.register_event_time_timer(5, "w")  # long past, another namespace
        assert ts.next_timestamp(EVENT) == 5
        assert [t.timestamp for t in ts.timers(EVENT)][:4] == [5, 120, 149, 150]
        assert [t.timestamp for t in ts.pop_due(EVENT, 160)] == [5, 120, 149,
                                                                  *range(150, 161)]
        ts.delete_event_time_timer(161)  # the head, deleted: the next one is the head
        assert ts.next_timestamp(EVENT) == 162
        fired = []
        for timer in ts.pop_due(EVENT, 170):
            fired.append(timer.timestamp)
            if timer.timestamp == 165:  # while popping, below the timer just fired
                b.set_current_key(1)
                ts.register_event_time_timer(163)
        assert fired == [162, 163, 164, 165, 163, *range(166, 171)]
        assert [t.timestamp for t in ts.pop_due(EVENT, 1000)] == list(range(171, 200))
        assert ts.next_timestamp(EVENT) is None
        ts.register_event_time_timer(7)
        assert [t.timestamp for t in ts.pop_due(EVENT, 7)] == [7]

    def test_processing_and_event_time_are_separate(self, harness):
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        ts.register_event_time_timer(10)
        ts.register_processing_time_timer(10)
        ts.register_processing_time_timer(30)
        assert [t.timestamp for t in ts.pop_due(PROC, 20)] == [10]
        assert [t.timestamp for t in ts.timers(EVENT)] == [10]
        assert [t.timestamp for t in ts.pop_due(EVENT, 20)] == [10]
        assert [t.timestamp for t in ts.timers(PROC)] == [30]

    def test_timers_survive_snapshot_and_restore(self, harness):
        b = harness.create()
        for k in range(50):
            b.set_current_key(k)
            b.timer_service.register_event_time_timer(100 + k, "w" if k % 2 else None)
            b.timer_service.register_processing_time_timer(200 + k)
        b.set_current_key(0)
        b.timer_service.delete_processing_time_timer(200)
        expected = dump_timers(harness, [b])
        assert len(expected) == 99
        handle = harness.snapshot(b)
        restored = harness.create(handles=[handle])
        assert dump_timers(harness, [restored]) == expected
        popped = list(restored.timer_service.pop_due(EVENT, 124))
        assert [t.timestamp for t in popped] == list(range(100, 125))

    # ========================================================================================
    # snapshot / restore
    # ========================================================================================

    def test_roundtrip_of_every_state_kind(self, harness, state_backend):
        b = harness.create()
        descriptors = register_all([b])
        b.get_state(ValueStateDescriptor("registered_but_empty", "bigint"))
        write(harness, [b], range(60), seed=1)
        expected = everything(harness, [b])
        assert all(expected[0][n] for n in ALL_NAMES) and expected[1]
        infos = sorted(b.state_meta_infos(), key=lambda i: i.name)
        [handle] = harness.snapshot_all([b])
        assert handle.backend == state_backend.name == b.name
        assert handle.subtask_index == 0
        assert handle.key_group_range == b.key_group_range
        assert handle.checkpoint_id == 1
        assert sorted(handle.states, key=lambda i: i.name) == infos
        for f in handle.files():
            harness.storage.read_verified(f)  # present, right size and checksum
        assert handle.full_size == sum(f.size for f in handle.files())
        restored = harness.create(handles=[handle])
        # restored states are readable before anyone registers them
        assert sorted(restored.state_meta_infos(), key=lambda i: i.name) == infos
        assert everything(harness, [restored]) == expected
        assert list(restored.iter_entries("registered_but_empty")) == []
        # ... and through the state API
        states = {n: restored.get_state(d) for n, d in descriptors.items()}
        original = {n: b.get_state(d) for n, d in descriptors.items()}
        for k in range(60):
            b.set_current_key(k)
            restored.set_current_key(k)
            for ns in NAMESPACES:
                for n in ALL_NAMES:
                    states[n].set_current_namespace(ns)
                    original[n].set_current_namespace(ns)
                assert states["value"].value() == original["value"].value()
                assert states["pickled"].value() == original["pickled"].value()
                assert states["list"].get() == original["list"].get()
                assert dict(states["map"].items()) == dict(original["map"].items())
                assert dict(states["pmap"].items()) == dict(original["pmap"].items())
                assert states["reducing"].get() == original["reducing"].get()
                assert states["aggregating"].get() == original["aggregating"].get()

    def test_restored_state_keeps_working(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(30), seed=1)
        restored = harness.create(handles=[harness.snapshot(b)])
        register_all([restored])
        write(harness, [b], range(20, 50), seed=2)
        write(harness, [restored], range(20, 50), seed=2)
        assert everything(harness, [restored]) == everything(harness, [b])
        # and it snapshots again
        again = harness.create(handles=[harness.snapshot(restored)])
        assert everything(harness, [again]) == everything(harness, [b])

    def test_empty_backend_roundtrip(self, harness):
        b = harness.create()
        restored = harness.create(handles=[harness.snapshot(b)])
        assert restored.state_meta_infos() == []
        assert dump_timers(harness, [restored]) == set()
        with pytest.raises(StateNotFoundError):
            list(restored.iter_entries("value"))

    def test_snapshot_reflects_the_state_as_of_the_snapshot_call(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(80), seed=1)
        expected = everything(harness, [b])
        cid = harness.next_id()
        result = b.snapshot(cid, harness.location(cid, b))
        # processing goes on before the asynchronous part runs
        write(harness, [b], range(40, 120), seed=2)
        v = b.get_state(all_kinds()["value"])
        for k in range(0, 40, 3):
            b.set_current_key(k)
            v.clear()
        after = everything(harness, [b])
        assert after != expected
        handle = result.materialize()
        b.notify_checkpoint_complete(cid)
        restored = harness.create(handles=[handle])
        assert everything(harness, [restored]) == expected
        assert everything(harness, [b]) == after
        # the next snapshot has the later changes
        assert everything(harness, [harness.create(handles=[harness.snapshot(b)])]) == after

    def test_snapshot_is_unaffected_by_mutating_a_stored_object(self, harness):
        # "materialize reflects the state exactly as of the snapshot call": also when user code
        # mutates, after snapshot(), an object it handed to update() / add() / put() earlier.
        b = harness.create()
        typed = b.get_state(ValueStateDescriptor("typed", "array<bigint>"))
        untyped = b.get_state(ValueStateDescriptor("untyped"))
        lst = b.get_state(ListStateDescriptor("list"))
        m = b.get_state(MapStateDescriptor("map", "string"))
        b.set_current_key(1)
        arr, obj, elem, val = [1], {"n": 1}, {"e": 1}, {"v": 1}
        typed.update(arr)
        untyped.update(obj)
        lst.add(elem)
        m.put("k", val)
        kb = ident(harness, 1)
        expected = {"typed": {kb: [1]}, "untyped": {kb: {"n": 1}}, "list": {kb: [{"e": 1}]},
                    "map": {(*kb[:2], "k"): {"v": 1}}}
        cid = harness.next_id()
        result = b.snapshot(cid, harness.location(cid, b))
        arr.append(2)
        obj["n"] = 2
        elem["e"] = 2
        val["v"] = 2
        handle = result.materialize()
        b.notify_checkpoint_complete(cid)
        restored = harness.create(handles=[handle])
        assert dump(harness, [restored], ["typed", "untyped", "list", "map"]) == expected

    def test_materialize_on_another_thread_while_processing(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(100), seed=1)
        expected = everything(harness, [b])
        cid = harness.next_id()
        result = b.snapshot(cid, harness.location(cid, b))
        box: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: box.update(handle=result.materialize()))
        worker.start()
        write(harness, [b], range(50, 150), seed=2, timers=False)
        worker.join()
        b.notify_checkpoint_complete(cid)
        assert everything(harness, [harness.create(handles=[box["handle"]])]) == expected

    def test_several_incremental_checkpoints_then_restore(self, harness):
        b = harness.create()
        register_all([b])
        history = []
        for round_ in range(5):
            write(harness, [b], range(round_ * 15, round_ * 15 + 40), seed=round_)
            history.append((harness.snapshot(b), everything(harness, [b])))
        # every retained checkpoint restores to its own content
        for handle, expected in history:
            assert everything(harness, [harness.create(handles=[handle])]) == expected

    def test_incremental_chain_survives_subsumption(self, harness):
        # After each confirmed checkpoint, the shared-state registry deletes every file the
        # latest checkpoint doesn't reference: a handle must name all the files it needs.
        b = harness.create()
        register_all([b])
        for round_ in range(4):
            write(harness, [b], range(round_ * 10, round_ * 10 + 30), seed=round_)
            handle = harness.snapshot(b)
            harness.delete_all_but([handle])
        expected = everything(harness, [b])
        assert everything(harness, [harness.create(handles=[handle])]) == expected

    def test_incremental_snapshot_writes_only_the_change(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "string"))
        rnd = random.Random(0)
        for k in range(5000):  # ~500 KB that doesn't compress much
            b.set_current_key(k)
            v.update(rnd.randbytes(50).hex())
        first = harness.snapshot(b)
        b.set_current_key(1)
        v.update("changed")
        second = harness.snapshot(b)
        assert second.incremental_size < first.full_size / 4, (
            f"the second snapshot wrote {second.incremental_size} bytes for one change over "
            f"{first.full_size} bytes of state")
        assert second.incremental_size <= second.full_size
        assert everything(harness, [harness.create(handles=[second])], ["v"]) == \
            everything(harness, [b], ["v"])

    @pytest.mark.parametrize("how", ["aborted", "discarded", "unconfirmed"])
    def test_a_failed_snapshot_never_becomes_a_base(self, harness, how):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(50), seed=1)
        first = harness.snapshot(b)
        expected_first = everything(harness, [b])
        write(harness, [b], range(30, 80), seed=2)
        cid = harness.next_id()
        result = b.snapshot(cid, harness.location(cid, b))
        if how == "discarded":
            result.discard()
            b.notify_checkpoint_aborted(cid)
        else:
            result.materialize()
            if how == "aborted":
                b.notify_checkpoint_aborted(cid)
        # the coordinator removes what the failed checkpoint wrote
        failed_files = harness.written_by(cid)
        harness.storage.delete(failed_files)
        write(harness, [b], range(60, 100), seed=3)
        third = harness.snapshot(b)
        assert not failed_files & {f.path for f in third.files()}
        assert everything(harness, [harness.create(handles=[third])]) == everything(harness, [b])
        # the confirmed checkpoint before the failed one is intact too
        assert everything(harness, [harness.create(handles=[first])]) == expected_first

    def test_full_snapshot_references_no_earlier_file(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(50), seed=1)
        first = harness.snapshot(b)
        write(harness, [b], range(5), seed=2)
        full = harness.snapshot(b, full=True)
        assert not {f.path for f in first.files()} & {f.path for f in full.files()}
        assert full.incremental_size == full.full_size
        expected = everything(harness, [b])
        harness.storage.delete(f.path for f in first.files())
        assert everything(harness, [harness.create(handles=[full])]) == expected

    def test_no_claim_restore_does_not_reference_restored_files(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(50), seed=1)
        base = harness.snapshot(b)
        restored = harness.create(handles=[base], share_restored_files=False)
        register_all([restored])
        write(harness, [restored], range(3), seed=2)
        after = harness.snapshot(restored)
        assert not {f.path for f in base.files()} & {f.path for f in after.files()}
        expected = everything(harness, [restored])
        harness.storage.delete(f.path for f in base.files())
        assert everything(harness, [harness.create(handles=[after])]) == expected

    def test_checkpoint_after_restore_with_claim(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(50), seed=1)
        base = harness.snapshot(b)
        restored = harness.create(handles=[base])
        register_all([restored])
        write(harness, [restored], range(3), seed=2)
        after = harness.snapshot(restored)
        expected = everything(harness, [restored])
        harness.delete_all_but([after])
        assert everything(harness, [harness.create(handles=[after])]) == expected

    # ========================================================================================
    # rescaling
    # ========================================================================================

    @pytest.mark.parametrize(
        ("max_parallelism", "path"),
        [
            (128, (1, 3)),
            (128, (3, 1)),
            (128, (2, 5, 2)),
            (128, (4, 3, 7)),
            (8, (2, 8, 1)),
            (8, (1, 8)),
            (8, (8, 3, 8)),
            (8, (5, 6)),
        ],
        ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else f"maxp{v}",
    )
    def test_rescaling(self, make_harness, max_parallelism, path):
        h = make_harness(max_parallelism=max_parallelism)
        backends = h.create_all(path[0])
        register_all(backends)
        write(h, backends, range(120), seed=1)
        for step, parallelism in enumerate(path[1:], start=2):
            expected = everything(h, backends)
            handles = h.snapshot_all(backends)
            backends = h.create_all(parallelism, handles=handles)
            # dump() checks each entry and timer sits in the subtask owning its key group
            assert everything(h, backends) == expected
            register_all(backends)
            write(h, backends, range(step * 20, step * 20 + 100), seed=step)

    def test_rescaled_subtask_ignores_handles_it_does_not_overlap(self, harness):
        backends = harness.create_all(4)
        register_all(backends)
        write(harness, backends, range(100), seed=1)
        handles = harness.snapshot_all(backends)
        expected = dump(harness, backends)
        # subtask 0 of 2 owns the first half: given all handles, it takes subtasks 0 and 1's
        half = harness.create(0, 2, handles=handles)
        assert dump(harness, [half]) == {
            n: {i: v for i, v in entries.items()
                if harness.key_serializer.key_group(harness.key_serializer.deserialize(i[0]),
                                                    128) in half.key_group_range}
            for n, entries in expected.items()}
        # given only its own handles, the same
        only = harness.create(0, 2, handles=handles[:2])
        assert dump(harness, [only]) == dump(harness, [half])

    def test_rescale_after_incremental_checkpoints(self, harness):
        backends = harness.create_all(2)
        register_all(backends)
        for round_ in range(3):
            write(harness, backends, range(round_ * 20, round_ * 20 + 60), seed=round_)
            handles = harness.snapshot_all(backends)
        expected = everything(harness, backends)
        harness.delete_all_but(handles)
        assert everything(harness, harness.create_all(3, handles=handles)) == expected

    # ========================================================================================
    # restore errors
    # ========================================================================================

    def test_handle_that_does_not_fit_max_parallelism_is_refused(self, harness):
        b = harness.create()  # max parallelism 128: the handle covers [0, 127]
        register_all([b])
        write(harness, [b], range(10), seed=1)
        handle = harness.snapshot(b)
        with pytest.raises(KeyGroupRangeError):
            exercise(harness.create(max_parallelism=8, handles=[handle]))

    def test_handle_of_another_backend_is_refused(self, harness, state_backend):
        other_name = next(n for n in backend_names() if n != state_backend.name)
        other = harness.create(state_backend=load_backend(other_name))
        register_all([other])
        write(harness, [other], range(10), seed=1)
        handle = harness.snapshot(other)
        assert handle.backend == other_name
        with pytest.raises(StateTypeMismatchError):
            exercise(harness.create(handles=[handle]))

    @pytest.mark.parametrize(
        "descriptor",
        [
            ValueStateDescriptor("value", "string"),
            ValueStateDescriptor("value"),
            ListStateDescriptor("value", "bigint"),
            MapStateDescriptor("map", "bigint", "struct<a:int,b:array<string>>"),
            MapStateDescriptor("map", "string", "struct<a:string,b:array<string>>"),
            ReducingStateDescriptor("reducing", operator.add, "int"),
            AggregatingStateDescriptor("aggregating", Average(), "struct<sum:double,count:int>"),
        ],
        ids=["value-type", "value-untyped", "value-kind", "map-key", "map-value", "reducing",
             "aggregating"],
    )
    def test_descriptor_that_does_not_match_the_restored_state_is_refused(
            self, harness, descriptor):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(10), seed=1)
        restored = harness.create(handles=[harness.snapshot(b)])
        with pytest.raises(StateTypeMismatchError):
            restored.get_state(descriptor)

    def test_unknown_state_after_restore_is_not_found(self, harness):
        b = harness.create()
        register_all([b])
        restored = harness.create(handles=[harness.snapshot(b)])
        with pytest.raises(StateNotFoundError):
            list(restored.iter_entries("never-registered"))

    @pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "empty"])
    def test_damaged_snapshot_files_are_refused(self, harness, damage):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(80), seed=1)
        first = harness.snapshot(b)
        write(harness, [b], range(40, 60), seed=2)
        handle = harness.snapshot(b)  # incremental: damage files of both checkpoints
        files = handle.files()
        assert files, "a snapshot with state must reference files"
        expected_error = MissingCheckpointFileError if damage == "delete" \
            else CorruptCheckpointError
        for f in files:
            path = harness.storage.path(f.path)
            original = Path(path).read_bytes()
            if damage == "delete":
                os.remove(path)
            else:
                pos = len(original) // 2
                damaged = {
                    "truncate": original[:pos],
                    "flip": original[:pos] + bytes([original[pos] ^ 0x5A]) + original[pos + 1:]
                    if original else b"",
                    "empty": b"",
                }[damage]
                if damaged == original:  # an empty file can only be damaged by growing it
                    damaged = original + b"\x00"
                Path(path).write_bytes(damaged)
            with pytest.raises(expected_error):
                exercise(harness.create(handles=[handle]))
            Path(path).write_bytes(original)
        # undamaged, it restores (the loop really put every file back)
        assert dump(harness, [harness.create(handles=[handle])]) == dump(harness, [b])
        assert first.checkpoint_id < handle.checkpoint_id

    # ========================================================================================
    # lifecycle
    # ========================================================================================

    def test_close_is_idempotent(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(10), seed=1)
        harness.snapshot(b)
        b.close()
        b.close()
        with harness.create() as c:
            c.get_state(ValueStateDescriptor("v", "bigint"))
        c.close()

    def test_backends_of_one_job_are_independent(self, harness):
        a = harness.create(0, 2)
        c = harness.create(1, 2)
        va = a.get_state(ValueStateDescriptor("v", "bigint"))
        vc = c.get_state(ValueStateDescriptor("v", "bigint"))
        ka = keys_inside(harness, a, 5)
        kc = keys_inside(harness, c, 5)
        for k in ka:
            a.set_current_key(k)
            va.update(k)
        for k in kc:
            c.set_current_key(k)
            vc.update(-k)
        assert dump(harness, [a], ["v"]) == {"v": {ident(harness, k): k for k in ka}}
        assert dump(harness, [c], ["v"]) == {"v": {ident(harness, k): -k for k in kc}}
