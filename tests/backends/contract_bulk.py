"""The bulk state calls' part of the backend contract (``get_many``, ``update_many``,
``add_many``, ``put_many``, ``clear_many``): a mixin the runners add to
:class:`~tests.backends.contract.StateBackendContract` (it uses its ``harness`` and
``make_harness`` fixtures).

The rule under test: a bulk call over some keys has exactly the effect of the per-key call for
each key in order. Two keyed backends of one job get the same random script, one per key
(``set_current_key`` then the per-key call), one in bulk; their results, their live entries
with TTL timestamps (``iter_records``), their restored snapshots (full, incremental, rescaled)
must be identical, with TTL off and on.
"""

from __future__ import annotations

import datetime as dt
import operator
import random
from typing import Any, Sequence

import pyarrow as pa
import pytest

from keyedstate.backends.base.backend import KeyedStateBackend
from keyedstate.errors import ConfigurationError, KeyGroupRangeError
from keyedstate.state.batch_keys import BatchKeys
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

from .contract import NAMESPACES, Average, Harness, Point, key_outside, keys_inside

#: TTL off, and on with each update type (short, so entries expire within a script)
TTLS = {
    "no-ttl": None,
    "ttl-on-write": StateTtlConfig(dt.timedelta(milliseconds=40),
                                   TtlUpdateType.ON_CREATE_AND_WRITE),
    "ttl-on-read": StateTtlConfig(dt.timedelta(milliseconds=40),
                                  TtlUpdateType.ON_READ_AND_WRITE, incremental_cleanup_size=2),
}


def bulk_kinds(ttl: StateTtlConfig | None) -> dict[str, StateDescriptor]:
    """One descriptor per state kind with a bulk call, typed and untyped, under ``ttl``."""
    return {
        "value": ValueStateDescriptor("value", "bigint", ttl=ttl),
        "counted": ValueStateDescriptor("counted", "bigint", default=0, ttl=ttl),
        "pickled": ValueStateDescriptor("pickled", ttl=ttl),
        "list": ListStateDescriptor("list", "string", ttl=ttl),
        "map": MapStateDescriptor("map", "string", "struct<a:int,b:array<string>>", ttl=ttl),
        "pmap": MapStateDescriptor("pmap", ttl=ttl),
        "reducing": ReducingStateDescriptor("reducing", operator.add, "bigint", ttl=ttl),
        "aggregating": AggregatingStateDescriptor(
            "aggregating", Average(), "struct<sum:double,count:bigint>", ttl=ttl),
    }


NAMES = sorted(bulk_kinds(None))


def records(backends: Sequence[KeyedStateBackend]) -> dict[str, list[Any]]:
    """Every live stored element of every state, with its TTL timestamp, in backend order (a
    map's entries sorted: their order is unspecified)."""
    out = {}
    for name in NAMES:
        rows = [(r.key_group, r.key_bytes, r.namespace_bytes, r.user_key, r.value,
                 r.ttl_timestamp) for b in backends for r in b.iter_records(name)]
        if "map" in name:
            rows.sort(key=lambda r: (r[0], r[1], r[2], repr(r[3])))
        out[name] = rows
    return out


class Script:
    """A deterministic random script of state calls over a key universe, run per key on one
    backend and in bulk on another; every result of both is kept for comparison."""

    def __init__(self, harness: Harness, ttl: StateTtlConfig | None, seed: int,
                 universe: Sequence[int]) -> None:
        self.harness = harness
        self.ttl = ttl
        self.rnd = random.Random(seed)
        self.universe = list(universe)
        self.descriptors = bulk_kinds(ttl)

    def step(self, per_key: KeyedStateBackend, bulk: KeyedStateBackend, seed: int) -> None:
        """One bulk call per state kind over a random subset of keys (in random order) and
        namespace; asserts both backends returned the same."""
        rnd = random.Random(seed)
        keys = rnd.sample(self.universe, rnd.randint(1, len(self.universe)))
        batch = BatchKeys.of(keys, self.harness.key_serializer, bulk.max_parallelism)
        ns = rnd.choice(NAMESPACES)
        calls: list[tuple[str, str, list[Any]]] = []
        for name in NAMES:
            op = rnd.random()
            if name in ("value", "counted", "pickled"):
                if op < 0.45:
                    make = ((lambda k: Point(k, seed)) if name == "pickled"
                            else (lambda k: rnd.randint(-10**12, 10**12)))
                    values = [None if rnd.random() < 0.15 else make(k) for k in keys]
                    calls.append((name, "update_many", [values]))
                elif op < 0.9:
                    calls.append((name, "get_many", []))
                else:
                    calls.append((name, "clear_many", []))
            elif name == "list":
                if op < 0.5:
                    calls.append((name, "add_many", [[[f"{k}-{seed}-{i}"
                                                       for i in range(rnd.randint(0, 2))]
                                                      for k in keys]]))
                elif op < 0.9:
                    calls.append((name, "get_many", []))
                else:
                    calls.append((name, "clear_many", []))
            elif name in ("map", "pmap"):
                user_keys: list[Any] = [f"m{rnd.randint(0, 3)}" if name == "map"
                                        else (rnd.randint(0, 3), "t") for _ in keys]
                if op < 0.5:
                    values = [{"a": k % 1000, "b": [str(seed)]} if name == "map"
                              else Point(seed, k) for k in keys]
                    calls.append((name, "put_many", [user_keys, values]))
                elif op < 0.9:
                    calls.append((name, "get_many", [user_keys]))
                else:
                    calls.append((name, "clear_many", []))
            elif name == "reducing":
                if op < 0.6:
                    calls.append((name, "add_many", [[rnd.randint(0, 100) for _ in keys]]))
                elif op < 0.9:
                    calls.append((name, "get_many", []))
                else:
                    calls.append((name, "clear_many", []))
            else:  # aggregating
                if op < 0.6:
                    calls.append((name, "add_many",
                                  [[float(rnd.randint(0, 100)) for _ in keys]]))
                elif op < 0.9:
                    calls.append((name, "get_many", []))
                else:
                    calls.append((name, "clear_many", []))
        for name, method, args in calls:
            state_a = per_key.get_state(self.descriptors[name])
            state_b = bulk.get_state(self.descriptors[name])
            state_a.set_current_namespace(ns)
            state_b.set_current_namespace(ns)
            expected = []
            single = method.removesuffix("_many")
            single = {("value", "get"): "value", ("counted", "get"): "value",
                      ("pickled", "get"): "value", ("value", "update"): "update",
                      ("counted", "update"): "update", ("pickled", "update"): "update",
                      ("list", "add"): "add_all"}.get((name, single), single)
            for i, key in enumerate(keys):
                per_key.set_current_key(key)
                result = getattr(state_a, single)(*[a[i] for a in args])
                expected.append(result)
            got = getattr(state_b, method)(batch, *args)
            if method.startswith("get"):
                assert got == expected, f"{name}.{method} in namespace {ns!r}"
            else:
                assert got is None
            state_a.set_current_namespace(None)
            state_b.set_current_namespace(None)

    def run(self, per_key: KeyedStateBackend, bulk: KeyedStateBackend, steps: int) -> None:
        for _ in range(steps):
            self.step(per_key, bulk, self.rnd.randrange(1 << 30))
            # Some entries expire between steps (TTL 40 ms).
            self.harness.clock.advance(self.rnd.randint(0, 25))
            assert records([per_key]) == records([bulk])


class BulkStateAccessContract:
    """Bulk calls against per-key calls; mixed into the contract runners."""

    @pytest.fixture(params=sorted(TTLS))
    def ttl(self, request: pytest.FixtureRequest) -> StateTtlConfig | None:
        return TTLS[request.param]

    def _pair(self, harness: Harness, ttl: StateTtlConfig | None
              ) -> tuple[KeyedStateBackend, KeyedStateBackend]:
        a, b = harness.create(), harness.create()
        for d in bulk_kinds(ttl).values():
            a.get_state(d)
            b.get_state(d)
        return a, b

    def test_bulk_calls_store_what_per_key_calls_store(self, harness, ttl):
        a, b = self._pair(harness, ttl)
        Script(harness, ttl, 1, range(40)).run(a, b, 12)
        assert records([a]) == records([b])
        assert any(records([a]).values()), "the script stored nothing"

    def test_bulk_calls_snapshot_and_restore_as_per_key_calls(self, harness, ttl):
        """Full snapshot, then bulk changes journaled into an incremental one (the heap's
        journal marks), then a rescaling restore: the same state as per key at every point."""
        a, b = self._pair(harness, ttl)
        script = Script(harness, ttl, 2, range(60))
        script.run(a, b, 4)
        full_a, full_b = harness.snapshot(a), harness.snapshot(b)
        script.run(a, b, 4)
        expected = records([a])
        assert records([b]) == expected
        inc_a, inc_b = harness.snapshot(a), harness.snapshot(b)
        for handle in (inc_a, inc_b):
            restored = harness.create(handles=[handle])
            for d in bulk_kinds(ttl).values():
                restored.get_state(d)
            assert records([restored]) == expected
        # Rescaled to 2: each new subtask continues in bulk from the bulk-written snapshot and
        # per key from the per-key one.
        per_key = harness.create_all(2, handles=[inc_a])
        bulk = harness.create_all(2, handles=[inc_b])
        assert records(per_key) == records(bulk) == {
            name: sorted(rows, key=lambda r: r[0]) for name, rows in expected.items()}
        for i in range(2):
            for d in bulk_kinds(ttl).values():
                per_key[i].get_state(d)
                bulk[i].get_state(d)
            inside = keys_inside(harness, bulk[i], 15)
            Script(harness, ttl, 3 + i, inside).run(per_key[i], bulk[i], 3)
        # Scaled back in to 1 (RocksDB: one instance per old subtask, so bulk calls span
        # several instances).
        merged_per_key = harness.create(handles=harness.snapshot_all(per_key))
        merged_bulk = harness.create(handles=harness.snapshot_all(bulk))
        for d in bulk_kinds(ttl).values():
            merged_per_key.get_state(d)
            merged_bulk.get_state(d)
        assert records([merged_per_key]) == records([merged_bulk])
        Script(harness, ttl, 5, range(60)).run(merged_per_key, merged_bulk, 3)
        del full_a, full_b

    def test_bulk_calls_leave_the_current_key_alone(self, harness):
        b = harness.create()
        state = b.get_state(ValueStateDescriptor("value", "bigint"))
        b.set_current_key(7)
        state.update(70)
        keys = BatchKeys.of([1, 2, 3], harness.key_serializer, b.max_parallelism)
        state.update_many(keys, pa.array([10, 20, 30]))
        assert b.get_current_key() == 7 and state.value() == 70
        assert state.get_many(keys) == [10, 20, 30]
        state.update_many(keys, [None, 21, None])
        assert state.get_many(keys) == [None, 21, None]
        state.clear_many(keys)
        assert state.get_many(keys) == [None, None, None] and state.value() == 70

    def test_bulk_calls_use_the_current_namespace(self, harness):
        b = harness.create()
        state = b.get_state(ReducingStateDescriptor("sum", operator.add, "bigint"))
        keys = BatchKeys.of([5], harness.key_serializer, b.max_parallelism)
        state.set_current_namespace("w1")
        state.add_many(keys, [3])
        state.add_many(keys, [4])
        assert state.get_many(keys) == [7]
        state.set_current_namespace(None)
        assert state.get_many(keys) == [None]

    def test_bulk_keys_outside_the_key_group_range_are_refused(self, harness):
        b = harness.create(0, 2)
        outside = key_outside(harness, b)
        keys = BatchKeys.of([*keys_inside(harness, b, 2), outside], harness.key_serializer,
                            b.max_parallelism)
        for d in bulk_kinds(None).values():
            state = b.get_state(d)
            with pytest.raises(KeyGroupRangeError, match=str(outside)):
                state.clear_many(keys)

    def test_bulk_values_must_be_one_per_key(self, harness):
        b = harness.create()
        state = b.get_state(ValueStateDescriptor("value", "bigint"))
        keys = BatchKeys.of([1, 2], harness.key_serializer, b.max_parallelism)
        with pytest.raises(ConfigurationError, match="3 values for 2 keys"):
            state.update_many(keys, [1, 2, 3])
        with pytest.raises(ConfigurationError, match="given twice"):
            BatchKeys.of([1, 2, 1], harness.key_serializer, b.max_parallelism)
