"""The backend contract: reducing and aggregating state, and a user function that raises
(a ``UserFunctionError`` that changes nothing)."""

from __future__ import annotations

import operator

import pytest

from keyedstate.errors import (
    UserFunctionError,
)
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ReducingStateDescriptor,
)

from .common import (
    Average,
    Boom,
    FailingAggregate,
    dump,
    failing_reduce,
    ident,
)


class TestReducingAndAggregatingState:
    """Reducing and aggregating state, on every backend."""

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
