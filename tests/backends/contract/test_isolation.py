"""The backend contract: isolation. Keys (plain, composite, set as bytes), namespaces, states
of one backend, and the backends of one job's subtasks never see each other's entries."""

from __future__ import annotations

from keyedstate.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
)

from .common import (
    NAMESPACES,
    dump,
    ident,
    keys_inside,
)


class TestIsolation:
    """Isolation of keys, namespaces, states and subtasks, on every backend."""

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
