"""The backend contract: registering states (``get_state``), a name's kind and types, the
states a backend describes (``state_meta_infos``), unknown states."""

from __future__ import annotations

import operator

import pytest

from keyedstate.errors import (
    StateNotFoundError,
    StateTypeMismatchError,
)
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)

from .common import (
    Average,
    all_kinds,
    register_all,
)


class TestRegistration:
    """State registration, on every backend."""

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
