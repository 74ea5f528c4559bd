"""KeySerializer: canonical key bytes round trip, key groups in range and stable, typed errors.

(``tests/test_keys_spark.py`` proves the key group equals Spark's; not repeated here.)
"""

from __future__ import annotations

import datetime as dt
import decimal
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import keyedstate
from keyedstate.errors import SerializationError
from keyedstate.keys import SPARK_HASH_SEED, KeySerializer
from tests.property_budget import budget

UTC = dt.timezone.utc

# One strategy per key column type: (DDL, values).
KEY_TYPES: dict[str, st.SearchStrategy] = {
    "boolean": st.booleans(),
    "tinyint": st.integers(-(1 << 7), (1 << 7) - 1),
    "smallint": st.integers(-(1 << 15), (1 << 15) - 1),
    "int": st.integers(-(1 << 31), (1 << 31) - 1),
    "bigint": st.integers(-(1 << 63), (1 << 63) - 1),
    "float": st.floats(width=32, allow_nan=False),
    "double": st.floats(allow_nan=False),
    "string": st.text(),
    "binary": st.binary(),
    "date": st.dates(),
    "timestamp": st.datetimes(timezones=st.just(UTC)),
    "timestamp_ntz": st.datetimes(),
    "decimal(10,2)": st.decimals(places=2, min_value=decimal.Decimal("-99999999.99"),
                                 max_value=decimal.Decimal("99999999.99")),
    "decimal(30,1)": st.decimals(places=1, min_value=-(10 ** 28) + 1, max_value=10 ** 28 - 1),
}

EXAMPLES = {
    "boolean": [True, False],
    "tinyint": [-128, 0, 127],
    "smallint": [-32768, 32767],
    "int": [-(1 << 31), 0, (1 << 31) - 1],
    "bigint": [-(1 << 63), -1, 0, 1, (1 << 63) - 1],
    "float": [0.0, -1.5, 3.25],
    "double": [0.0, -1e300, 2.5, float("inf")],
    "string": ["", "user-1", "ünïcødé ✓", "x" * 1000],
    "binary": [b"", b"\x00\xff", b"x" * 100],
    "date": [dt.date(1970, 1, 1), dt.date(1, 1, 1), dt.date(9999, 12, 31), dt.date(2024, 2, 29)],
    "timestamp": [dt.datetime(1970, 1, 1, tzinfo=UTC),
                  dt.datetime(2024, 2, 29, 12, 30, 1, 123456, tzinfo=UTC),
                  dt.datetime(1900, 1, 1, tzinfo=UTC)],
    "timestamp_ntz": [dt.datetime(2024, 1, 1, 8), dt.datetime(1969, 12, 31, 23, 59, 59, 999999)],
    "decimal(10,2)": [decimal.Decimal("0.00"), decimal.Decimal("-12.34"),
                      decimal.Decimal("99999999.99")],
    "decimal(30,1)": [decimal.Decimal("123456789012345678901234.5"), decimal.Decimal("-1.0")],
}

MAX_PARALLELISMS = [1, 7, 8, 128, 129, 32768]


@pytest.mark.parametrize("ddl", sorted(EXAMPLES))
def test_single_column_roundtrip_examples(ddl):
    ks = KeySerializer([ddl])
    for key in EXAMPLES[ddl]:
        data = ks.serialize(key)
        assert isinstance(data, bytes)
        back = ks.deserialize(data)
        assert back == key and type(back) is type(key)
        assert ks.serialize(back) == data
        # a one-column key may also be given as a 1-tuple
        assert ks.serialize((key,)) == data
        for max_p in MAX_PARALLELISMS:
            assert 0 <= ks.key_group(key, max_p) < max_p


def test_timestamp_keys_are_instants():
    ks = KeySerializer(["timestamp"])
    utc = dt.datetime(2024, 5, 1, 12, tzinfo=UTC)
    plus2 = dt.datetime(2024, 5, 1, 14, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    naive = dt.datetime(2024, 5, 1, 12)
    assert ks.serialize(plus2) == ks.serialize(utc) == ks.serialize(naive)
    assert ks.key_group(plus2, 128) == ks.key_group(utc, 128) == ks.key_group(naive, 128)
    assert ks.deserialize(ks.serialize(plus2)) == utc
    assert ks.deserialize(ks.serialize(plus2)).utcoffset() == dt.timedelta(0)


def test_timestamp_ntz_keys_come_back_naive():
    ks = KeySerializer(["timestamp_ntz"])
    key = dt.datetime(2024, 5, 1, 12, 0, 0, 5)
    assert ks.deserialize(ks.serialize(key)).tzinfo is None
    assert ks.deserialize(ks.serialize(key)) == key


def test_decimal_keys_are_quantized_to_the_scale():
    ks = KeySerializer(["decimal(10,2)"])
    assert ks.serialize(decimal.Decimal("1.5")) == ks.serialize(decimal.Decimal("1.50"))
    assert ks.key_group(decimal.Decimal("1.5"), 128) == ks.key_group(decimal.Decimal("1.50"), 128)
    assert ks.deserialize(ks.serialize(decimal.Decimal("1.5"))) == decimal.Decimal("1.50")


def test_negative_zero_hashes_as_zero():
    ks = KeySerializer(["double"])
    assert ks.key_group(-0.0, 32768) == ks.key_group(0.0, 32768)
    ks32 = KeySerializer(["float"])
    assert ks32.key_group(-0.0, 32768) == ks32.key_group(0.0, 32768)


def test_composite_key_roundtrip_with_none_columns():
    types = ["bigint", "string", "date", "decimal(10,2)", "boolean"]
    ks = KeySerializer(types)
    keys = [
        (1, "a", dt.date(2020, 1, 1), decimal.Decimal("1.00"), True),
        (None, "a", None, None, None),
        (None, None, None, None, None),
        (-5, None, dt.date(1969, 7, 20), decimal.Decimal("-0.01"), False),
    ]
    for key in keys:
        data = ks.serialize(key)
        assert ks.deserialize(data) == key
        assert isinstance(ks.deserialize(data), tuple)
        assert 0 <= ks.key_group(key, 128) < 128
    assert len({ks.serialize(k) for k in keys}) == len(keys)


def test_all_null_columns_hash_to_the_seed():
    # Spark: nulls leave the seed unchanged, so xxhash64(null, null) = 42.
    ks = KeySerializer(["bigint", "string"])
    assert ks.key_group((None, None), 1 << 15) == SPARK_HASH_SEED
    assert KeySerializer(["string"]).key_group(None, 1000) == SPARK_HASH_SEED


def test_column_order_matters():
    ks = KeySerializer(["string", "string"])
    assert ks.serialize(("a", "b")) != ks.serialize(("b", "a"))
    groups = {ks.key_group((f"x{i}", f"y{i}"), 32768) != ks.key_group((f"y{i}", f"x{i}"), 32768)
              for i in range(20)}
    assert True in groups


def test_pyarrow_types_are_accepted():
    by_ddl = KeySerializer(["bigint", "string"])
    by_arrow = KeySerializer([pa.int64(), pa.string()])
    assert by_ddl == by_arrow
    key = (7, "seven")
    assert by_ddl.serialize(key) == by_arrow.serialize(key)
    assert by_ddl.key_group(key, 128) == by_arrow.key_group(key, 128)


def test_type_inference_from_the_first_key():
    ks = KeySerializer()
    assert ks.type_strings == []
    ks.serialize(1)
    assert ks.type_strings == ["int64"]
    # inferred like pyspark: an int is a bigint
    assert ks.key_group(12345, 128) == KeySerializer(["bigint"]).key_group(12345, 128)
    with pytest.raises(SerializationError):
        ks.serialize("now a string")
    composite = KeySerializer()
    assert composite.deserialize(composite.serialize(("a", 2, 1.5, b"b", True))) == \
        ("a", 2, 1.5, b"b", True)
    assert composite.type_strings == ["string", "int64", "double", "binary", "bool"]
    dates = KeySerializer()
    dates.serialize((dt.date(2020, 1, 1), dt.datetime(2020, 1, 1, tzinfo=UTC)))
    assert dates.type_strings == ["date32[day]", "timestamp[us, tz=UTC]"]


@pytest.mark.parametrize("key", [[1], {"a": 1}, None, object(), {1, 2}, decimal.Decimal("1.5")])
def test_untyped_keys_of_unsupported_types_are_refused(key):
    with pytest.raises(SerializationError):
        KeySerializer().serialize(key)


@pytest.mark.parametrize("ddl", ["array<int>", "map<string,int>", "struct<a:int>"])
def test_unsupported_declared_key_types_are_refused(ddl):
    with pytest.raises(SerializationError, match="cannot be a key"):
        KeySerializer([ddl])


@pytest.mark.parametrize("types", [[], ["nosuchtype"], [object()]])
def test_bad_type_declarations_are_refused(types):
    with pytest.raises(SerializationError):
        KeySerializer(types)


@pytest.mark.parametrize(
    ("types", "key"),
    [
        (["bigint"], "1"),
        (["bigint"], 1.0),
        (["bigint"], True),
        (["bigint"], 1 << 63),
        (["int"], 1 << 31),
        (["tinyint"], 128),
        (["string"], b"bytes"),
        (["binary"], "text"),
        (["date"], dt.datetime(2020, 1, 1)),
        (["timestamp"], dt.date(2020, 1, 1)),
        (["decimal(5,2)"], decimal.Decimal("1234.5")),
        (["decimal(5,2)"], 1.5),
        (["boolean"], 1),
        (["bigint"], (1, 2)),
        (["bigint", "string"], 1),
        (["bigint", "string"], (1,)),
        (["bigint", "string"], (1, "a", "b")),
        (["bigint", "string"], ("a", 1)),
        (["bigint", "string"], [1, "a"]),
    ],
)
def test_keys_that_do_not_match_the_declared_types_are_refused(types, key):
    with pytest.raises(SerializationError):
        KeySerializer(types).serialize(key)


@pytest.mark.parametrize(
    ("types", "key"),
    [
        (["int"], 1 << 40),
        (["bigint"], "1"),
        (["bigint"], 1.5),
        (["string"], 5),
        (["bigint", "string"], (1,)),
    ],
)
def test_key_group_of_a_mistyped_key_is_refused(types, key):
    # The key group must never be computed from a value serialize() would refuse: the row would
    # be routed somewhere and then fail (or worse, be hashed as another type).
    with pytest.raises(SerializationError):
        KeySerializer(types).key_group(key, 128)


def test_deserialize_before_any_key_is_refused():
    with pytest.raises(SerializationError, match="unknown"):
        KeySerializer().deserialize(b"\x01")


@pytest.mark.parametrize("data", [b"\xc1", b"", b"\xa5ab"])
def test_corrupt_key_bytes_are_a_serialization_error(data):
    with pytest.raises(SerializationError):
        KeySerializer(["string"]).deserialize(data)


def test_serializer_equality_repr_and_pickle():
    ks = KeySerializer(["bigint", "string"])
    assert ks == KeySerializer(["long", "varchar(3)"])
    assert ks != KeySerializer(["bigint"])
    assert ks != "KeySerializer"
    assert repr(ks) == "KeySerializer(['int64', 'string'])"
    clone = pickle.loads(pickle.dumps(ks))
    assert clone == ks
    assert clone.serialize((1, "a")) == ks.serialize((1, "a"))
    inferred = KeySerializer()
    inferred.serialize("k")
    assert pickle.loads(pickle.dumps(inferred)).deserialize(inferred.serialize("k")) == "k"


# --------------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------------

@st.composite
def typed_keys(draw):
    """(types, key) for a one- to three-column key, columns nullable in composite keys."""
    n = draw(st.integers(1, 3))
    types = draw(st.lists(st.sampled_from(sorted(KEY_TYPES)), min_size=n, max_size=n))
    if n == 1:
        return types, draw(KEY_TYPES[types[0]])
    return types, tuple(draw(st.none() | KEY_TYPES[t]) for t in types)


@given(typed_keys(), st.sampled_from(MAX_PARALLELISMS))
@example((["decimal(30,1)"], decimal.Decimal("123456789012345678901234.5")), 128)
@example((["bigint", "string"], (None, None)), 7)
@settings(max_examples=budget(300), deadline=None)
def test_roundtrip_and_key_group_properties(typed_key, max_parallelism):
    types, key = typed_key
    ks = KeySerializer(types)
    data = ks.serialize(key)
    assert ks.deserialize(data) == key
    # deterministic: a fresh serializer and a pickled one produce the same bytes and group
    fresh = KeySerializer(types)
    shipped = pickle.loads(pickle.dumps(ks))
    assert fresh.serialize(key) == data == shipped.serialize(key)
    kg = ks.key_group(key, max_parallelism)
    assert 0 <= kg < max_parallelism
    assert fresh.key_group(key, max_parallelism) == kg == shipped.key_group(key, max_parallelism)
    # the key decoded from storage lands in the same key group (timers, restore, rescaling)
    assert ks.key_group(ks.deserialize(data), max_parallelism) == kg


@given(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=2, max_size=20, unique=True))
@settings(max_examples=budget(100), deadline=None)
def test_distinct_keys_have_distinct_bytes(keys):
    ks = KeySerializer(["bigint"])
    assert len({ks.serialize(k) for k in keys}) == len(keys)


def test_key_groups_spread_over_all_groups():
    ks = KeySerializer(["bigint"])
    groups = {ks.key_group(k, 128) for k in range(5000)}
    assert groups == set(range(128))


def test_key_groups_do_not_depend_on_pythons_hash_seed():
    code = (
        "from keyedstate.keys import KeySerializer as K;"
        "k = K(['string', 'bigint']);"
        "print([k.key_group((f'user-{i}', i), 32768) for i in range(50)])"
    )
    outputs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed,
                   PYTHONPATH=str(Path(keyedstate.__file__).parent.parent))
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout
        outputs.add(out)
    assert len(outputs) == 1
    ks = KeySerializer(["string", "bigint"])
    assert outputs.pop().strip() == str([ks.key_group((f"user-{i}", i), 32768) for i in range(50)])


@pytest.mark.parametrize("types,keys", [
    (["string"], ["a", "", "ü" * 40, None]),
    (["bigint"], [0, -1, 2**62, None]),
    (["string", "int"], [("a", 1), (None, 2), ("b", None)]),
    (None, [1, 2, 3]),
])
def test_serialize_many_gives_the_bytes_of_serialize(types, keys):
    serializer = KeySerializer(types)
    assert serializer.serialize_many(keys) == [KeySerializer(types).serialize(k) for k in keys]
    assert serializer.serialize_many([]) == []


@given(typed_keys())
@settings(max_examples=budget(200), deadline=None)
def test_serialize_of_a_scalar_key_is_the_column_path_s_bytes(typed_key):
    """``serialize``'s shortcut for a scalar key gives the bytes of the checked column path,
    of ``serialize_many``, and of the same key as a 1-tuple (and a named one)."""
    from collections import namedtuple

    types, key = typed_key
    ks = KeySerializer(types)
    data = ks.serialize(key)
    assert data == ks._encode(ks._plain(key)) == ks.serialize_many([key])[0]
    if len(types) == 1:
        one = namedtuple("One", "k")
        assert ks.serialize((key,)) == data == ks.serialize(one(key))


def test_serialize_shortcut_checks_the_key_and_infers_types_first():
    ks = KeySerializer()  # types inferred from the first key, then fixed
    assert ks.serialize("a") == KeySerializer(["string"]).serialize("a")
    with pytest.raises(SerializationError, match="string"):
        ks.serialize(5)
