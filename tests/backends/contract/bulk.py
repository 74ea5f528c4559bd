"""The bulk state calls' script (``get_many``, ``update_many``, ``add_many``, ``put_many``,
``clear_many``): the state kinds with a bulk call, under TTL off and on (``TTLS``), and a
deterministic random :class:`Script` run per key on one keyed backend and in bulk on another
(``test_bulk.py``; the RocksDB tests reuse it).

The rule it checks: a bulk call over some keys has exactly the effect of the per-key call for
each key in order.
"""

from __future__ import annotations

import datetime as dt
import operator
import random
from typing import Any, Sequence

from keyedstate.backends.base.backend import KeyedStateBackend
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

from .common import NAMESPACES, Average, Harness, Point

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
