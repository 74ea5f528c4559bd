"""The backend contract: value state (a default, update, update(None), clear)."""

from __future__ import annotations

from keyedstate.state.descriptors import (
    ValueStateDescriptor,
)

from .common import (
    dump,
    ident,
)


class TestValueState:
    """Value state, on every backend."""

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
