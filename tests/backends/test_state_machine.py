"""Hypothesis state machine: each backend against a plain dict model, through snapshot,
abort, restore and rescale.

Rules put and delete on value, map and list states (and register and delete timers) for random
keys (ints, strings, both, null columns) and namespaces. A snapshot of every subtask is then
confirmed (the registry deletes every file the new checkpoint doesn't reference), aborted, or
left unconfirmed (their files deleted: neither may ever be a base). A restore rolls the model
back to the last confirmed snapshot and restores it at a random parallelism. After every step
the union of ``iter_entries`` (and of the timers) over all subtasks equals the model.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.serde import serialize_namespace
from keyedstate.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateDescriptor,
    ValueStateDescriptor,
)
from keyedstate.state.timers import TimeDomain
from keyedstate.storage.handles import KeyedStateHandle
from tests.property_budget import budget

from .contract.common import Harness, dump, dump_timers

DESCRIPTORS: dict[str, StateDescriptor] = {
    "value": ValueStateDescriptor("value", "bigint"),
    "map": MapStateDescriptor("map", "string"),  # untyped (pickled) values
    "list": ListStateDescriptor("list", "string"),
}
NAMES = sorted(DESCRIPTORS)

ints = st.integers(-20, 20)
strs = st.sampled_from(["", "a", "b", "key-1", "ü✓", "a" * 40])
keys = st.one_of(
    st.tuples(ints, st.none()),
    st.tuples(st.none(), strs),
    st.tuples(ints, strs),
)
namespaces = st.sampled_from([None, "w1", 3, ("w", 1)])
user_keys = st.sampled_from(["x", "y", "z", ""])
map_values = st.one_of(st.integers(), st.text(max_size=4), st.tuples(st.integers(), st.none()))
list_values = st.text(max_size=6)
timestamps = st.integers(0, 30)
domains = st.sampled_from([TimeDomain.EVENT_TIME, TimeDomain.PROCESSING_TIME])


def parallelisms(max_parallelism: int) -> st.SearchStrategy[int]:
    # Every parallelism up to max parallelism 8; a sample of them under 128 (each subtask is a
    # backend to open and snapshot, so 128 of them would dominate the run).
    if max_parallelism <= 8:
        return st.sampled_from(range(1, max_parallelism + 1))  # uniform: not biased to 1
    return st.sampled_from([1, 2, 3, 7, 13])


class BackendModelMachine(RuleBasedStateMachine):
    """Subclassed per backend with ``state_backend`` set."""

    state_backend: StateBackend

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="keyedstate-sm-"))
        self.harness: Harness | None = None
        self.backends: list[KeyedStateBackend] = []
        self.model: dict[str, dict[tuple[bytes, bytes, Any], Any]] = {n: {} for n in NAMES}
        self.timers: set[tuple[str, int, bytes, bytes]] = set()
        self.confirmed: tuple[list[KeyedStateHandle], Any, Any] | None = None

    # -- set-up ---------------------------------------------------------------------------------

    @initialize(max_parallelism=st.sampled_from([8, 8, 8, 128]), data=st.data())
    def start(self, max_parallelism: int, data: st.DataObject) -> None:
        self.harness = Harness(self.state_backend, self.tmp, key_types=("bigint", "string"),
                               max_parallelism=max_parallelism)
        self._open(data.draw(parallelisms(max_parallelism), "parallelism"), [])

    def _open(self, parallelism: int, handles: list[KeyedStateHandle]) -> None:
        assert self.harness is not None
        for b in self.backends:
            b.close()
        self.backends = self.harness.create_all(parallelism, handles=handles)
        for b in self.backends:
            for d in DESCRIPTORS.values():
                b.get_state(d)

    def _at(self, key: Any, name: str, namespace: Any) -> tuple[Any, tuple[bytes, bytes]]:
        assert self.harness is not None
        backend = self.harness.at(self.backends, key)
        state = backend.get_state(DESCRIPTORS[name])
        state.set_current_namespace(namespace)
        scope = (self.harness.key_serializer.serialize(key), serialize_namespace(namespace))
        return state, scope

    # -- value state ----------------------------------------------------------------------------

    @rule(key=keys, ns=namespaces, value=st.none() | st.integers(-(1 << 63), (1 << 63) - 1))
    def value_update(self, key: Any, ns: Any, value: int | None) -> None:
        state, scope = self._at(key, "value", ns)
        state.update(value)
        if value is None:
            self.model["value"].pop((*scope, None), None)
        else:
            self.model["value"][(*scope, None)] = value
        assert state.value() == value

    @rule(key=keys, ns=namespaces)
    def value_clear(self, key: Any, ns: Any) -> None:
        state, scope = self._at(key, "value", ns)
        state.clear()
        self.model["value"].pop((*scope, None), None)

    @rule(entries=st.lists(st.tuples(keys, namespaces, st.integers(-1000, 1000)), min_size=1,
                           max_size=10))
    def put_many(self, entries: list[tuple[Any, Any, int]]) -> None:
        """Bulk writes to all three states, so snapshots carry more than a handful of entries."""
        for key, ns, n in entries:
            value, scope = self._at(key, "value", ns)
            value.update(n)
            self.model["value"][(*scope, None)] = n
            mp, _ = self._at(key, "map", ns)
            mp.put(str(n % 3), n)
            self.model["map"][(*scope, str(n % 3))] = n
            lst, _ = self._at(key, "list", ns)
            lst.add(str(n))
            self.model["list"].setdefault((*scope, None), []).append(str(n))

    # -- map state ------------------------------------------------------------------------------

    @rule(key=keys, ns=namespaces, user_key=user_keys, value=map_values)
    def map_put(self, key: Any, ns: Any, user_key: str, value: Any) -> None:
        state, scope = self._at(key, "map", ns)
        state.put(user_key, value)
        self.model["map"][(*scope, user_key)] = value

    @rule(key=keys, ns=namespaces, user_key=user_keys)
    def map_remove(self, key: Any, ns: Any, user_key: str) -> None:
        state, scope = self._at(key, "map", ns)
        state.remove(user_key)
        self.model["map"].pop((*scope, user_key), None)
        assert not state.contains(user_key)

    @rule(key=keys, ns=namespaces)
    def map_clear(self, key: Any, ns: Any) -> None:
        state, scope = self._at(key, "map", ns)
        state.clear()
        for ident in [i for i in self.model["map"] if i[:2] == scope]:
            del self.model["map"][ident]
        assert state.is_empty()

    # -- list state -----------------------------------------------------------------------------

    @rule(key=keys, ns=namespaces, value=list_values)
    def list_add(self, key: Any, ns: Any, value: str) -> None:
        state, scope = self._at(key, "list", ns)
        state.add(value)
        self.model["list"].setdefault((*scope, None), []).append(value)

    @rule(key=keys, ns=namespaces, values=st.lists(list_values, max_size=3))
    def list_update(self, key: Any, ns: Any, values: list[str]) -> None:
        state, scope = self._at(key, "list", ns)
        state.update(values)
        if values:
            self.model["list"][(*scope, None)] = list(values)
        else:
            self.model["list"].pop((*scope, None), None)
        assert state.get() == values

    @rule(key=keys, ns=namespaces)
    def list_clear(self, key: Any, ns: Any) -> None:
        state, scope = self._at(key, "list", ns)
        state.clear()
        self.model["list"].pop((*scope, None), None)

    # -- timers ---------------------------------------------------------------------------------

    @rule(key=keys, ns=namespaces, domain=domains, ts=timestamps, delete=st.booleans())
    def timer(self, key: Any, ns: Any, domain: TimeDomain, ts: int, delete: bool) -> None:
        assert self.harness is not None
        backend = self.harness.at(self.backends, key)
        service = backend.timer_service
        ident = (str(domain), ts, self.harness.key_serializer.serialize(key),
                 serialize_namespace(ns))
        if domain is TimeDomain.EVENT_TIME:
            op = service.delete_event_time_timer if delete else service.register_event_time_timer
        else:
            op = service.delete_processing_time_timer if delete \
                else service.register_processing_time_timer
        op(ts, ns)
        if delete:
            self.timers.discard(ident)
        else:
            self.timers.add(ident)

    # -- snapshots ------------------------------------------------------------------------------

    @rule(outcome=st.sampled_from(["confirm", "confirm", "abort", "discard", "unconfirmed"]),
          full=st.booleans())
    def snapshot(self, outcome: str, full: bool) -> None:
        h = self.harness
        assert h is not None
        if outcome == "confirm":
            handles = h.snapshot_all(self.backends, full=full)
            self.confirmed = (handles, copy.deepcopy(self.model), set(self.timers))
            h.delete_all_but(handles)  # older checkpoints are subsumed
            return
        cid = h.next_id()
        results = [b.snapshot(cid, h.location(cid, b), full=full) for b in self.backends]
        for b, result in zip(self.backends, results, strict=True):
            if outcome == "discard":
                result.discard()
            else:
                result.materialize()
            if outcome != "unconfirmed":
                b.notify_checkpoint_aborted(cid)
        h.storage.delete(h.written_by(cid))  # never a base: its files may go at once

    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        """Fail over: restore the last confirmed checkpoint at a random parallelism."""
        assert self.harness is not None
        self.restore_at(data.draw(parallelisms(self.harness.max_parallelism), "parallelism"))

    @rule(data=st.data(), full=st.booleans(),
          failed_first=st.sampled_from([None, "abort", "discard", "unconfirmed"]))
    def checkpoint_and_rescale(self, data: st.DataObject, full: bool,
                               failed_first: str | None) -> None:
        """The path that matters most, as one rule: (a failed checkpoint,) a confirmed one, a
        restore of it elsewhere."""
        if failed_first is not None:
            self.snapshot(failed_first, False)
        self.snapshot("confirm", full)
        self.restore(data)

    def restore_at(self, parallelism: int) -> None:
        if self.confirmed is None:
            self._open(parallelism, [])
            self.model = {n: {} for n in NAMES}
            self.timers = set()
            return
        handles, model, timers = self.confirmed
        self._open(parallelism, handles)
        self.model = copy.deepcopy(model)
        self.timers = set(timers)

    # -- the invariant --------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        if self.harness is None:
            return
        assert dump(self.harness, self.backends, NAMES) == self.model
        assert dump_timers(self.harness, self.backends) == self.timers

    @rule(key=keys, ns=namespaces)
    def read_back(self, key: Any, ns: Any) -> None:
        """The state API agrees with the model too (not only iter_entries)."""
        value, scope = self._at(key, "value", ns)
        assert value.value() == self.model["value"].get((*scope, None))
        lst, _ = self._at(key, "list", ns)
        assert lst.get() == self.model["list"].get((*scope, None), [])
        mp, _ = self._at(key, "map", ns)
        assert dict(mp.items()) == {i[2]: v for i, v in self.model["map"].items()
                                    if i[:2] == scope}

    def teardown(self) -> None:
        for b in self.backends:
            b.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


SETTINGS = settings(
    max_examples=budget(20),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_backend_matches_the_model(state_backend: StateBackend) -> None:
    machine = type(f"{type(state_backend).__name__}ModelMachine", (BackendModelMachine,),
                   {"state_backend": state_backend})
    run_state_machine_as_test(machine, settings=SETTINGS)


def test_fixed_scenario_through_the_machine(state_backend: StateBackend) -> None:
    """One fixed run of the same rules: write, confirm, abort, rescale 3 -> 5 -> 1 (so the
    basic path is covered whatever Hypothesis draws)."""
    machine = type("Fixed", (BackendModelMachine,), {"state_backend": state_backend})()
    try:
        machine.harness = Harness(state_backend, machine.tmp, key_types=("bigint", "string"),
                                  max_parallelism=8)
        machine._open(3, [])
        for i in range(30):
            machine.value_update((i, None), None if i % 3 else "w1", i * 1000)
            machine.list_add((None, f"k{i % 5}"), None, f"v{i}")
            machine.map_put((i % 7, "s"), ("w", 1), "x", (i, None))
            machine.timer((i, "t"), None, TimeDomain.EVENT_TIME, i % 11, False)
        machine.matches_the_model()
        machine.snapshot("confirm", False)
        machine.value_clear((0, None), "w1")
        machine.snapshot("abort", False)
        machine.matches_the_model()
        for parallelism in (5, 1):
            machine.restore_at(parallelism)
            assert len(machine.backends) == parallelism
            machine.matches_the_model()
            machine.list_update((None, "k1"), None, ["only"])
            machine.snapshot("confirm", parallelism == 1)
        assert machine.model["value"]  # the rollback kept the confirmed content
    finally:
        machine.teardown()


def test_heap_rolling_chain_matches_the_model() -> None:
    """The heap backend with a short chain bound (``max_chain_length=1``: each incremental
    snapshot images at least half of each subtask's key groups), so that within a run's few
    confirmed checkpoints chains roll, drop their first files (the machine deletes every file
    the latest checkpoint does not list) and get restored and rescaled mid-roll."""
    from keyedstate.backends.heap import HeapStateBackend

    test_backend_matches_the_model(HeapStateBackend(max_chain_length=1))
