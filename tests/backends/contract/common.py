"""The backend contract's shared machinery: the :class:`Harness` (the keyed backends of one
job, subtask ``i`` of ``p`` under a max parallelism, one :class:`CheckpointStorage` in
``tmp_path``, one :class:`ManualTimeProvider`; it runs the snapshot protocol the way the
coordinator does), the user functions the states use, and the readers every test compares:
everything real, nothing mocked.

Conventions: ``dump`` is the union of ``iter_entries`` over a set of backends, keyed by
``(key_bytes, namespace_bytes, user_key)``; the snapshot tests compare a restored ``dump`` with
the ``dump`` taken when ``snapshot()`` was called, and the semantics tests pin ``dump`` and the
state API to explicit values.
"""

from __future__ import annotations

import copy
import datetime as dt
import operator
import random
from pathlib import Path
from typing import Any, Iterable, Sequence

from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
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
