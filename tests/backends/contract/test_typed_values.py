"""The backend contract: typed values (Spark DDL or pyarrow) refuse what does not fit with a
``SerializationError`` and keep the old value; untyped values are pickled."""

from __future__ import annotations

import datetime as dt
import decimal
import operator
import threading

import pytest

from keyedstate.errors import (
    SerializationError,
)
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)

from .common import (
    Point,
    WrongAccumulator,
)


class TestTypedAndUntypedValues:
    """Typed and untyped values and keys, on every backend."""

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
