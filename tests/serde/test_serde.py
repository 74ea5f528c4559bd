"""Value types: the Spark DDL parser, checked typed serializers, the pickle fallback, namespaces."""

from __future__ import annotations

import datetime as dt
import decimal
import pickle
import threading

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyedstate.errors import SerializationError
from keyedstate.serde import (
    VOID_NAMESPACE,
    ArrowTypeSerializer,
    PickleSerializer,
    deserialize_namespace,
    parse_type,
    serialize_namespace,
    serializer_for,
)
from tests.property_budget import budget

UTC = dt.timezone.utc

# --------------------------------------------------------------------------------------------
# DDL parser
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ddl", "expected"),
    [
        ("boolean", pa.bool_()),
        ("BOOLEAN", pa.bool_()),
        ("tinyint", pa.int8()),
        ("byte", pa.int8()),
        ("smallint", pa.int16()),
        ("short", pa.int16()),
        ("int", pa.int32()),
        ("INTEGER", pa.int32()),
        ("bigint", pa.int64()),
        ("long", pa.int64()),
        ("float", pa.float32()),
        ("real", pa.float32()),
        ("double", pa.float64()),
        ("string", pa.string()),
        ("varchar(10)", pa.string()),
        ("char(3)", pa.string()),
        ("binary", pa.binary()),
        ("date", pa.date32()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("timestamp_ltz", pa.timestamp("us", tz="UTC")),
        ("timestamp_ntz", pa.timestamp("us")),
        ("decimal", pa.decimal128(10, 0)),
        ("decimal(10,2)", pa.decimal128(10, 2)),
        ("DEC(5)", pa.decimal128(5, 0)),
        ("numeric(38, 6)", pa.decimal128(38, 6)),
        ("array<string>", pa.list_(pa.string())),
        ("map<string,bigint>", pa.map_(pa.string(), pa.int64())),
        ("map< string , array<int> >", pa.map_(pa.string(), pa.list_(pa.int32()))),
        ("struct<a:int,b:string>",
         pa.struct([pa.field("a", pa.int32()), pa.field("b", pa.string())])),
        ("struct<a int, b string>",
         pa.struct([pa.field("a", pa.int32()), pa.field("b", pa.string())])),
        ("array<struct<x:double,y:array<int>>>",
         pa.list_(pa.struct([pa.field("x", pa.float64()),
                             pa.field("y", pa.list_(pa.int32()))]))),
        # a schema string is a struct
        ("a BIGINT, b STRING",
         pa.struct([pa.field("a", pa.int64()), pa.field("b", pa.string())])),
        ("count bigint", pa.struct([pa.field("count", pa.int64())])),
        ("`weird name` int, b string",
         pa.struct([pa.field("weird name", pa.int32()), pa.field("b", pa.string())])),
        ("date date", pa.struct([pa.field("date", pa.date32())])),
        ("  bigint  ", pa.int64()),
    ],
)
def test_ddl_parser(ddl, expected):
    assert parse_type(ddl) == expected


def test_pyarrow_types_pass_through():
    t = pa.list_(pa.int16())
    assert parse_type(t) is t


@pytest.mark.parametrize(
    "ddl",
    ["", "foo", "array<int", "array<>", "map<int>", "struct<a:int", "bigint extra", "int)", "#",
     "decimal(10,", "array<foo>"],
)
def test_ddl_parser_errors(ddl):
    with pytest.raises(SerializationError):
        parse_type(ddl)


@pytest.mark.parametrize("spec", [42, None, int, ["bigint"]])
def test_parse_type_refuses_non_types(spec):
    with pytest.raises(SerializationError):
        parse_type(spec)


def test_unsupported_arrow_type_is_refused():
    with pytest.raises(SerializationError):
        ArrowTypeSerializer(pa.null())


# --------------------------------------------------------------------------------------------
# ArrowTypeSerializer round trips
# --------------------------------------------------------------------------------------------

def _int_range(bits: int, signed: bool = True) -> st.SearchStrategy:
    if signed:
        return st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    return st.integers(0, (1 << bits) - 1)


DEC_10_2 = st.decimals(places=2, min_value=decimal.Decimal("-99999999.99"),
                       max_value=decimal.Decimal("99999999.99"))
DEC_38_6 = st.decimals(places=6, min_value=-(10 ** 32) + 1, max_value=10 ** 32 - 1)

PRIMITIVES: dict[str, tuple[pa.DataType | str, st.SearchStrategy]] = {
    "boolean": ("boolean", st.booleans()),
    "tinyint": ("tinyint", _int_range(8)),
    "smallint": ("smallint", _int_range(16)),
    "int": ("int", _int_range(32)),
    "bigint": ("bigint", _int_range(64)),
    "uint8": (pa.uint8(), _int_range(8, signed=False)),
    "uint64": (pa.uint64(), _int_range(64, signed=False)),
    "float": ("float", st.floats(width=32, allow_nan=False)),
    "double": ("double", st.floats(allow_nan=False)),
    "string": ("string", st.text()),
    "large_string": (pa.large_string(), st.text()),
    "binary": ("binary", st.binary()),
    "date": ("date", st.dates()),
    "timestamp": ("timestamp", st.datetimes(timezones=st.just(UTC))),
    "timestamp_ntz": ("timestamp_ntz", st.datetimes()),
    "decimal(10,2)": ("decimal(10,2)", DEC_10_2),
}


def _roundtrip(type_, value):
    ser = ArrowTypeSerializer(type_)
    data = ser.serialize(value)
    assert isinstance(data, bytes)
    back = ser.deserialize(data)
    assert back == value
    assert ser.serialize(back) == data  # canonical: re-serializing gives the same bytes
    assert ser.to_plain(value) == value
    return back


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_primitive_roundtrip(name):
    type_, strategy = PRIMITIVES[name]

    @given(st.none() | strategy)
    @settings(max_examples=budget(60), deadline=None)
    def check(value):
        back = _roundtrip(type_, value)
        if value is not None:
            assert type(back) is type(value)

    check()


@pytest.mark.parametrize(
    ("ddl", "value"),
    [
        ("decimal(38,6)", decimal.Decimal("12345678901234567890123456789012.123456")),
        ("decimal(38,6)", decimal.Decimal("-99999999999999999999999999999999.999999")),
        ("decimal(20,0)", decimal.Decimal(2 ** 64)),
        ("decimal(38,6)", decimal.Decimal("1.5")),
    ],
)
def test_wide_decimal_roundtrip(ddl, value):
    # decimal(p > 18): unscaled values beyond 64 bits must still round trip
    assert _roundtrip(ddl, value) == value


@given(DEC_38_6)
@settings(max_examples=budget(60), deadline=None)
def test_wide_decimal_roundtrip_property(value):
    _roundtrip("decimal(38,6)", value)


def test_decimal_is_quantized_to_the_scale():
    ser = ArrowTypeSerializer("decimal(10,2)")
    assert ser.deserialize(ser.serialize(decimal.Decimal("1.5"))) == decimal.Decimal("1.50")
    assert str(ser.deserialize(ser.serialize(decimal.Decimal("1.5")))) == "1.50"
    assert ser.deserialize(ser.serialize(3)) == decimal.Decimal("3.00")


def test_timestamps_are_instants():
    ser = ArrowTypeSerializer("timestamp")
    plus2 = dt.datetime(2024, 1, 1, 14, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    back = ser.deserialize(ser.serialize(plus2))
    assert back == plus2 and back.utcoffset() == dt.timedelta(0)
    naive = ser.deserialize(ser.serialize(dt.datetime(2024, 1, 1, 12)))
    assert naive == dt.datetime(2024, 1, 1, 12, tzinfo=UTC)
    ntz = ArrowTypeSerializer("timestamp_ntz")
    assert ntz.deserialize(ntz.serialize(dt.datetime(2024, 1, 1, 12))).tzinfo is None


def test_int_is_accepted_for_float_and_comes_back_float():
    ser = ArrowTypeSerializer("double")
    assert ser.deserialize(ser.serialize(3)) == 3.0
    assert type(ser.deserialize(ser.serialize(3))) is float


def test_bytearray_and_memoryview_are_binary():
    ser = ArrowTypeSerializer("binary")
    assert ser.deserialize(ser.serialize(bytearray(b"ab"))) == b"ab"
    assert ser.deserialize(ser.serialize(memoryview(b"cd"))) == b"cd"


@st.composite
def nested_type_and_value(draw, depth=0):
    """A random nested Arrow type with a value of it."""
    choice = draw(st.sampled_from(["prim", "list", "map", "struct"] if depth < 2 else ["prim"]))
    if choice == "prim":
        name = draw(st.sampled_from(sorted(PRIMITIVES)))
        type_, strategy = PRIMITIVES[name]
        return parse_type(type_), draw(st.none() | strategy)
    if choice == "list":
        item_type, _ = draw(nested_type_and_value(depth + 1))
        strategy = _value_of(item_type)
        return pa.list_(item_type), draw(st.none() | st.lists(strategy, max_size=4))
    if choice == "map":
        key_name = draw(st.sampled_from(["string", "bigint", "date"]))
        key_type, key_strategy = PRIMITIVES[key_name]
        item_type, _ = draw(nested_type_and_value(depth + 1))
        return (pa.map_(parse_type(key_type), item_type),
                draw(st.none() | st.dictionaries(key_strategy, _value_of(item_type), max_size=4)))
    n = draw(st.integers(1, 3))
    fields = [pa.field(f"f{i}", draw(nested_type_and_value(depth + 1))[0]) for i in range(n)]
    struct = pa.struct(fields)
    value = draw(st.none() | st.fixed_dictionaries({f.name: _value_of(f.type) for f in fields}))
    return struct, value


def _value_of(type_: pa.DataType) -> st.SearchStrategy:
    for t, strategy in PRIMITIVES.values():
        if parse_type(t) == type_:
            return st.none() | strategy
    if pa.types.is_list(type_):
        return st.none() | st.lists(_value_of(type_.value_type), max_size=4)
    if pa.types.is_map(type_):
        key_strategy = next(s for t, s in PRIMITIVES.values() if parse_type(t) == type_.key_type)
        return st.none() | st.dictionaries(key_strategy, _value_of(type_.item_type), max_size=4)
    assert pa.types.is_struct(type_)
    return st.none() | st.fixed_dictionaries(
        {type_.field(i).name: _value_of(type_.field(i).type) for i in range(type_.num_fields)})


@given(nested_type_and_value())
@settings(max_examples=budget(150), deadline=None)
def test_nested_roundtrip(type_and_value):
    type_, value = type_and_value
    _roundtrip(type_, value)
    # the DDL-free pyarrow type and a pickled serializer agree byte for byte
    ser = ArrowTypeSerializer(type_)
    assert pickle.loads(pickle.dumps(ser)).serialize(value) == ser.serialize(value)


def test_struct_accepts_tuples_and_missing_fields():
    ser = ArrowTypeSerializer("struct<a:int,b:string>")
    assert ser.deserialize(ser.serialize((1, "x"))) == {"a": 1, "b": "x"}
    assert ser.deserialize(ser.serialize({"a": 1})) == {"a": 1, "b": None}
    assert ser.serialize({"b": "x", "a": 1}) == ser.serialize({"a": 1, "b": "x"})


def test_map_and_list_examples():
    ser = ArrowTypeSerializer("map<string,array<date>>")
    value = {"a": [dt.date(2020, 1, 1), None], "b": []}
    assert ser.deserialize(ser.serialize(value)) == value
    lists = ArrowTypeSerializer("array<array<bigint>>")
    assert lists.deserialize(lists.serialize(((1, 2), [3]))) == [[1, 2], [3]]


# --------------------------------------------------------------------------------------------
# type errors
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("type_", "value"),
    [
        ("bigint", "1"),
        ("bigint", 1.0),
        ("bigint", True),
        ("bigint", 1 << 63),
        ("bigint", -(1 << 63) - 1),
        ("int", 1 << 31),
        ("tinyint", -129),
        (pa.uint8(), -1),
        (pa.uint8(), 256),
        ("boolean", 1),
        ("boolean", "true"),
        ("double", "1.0"),
        ("double", True),
        ("double", decimal.Decimal("1.5")),
        ("string", b"x"),
        ("string", 5),
        ("binary", "x"),
        ("date", dt.datetime(2020, 1, 1)),
        ("date", "2020-01-01"),
        ("timestamp", dt.date(2020, 1, 1)),
        ("timestamp", 1_700_000_000),
        ("decimal(5,2)", decimal.Decimal("1234.5")),
        ("decimal(5,2)", 1.5),
        ("decimal(5,2)", True),
        ("decimal(5,2)", "1.5"),
        ("array<int>", "abc"),
        ("array<int>", [1, "2"]),
        ("array<int>", {1: 2}),
        ("map<string,int>", [("a", 1)]),
        ("map<string,int>", {1: 1}),
        ("map<string,int>", {"a": "1"}),
        ("struct<a:int,b:string>", {"a": 1, "c": "x"}),
        ("struct<a:int,b:string>", (1,)),
        ("struct<a:int,b:string>", (1, 2)),
        ("struct<a:int,b:string>", "ab"),
        ("struct<a:int,b:string>", {"a": "1"}),
    ],
)
def test_values_that_do_not_match_the_type_are_refused(type_, value):
    ser = ArrowTypeSerializer(type_)
    with pytest.raises(SerializationError):
        ser.serialize(value)
    with pytest.raises(SerializationError):
        ser.to_plain(value)


@pytest.mark.parametrize(
    ("type_", "value"),
    [
        ("decimal(10,2)", decimal.Decimal("NaN")),
        ("decimal(10,2)", decimal.Decimal("Infinity")),
        ("decimal(10,2)", decimal.Decimal("sNaN")),
        ("double", 10 ** 400),
    ],
    ids=["decimal-nan", "decimal-infinity", "decimal-snan", "double-huge-int"],
)
def test_special_numbers_that_do_not_fit_are_a_serialization_error(type_, value):
    with pytest.raises(SerializationError):
        ArrowTypeSerializer(type_).serialize(value)


# --------------------------------------------------------------------------------------------
# corrupt bytes
# --------------------------------------------------------------------------------------------

def _bytes_of(type_, value) -> bytes:
    return ArrowTypeSerializer(type_).serialize(value)


@pytest.mark.parametrize(
    ("type_", "data"),
    [
        ("bigint", b"\xc1"),
        ("bigint", b""),
        ("string", _bytes_of("string", "hello")[:-2]),
        ("struct<a:int,b:string>", _bytes_of("struct<a:int,b:string>", (1, "x"))[:-1]),
        ("date", _bytes_of("string", "x")),
        ("array<int>", _bytes_of("bigint", 5)),
        ("map<string,int>", _bytes_of("bigint", 5)),
        ("struct<a:int,b:int>", _bytes_of("bigint", 5)),
        ("decimal(10,2)", _bytes_of("string", "x")),
        ("date", _bytes_of("bigint", 10 ** 12)),
        ("timestamp", _bytes_of("bigint", 1 << 62)),
    ],
)
def test_corrupt_bytes_are_a_serialization_error(type_, data):
    with pytest.raises(SerializationError):
        ArrowTypeSerializer(type_).deserialize(data)


# --------------------------------------------------------------------------------------------
# the pickle fallback
# --------------------------------------------------------------------------------------------

class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


@pytest.mark.parametrize(
    "value",
    [None, 1, "s", b"b", 1.5, (1, "a"), [1, [2]], {"a": {1, 2}}, frozenset({3}), Point(1, 2),
     decimal.Decimal("1.1"), dt.datetime(2020, 1, 1, tzinfo=UTC), 10 ** 40],
)
def test_pickle_serializer_roundtrip(value):
    ser = PickleSerializer()
    assert ser.deserialize(ser.serialize(value)) == value
    assert ser.to_plain(value) is value


@pytest.mark.parametrize("value", [lambda: 1, threading.Lock(), (n for n in range(3))])
def test_unpicklable_values_are_a_serialization_error(value):
    with pytest.raises(SerializationError):
        PickleSerializer().serialize(value)


@pytest.mark.parametrize("data", [b"garbage", b"", pickle.dumps([1, 2, 3])[:-3]])
def test_corrupt_pickles_are_a_serialization_error(data):
    with pytest.raises(SerializationError):
        PickleSerializer().deserialize(data)


def test_serializer_for_and_identity():
    assert isinstance(serializer_for(None), PickleSerializer)
    assert serializer_for(None).type_string == "pickle"
    typed = serializer_for("bigint")
    assert isinstance(typed, ArrowTypeSerializer) and typed.type_string == "int64"
    assert serializer_for("long") == typed == ArrowTypeSerializer(pa.int64())
    assert hash(serializer_for("long")) == hash(typed)
    assert typed != serializer_for("int")
    assert typed != PickleSerializer()
    assert PickleSerializer() == PickleSerializer()
    assert serializer_for("a int, b string").type_string == "struct<a: int32, b: string>"
    assert repr(typed) == "ArrowTypeSerializer(int64)"


# --------------------------------------------------------------------------------------------
# namespaces
# --------------------------------------------------------------------------------------------

namespaces = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda children: st.lists(children, max_size=3).map(tuple),
    max_leaves=8,
)


@given(namespaces)
@settings(max_examples=budget(200), deadline=None)
def test_namespace_roundtrip(namespace):
    data = serialize_namespace(namespace)
    assert deserialize_namespace(data) == namespace
    assert serialize_namespace(deserialize_namespace(data)) == data


def test_void_namespace():
    assert serialize_namespace(None) == VOID_NAMESPACE
    assert deserialize_namespace(VOID_NAMESPACE) is None


def test_distinct_namespaces_have_distinct_bytes():
    values = [None, 0, 1, True, False, 1.0, "1", b"1", (1,), (1, 2), ((1,), 2), "", b"", ()]
    assert len({serialize_namespace(v) for v in values}) == len(values)


def test_namespace_tuples_come_back_as_tuples():
    ns = ("window", 1000, (2000, "x"))
    assert deserialize_namespace(serialize_namespace(ns)) == ns
    assert isinstance(deserialize_namespace(serialize_namespace(ns))[2], tuple)


@pytest.mark.parametrize("namespace", [object(), Point(1, 2), 1 << 70, -(1 << 64)])
def test_unsupported_namespaces_are_a_serialization_error(namespace):
    with pytest.raises(SerializationError):
        serialize_namespace(namespace)


@pytest.mark.parametrize("namespace", [dt.date(2020, 1, 1), {1, 2}, frozenset({"a"})])
def test_a_namespace_round_trips_or_is_refused(namespace):
    # Silently storing another value would merge namespaces: date(2020, 1, 1) and
    # "2020-01-01" must not become the same window.
    try:
        data = serialize_namespace(namespace)
    except SerializationError:
        return
    assert deserialize_namespace(data) == namespace


@pytest.mark.parametrize("data", [b"\xc1", b"", b"\x92\x01"])
def test_corrupt_namespace_bytes_are_a_serialization_error(data):
    with pytest.raises(SerializationError):
        deserialize_namespace(data)


_CODEC_VALUES = [0, 1, -1, 127, 128, -129, (1 << 31) - 1, 1 << 31, -(1 << 31) - 1, (1 << 63) - 1,
                 1 << 63, -(1 << 63), -(1 << 63) - 1, 255, 256, True, False, None, 1.5, -0.0,
                 float("inf"), "", "s", "é" * 40, b"", b"\x00b", bytearray(b"ab"),
                 decimal.Decimal("1.5"), [1, 2], dt.date(2026, 1, 2)]


@pytest.mark.parametrize("ddl", ["tinyint", "smallint", "int", "bigint", "float", "double",
                                 "string", "binary", "boolean", "date", "decimal(10,2)",
                                 "array<bigint>"])
def test_one_call_codec_is_the_serializer_s_bytes_values_and_errors(ddl):
    """The per-key path's codec: for every value, the serializer's own bytes or its own error
    (type and message); every stored bytes decode to the serializer's value or its error."""
    import numpy as np

    from keyedstate.serde import one_call_codec

    serializer = ArrowTypeSerializer(ddl)
    ser, deser = one_call_codec(serializer)
    for value in [*_CODEC_VALUES, np.int64(7), np.int8(-3)]:
        try:
            expected: object = serializer.serialize(value)
        except Exception as exc:  # noqa: BLE001 - compared below
            expected = (type(exc), str(exc))
        try:
            got: object = ser(value)
        except Exception as exc:  # noqa: BLE001
            got = (type(exc), str(exc))
        assert got == expected, value
        if isinstance(got, bytes):
            assert deser(got) == serializer.deserialize(got)
    for raw in (b"", b"\xc1", b"\x92\x01"):
        with pytest.raises(SerializationError) as want:
            serializer.deserialize(raw)
        with pytest.raises(SerializationError) as have:
            deser(raw)
        assert str(have.value) == str(want.value)


def test_one_call_codec_of_other_serializers_is_their_own_methods():
    from keyedstate.serde import one_call_codec

    pickled = PickleSerializer()
    assert one_call_codec(pickled) == (pickled.serialize, pickled.deserialize)
