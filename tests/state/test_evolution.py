"""State schema evolution rules (keyedstate.state.evolution, docs/schema-evolution.md).

Every rule is a row: old type, new type, outcome, an old value and its migrated value. Each
compatible row is checked through both migrations (one Python value, one Arrow array) and the
new type's serde check; each incompatible row checks that the error names the field path and
both types and says the way out. Hypothesis then evolves random nested struct schemas by one
step and compares the migration with the value rebuilt by field name here.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from keyedstate.errors import ConfigurationError, StateTypeMismatchError
from keyedstate.serde import converters, parse_type
from keyedstate.state.evolution import (
    WAY_OUT,
    SchemaCompatibility,
    resolve_schema_compatibility,
    resolve_state_compatibility,
)
from tests.property_budget import budget

AS_IS = SchemaCompatibility.COMPATIBLE_AS_IS
MIGRATE = SchemaCompatibility.COMPATIBLE_AFTER_MIGRATION
UTC = dt.timezone.utc
D = dt.date(2024, 2, 29)


def norm(value: Any, type_: pa.DataType) -> Any:
    """A value as the serde presents it (Arrow's to_pylist gives maps as pairs)."""
    if value is None:
        return None
    if pa.types.is_struct(type_):
        return {type_.field(i).name: norm(value[type_.field(i).name], type_.field(i).type)
                for i in range(type_.num_fields)}
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return [norm(x, type_.value_type) for x in value]
    if pa.types.is_map(type_):
        pairs = value.items() if isinstance(value, dict) else value
        return {k: norm(x, type_.item_type) for k, x in pairs}
    return value


def check_migration(old: pa.DataType, new: pa.DataType, values: list[Any],
                    expected: list[Any], **kwargs: Any) -> None:
    resolution = resolve_schema_compatibility("s", old, new, **kwargs)
    assert resolution.is_compatible, resolution.error
    migrated = [resolution.migrate(v) for v in values]
    assert migrated == expected
    encode, _ = converters(new)
    for v in migrated:
        encode(v)  # the new type's serializer accepts every migrated value
    array = resolution.migrate_array(pa.array(values, type=old))
    array.validate(full=True)
    assert array.type == new
    assert [norm(v, new) for v in array.to_pylist()] == expected
    chunked = resolution.migrate_array(pa.chunked_array([pa.array(values, type=old)]))
    assert [norm(v, new) for v in chunked.to_pylist()] == expected


S = pa.struct
F = pa.field
MAP = pa.map_
LIST = pa.list_

# (id, old, new, outcome, old value, migrated value, keyword arguments)
COMPATIBLE: list[tuple[str, pa.DataType, pa.DataType, SchemaCompatibility, Any, Any,
                       dict[str, Any]]] = [
    ("same int", pa.int64(), pa.int64(), AS_IS, 5, 5, {}),
    ("same struct from DDL", parse_type("a int, b string"), S([("a", pa.int32()),
                                                               ("b", pa.string())]),
     AS_IS, {"a": 1, "b": "x"}, {"a": 1, "b": "x"}, {}),
    ("int8 -> int16", pa.int8(), pa.int16(), MIGRATE, -128, -128, {}),
    ("int8 -> int64", pa.int8(), pa.int64(), MIGRATE, 127, 127, {}),
    ("int16 -> int64", pa.int16(), pa.int64(), MIGRATE, -32768, -32768, {}),
    ("int32 -> int64", pa.int32(), pa.int64(), MIGRATE, 2**31 - 1, 2**31 - 1, {}),
    ("uint32 -> int64", pa.uint32(), pa.int64(), MIGRATE, 2**32 - 1, 2**32 - 1, {}),
    ("float32 -> float64", pa.float32(), pa.float64(), MIGRATE, 1.5, 1.5, {}),
    ("int8 -> float64", pa.int8(), pa.float64(), MIGRATE, -3, -3.0, {}),
    ("int16 -> float64", pa.int16(), pa.float64(), MIGRATE, 300, 300.0, {}),
    ("int32 -> float64", pa.int32(), pa.float64(), MIGRATE, -(2**31), -(2.0**31), {}),
    ("date -> timestamp", pa.date32(), pa.timestamp("us", tz="UTC"), MIGRATE, D,
     dt.datetime(2024, 2, 29, tzinfo=UTC), {}),
    ("date -> timestamp_ntz", pa.date32(), pa.timestamp("us"), MIGRATE, D,
     dt.datetime(2024, 2, 29), {}),
    ("add nullable field", S([("a", pa.int64())]), S([("a", pa.int64()), ("b", pa.string())]),
     MIGRATE, {"a": 1}, {"a": 1, "b": None}, {}),
    ("add field with default", S([("a", pa.int64())]),
     S([("a", pa.int64()), F("b", pa.string(), nullable=False)]),
     MIGRATE, {"a": 1}, {"a": 1, "b": "n/a"}, {"defaults": {"b": "n/a"}}),
    ("add struct field with default", S([("a", pa.int64())]),
     S([("a", pa.int64()), ("p", S([("x", pa.int32())]))]),
     MIGRATE, {"a": 1}, {"a": 1, "p": {"x": 0}}, {"defaults": {"p": {"x": 0}}}),
    ("remove field", S([("a", pa.int64()), ("b", pa.string())]), S([("a", pa.int64())]),
     MIGRATE, {"a": 1, "b": "x"}, {"a": 1}, {}),
    ("reorder fields", S([("a", pa.int64()), ("b", pa.string())]),
     S([("b", pa.string()), ("a", pa.int64())]), MIGRATE, {"a": 1, "b": "x"},
     {"b": "x", "a": 1}, {}),
    ("rename with mapping", S([("zip_code", pa.string())]), S([("zip", pa.string())]),
     MIGRATE, {"zip_code": "75001"}, {"zip": "75001"}, {"renames": {"zip": "zip_code"}}),
    ("remove and add, declared new", S([("a", pa.int64()), ("b", pa.string())]),
     S([("a", pa.int64()), ("c", pa.string())]), MIGRATE, {"a": 1, "b": "x"},
     {"a": 1, "c": None}, {"defaults": {"c": None}}),
    ("field made nullable", S([F("a", pa.int64(), nullable=False)]), S([("a", pa.int64())]),
     MIGRATE, {"a": 1}, {"a": 1}, {}),
    ("nested struct widens and grows", parse_type("profile struct<address: struct<zip: int>>"),
     parse_type("profile struct<address: struct<zip: bigint, city: string>>"), MIGRATE,
     {"profile": {"address": {"zip": 75001}}},
     {"profile": {"address": {"zip": 75001, "city": None}}}, {}),
    ("nested default by path", parse_type("profile struct<address: struct<zip: int>>"),
     parse_type("profile struct<address: struct<zip: int, country: string>>"), MIGRATE,
     {"profile": {"address": {"zip": 1}}},
     {"profile": {"address": {"zip": 1, "country": "FR"}}},
     {"defaults": {"profile.address.country": "FR"}}),
    ("list element widens", LIST(pa.int32()), LIST(pa.int64()), MIGRATE, [1, None, 3],
     [1, None, 3], {}),
    ("list of structs evolves", parse_type("array<struct<page: string, ms: int>>"),
     parse_type("array<struct<ms: double, page: string, ref: string>>"), MIGRATE,
     [{"page": "/", "ms": 12}, None], [{"ms": 12.0, "page": "/", "ref": None}, None], {}),
    ("map value widens", MAP(pa.string(), pa.float32()), MAP(pa.string(), pa.float64()),
     MIGRATE, {"a": 0.5, "b": None}, {"a": 0.5, "b": None}, {}),
    ("map value struct evolves", parse_type("map<string, struct<best: int, n: int>>"),
     parse_type("map<string, struct<best: bigint>>"), MIGRATE,
     {"x": {"best": 3, "n": 9}}, {"x": {"best": 3}}, {}),
    ("null stays null", S([("a", pa.int32())]), S([("a", pa.int64()), ("b", pa.string())]),
     MIGRATE, None, None, {}),
]


@pytest.mark.parametrize("old,new,outcome,value,expected,kwargs",
                         [row[1:] for row in COMPATIBLE], ids=[row[0] for row in COMPATIBLE])
def test_compatible_rules(old: pa.DataType, new: pa.DataType, outcome: SchemaCompatibility,
                          value: Any, expected: Any, kwargs: dict[str, Any]) -> None:
    assert resolve_schema_compatibility("s", old, new, **kwargs).compatibility is outcome
    check_migration(old, new, [value, None], [expected, None], **kwargs)


# (id, old, new, the field path the error names, the old and new types it names, kwargs)
INCOMPATIBLE: list[tuple[str, pa.DataType, pa.DataType, str, str, str, dict[str, Any]]] = [
    ("int64 -> int32", pa.int64(), pa.int32(), "the value", "int64", "int32", {}),
    ("int64 -> double", pa.int64(), pa.float64(), "the value", "int64", "double", {}),
    ("int32 -> float", pa.int32(), pa.float32(), "the value", "int32", "float", {}),
    ("double -> float", pa.float64(), pa.float32(), "the value", "double", "float", {}),
    ("uint64 -> int64", pa.uint64(), pa.int64(), "the value", "uint64", "int64", {}),
    ("string -> bigint", pa.string(), pa.int64(), "the value", "string", "int64", {}),
    ("timestamp -> date", pa.timestamp("us", tz="UTC"), pa.date32(), "the value",
     "timestamp[us, tz=UTC]", "date32[day]", {}),
    ("timestamp_ntz -> timestamp", pa.timestamp("us"), pa.timestamp("us", tz="UTC"),
     "the value", "timestamp[us]", "timestamp[us, tz=UTC]", {}),
    ("nested narrowing", parse_type("profile struct<address: struct<zip: bigint>>"),
     parse_type("profile struct<address: struct<zip: int>>"), "'profile.address.zip'",
     "int64", "int32", {}),
    ("nested type change", parse_type("profile struct<address: struct<zip: string>>"),
     parse_type("profile struct<address: struct<zip: bigint>>"), "'profile.address.zip'",
     "string", "int64", {}),
    ("rename without mapping", parse_type("a int, zip_code string"),
     parse_type("a int, zip string"), "'zip'", "string", "string", {}),
    ("not-null field without default", S([("a", pa.int64())]),
     S([("a", pa.int64()), F("b", pa.int64(), nullable=False)]), "'b'", "null", "int64", {}),
    ("field made not null", S([("a", pa.int64())]), S([F("a", pa.int64(), nullable=False)]),
     "'a'", "int64", "int64", {}),
    ("map key change", MAP(pa.int32(), pa.string()), MAP(pa.int64(), pa.string()),
     "'{key}'", "int32", "int64", {}),
    ("nested map key change", parse_type("m map<string, int>"),
     parse_type("m map<binary, int>"), "'m{key}'", "string", "binary", {}),
    ("list element narrows", parse_type("visits array<struct<ms: bigint>>"),
     parse_type("visits array<struct<ms: int>>"), "'visits[].ms'", "int64", "int32", {}),
    ("map value type change", parse_type("scores map<string, struct<best: double>>"),
     parse_type("scores map<string, struct<best: string>>"), "'scores{}.best'", "double",
     "string", {}),
    ("struct -> list", S([("a", pa.int64())]), LIST(pa.int64()), "the value",
     "struct<a: int64>", "list<item: int64>", {}),
]


@pytest.mark.parametrize("old,new,where,old_name,new_name,kwargs",
                         [row[1:] for row in INCOMPATIBLE], ids=[row[0] for row in INCOMPATIBLE])
def test_incompatible_rules(old: pa.DataType, new: pa.DataType, where: str, old_name: str,
                            new_name: str, kwargs: dict[str, Any]) -> None:
    resolution = resolve_schema_compatibility("profiles", old, new, **kwargs)
    assert resolution.compatibility is SchemaCompatibility.INCOMPATIBLE
    assert isinstance(resolution.error, StateTypeMismatchError)
    message = str(resolution.error)
    assert "state 'profiles'" in message
    assert f"{where} was {old_name}, is now {new_name}" in message
    assert WAY_OUT in message
    with pytest.raises(StateTypeMismatchError):
        resolution.migrate({"a": 1})
    with pytest.raises(StateTypeMismatchError):
        resolution.raise_if_incompatible()


def test_not_null_without_default_says_what_to_do() -> None:
    new = S([("a", pa.int64()), F("b", pa.int64(), nullable=False)])
    message = str(resolve_schema_compatibility("s", S([("a", pa.int64())]), new).error)
    assert "not null without a default" in message and "defaults={'b': ...}" in message


def test_rename_suspicion_says_both_ways_out() -> None:
    error = resolve_schema_compatibility("s", parse_type("zip_code string"),
                                         parse_type("zip string")).error
    assert error is not None and "renames=" in str(error) and "defaults=" in str(error)


def test_defaults_and_renames_must_name_added_fields() -> None:
    with pytest.raises(ConfigurationError, match="'typo'"):
        resolve_schema_compatibility("s", parse_type("a int"), parse_type("a int, b string"),
                                     defaults={"typo": 1})
    with pytest.raises(ConfigurationError, match="int64"):
        resolve_schema_compatibility("s", parse_type("a int"), parse_type("a int, b bigint"),
                                     defaults={"b": "not a number"})
    with pytest.raises(ConfigurationError, match="'nope'"):
        resolve_schema_compatibility("s", parse_type("a int"), parse_type("b int"),
                                     renames={"b": "nope"})


def test_struct_defaults_are_fresh_objects() -> None:
    resolution = resolve_schema_compatibility(
        "s", parse_type("a int"), parse_type("a int, tags array<string>"),
        defaults={"tags": []})
    first, second = resolution.migrate({"a": 1}), resolution.migrate({"a": 2})
    first["tags"].append("x")
    assert second["tags"] == []


def test_migration_does_not_mutate_the_old_value() -> None:
    old_value = {"a": 1, "b": {"c": 2}}
    resolution = resolve_schema_compatibility("s", parse_type("a int, b struct<c: int>"),
                                              parse_type("b struct<c: bigint>"))
    assert resolution.migrate(old_value) == {"b": {"c": 2}}
    assert old_value == {"a": 1, "b": {"c": 2}}


def test_sliced_arrays_with_nulls_migrate() -> None:
    old = parse_type("l array<int>, m map<string, int>")
    new = parse_type("m map<string, bigint>, l array<bigint>")
    values = [{"l": [1], "m": {"a": 1}}, None, {"l": None, "m": None},
              {"l": [2, 3], "m": {"b": 2, "c": None}}]
    resolution = resolve_schema_compatibility("s", old, new)
    array = resolution.migrate_array(pa.array(values, type=old).slice(1))
    array.validate(full=True)
    assert [norm(v, new) for v in array.to_pylist()] == [resolution.migrate(v)
                                                         for v in values[1:]]


@pytest.mark.parametrize("old_kind,new_kind,old_key,new_key,reason", [
    ("value", "list", None, None, "its kind was value, is now list"),
    ("map", "map", pa.string(), pa.int64(), "its map key type was string, is now int64"),
])
def test_state_kind_and_map_key_never_change(old_kind: str, new_kind: str,
                                             old_key: pa.DataType | None,
                                             new_key: pa.DataType | None, reason: str) -> None:
    resolution = resolve_state_compatibility("s", old_kind, new_kind, pa.int64(), pa.int64(),
                                             old_key, new_key)
    assert resolution.compatibility is SchemaCompatibility.INCOMPATIBLE
    assert reason in str(resolution.error) and WAY_OUT in str(resolution.error)


def test_state_with_same_kind_resolves_its_value_type() -> None:
    resolution = resolve_state_compatibility("s", "map", "map", pa.int32(), pa.int64(),
                                             pa.string(), pa.string())
    assert resolution.compatibility is MIGRATE and resolution.migrate(3) == 3


# --------------------------------------------------------------------------------------------
# Hypothesis: random nested struct schemas, one random evolution step
# --------------------------------------------------------------------------------------------

#: a leaf type, the type it widens to, and the widening of one value (written independently)
WIDENINGS: list[tuple[pa.DataType, pa.DataType, Any]] = [
    (pa.int8(), pa.int64(), lambda v: v),
    (pa.int16(), pa.int64(), lambda v: v),
    (pa.int32(), pa.int64(), lambda v: v),
    (pa.int32(), pa.float64(), float),
    (pa.float32(), pa.float64(), lambda v: v),
    (pa.date32(), pa.timestamp("us", tz="UTC"),
     lambda d: dt.datetime.combine(d, dt.time(), tzinfo=UTC)),
]
LEAVES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.float32(), pa.float64(),
          pa.date32(), pa.string()]
NAMES = st.text("abcdefgh", min_size=1, max_size=3)


def types(depth: int) -> st.SearchStrategy[pa.DataType]:
    leaf = st.sampled_from(LEAVES)
    if depth == 0:
        return leaf
    return st.one_of(leaf, structs(depth - 1), leaf.map(pa.list_),
                     leaf.map(lambda t: pa.map_(pa.string(), t)))


def structs(depth: int) -> st.SearchStrategy[pa.DataType]:
    return st.lists(st.tuples(NAMES, types(depth)), min_size=1, max_size=4,
                    unique_by=lambda f: f[0]).map(pa.struct)


def values(t: pa.DataType) -> st.SearchStrategy[Any]:
    if pa.types.is_struct(t):
        inner: st.SearchStrategy[Any] = st.fixed_dictionaries(
            {t.field(i).name: values(t.field(i).type) for i in range(t.num_fields)})
    elif pa.types.is_list(t):
        inner = st.lists(values(t.value_type), max_size=3)
    elif pa.types.is_map(t):
        inner = st.dictionaries(st.text(max_size=2), values(t.item_type), max_size=3)
    elif pa.types.is_integer(t):
        bound = 1 << (t.bit_width - 1)
        inner = st.integers(-bound, bound - 1)
    elif pa.types.is_float32(t):
        inner = st.floats(width=32, allow_nan=False)
    elif pa.types.is_float64(t):
        inner = st.floats(allow_nan=False)
    elif pa.types.is_date32(t):
        inner = st.dates()
    else:
        inner = st.text(max_size=3)
    return st.none() | inner


def struct_paths(t: pa.StructType, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths of every struct reachable through struct fields alone (the root is ())."""
    paths = [prefix]
    for i in range(t.num_fields):
        if pa.types.is_struct(t.field(i).type):
            paths += struct_paths(t.field(i).type, (*prefix, t.field(i).name))
    return paths


def at(t: pa.StructType, path: tuple[str, ...]) -> pa.StructType:
    for name in path:
        t = t.field(name).type
    return t


def replace(t: pa.StructType, path: tuple[str, ...], new: pa.StructType) -> pa.StructType:
    if not path:
        return new
    head, rest = path[0], path[1:]
    return pa.struct([pa.field(f.name, replace(f.type, rest, new)) if f.name == head else f
                      for f in t])


def apply(value: Any, path: tuple[str, ...], step: Any) -> Any:
    """The expected new value: ``step`` rebuilds the dict at ``path`` by field name."""
    if value is None:
        return None
    if not path:
        return step(value)
    return {k: apply(x, path[1:], step) if k == path[0] else x for k, x in value.items()}


@st.composite
def evolutions(draw: st.DrawFn) -> tuple[pa.DataType, pa.DataType, Any, Any]:
    old = draw(structs(2))
    path = draw(st.sampled_from(struct_paths(old)))
    node = at(old, path)
    fields = list(node)
    names = [f.name for f in fields]
    widenable = [f for f in fields if any(f.type == w[0] for w in WIDENINGS)]
    ops = ["identity", "add", "reorder"] + (["remove"] if len(fields) > 1 else []) + (
        ["widen"] if widenable else [])
    op = draw(st.sampled_from(ops))
    event(f"{op} at depth {len(path)}")
    step: Any
    if op == "identity":
        new_node, step = node, dict
    elif op == "add":
        name = draw(NAMES.filter(lambda n: n not in names))
        added = draw(types(1))
        new_node = pa.struct([*fields, pa.field(name, added)])
        step = lambda v: {**v, name: None}  # noqa: E731
    elif op == "reorder":
        order = draw(st.permutations(names))
        new_node = pa.struct([node.field(n) for n in order])
        step = lambda v: {n: v[n] for n in order}  # noqa: E731
    elif op == "remove":
        gone = draw(st.sampled_from(names))
        new_node = pa.struct([f for f in fields if f.name != gone])
        step = lambda v: {k: x for k, x in v.items() if k != gone}  # noqa: E731
    else:
        target = draw(st.sampled_from(widenable))
        _, wide, widen = draw(st.sampled_from([w for w in WIDENINGS if w[0] == target.type]))
        new_node = pa.struct([pa.field(f.name, wide) if f.name == target.name else f
                              for f in fields])
        step = lambda v: {k: (None if x is None else widen(x)) if k == target.name else x  # noqa: E731
                          for k, x in v.items()}
    new = replace(old, path, new_node)
    value = draw(values(old))
    return old, new, value, apply(value, path, step)


@settings(max_examples=budget(200), deadline=None)
@given(evolutions())
def test_one_evolution_step_migrates_by_field_name(
        case: tuple[pa.DataType, pa.DataType, Any, Any]) -> None:
    old, new, value, expected = case
    resolution = resolve_schema_compatibility("s", old, new)
    assert resolution.compatibility is (AS_IS if old == new else MIGRATE)
    check_migration(old, new, [value], [expected])


def test_recorded_type_strings_lose_map_value_nullability() -> None:
    """Pins what docs/schema-evolution.md says of today's recorded types: restore with
    evolution must compare the strings before parsing the recorded one."""
    from keyedstate.serde import type_from_string

    not_null = pa.map_(pa.string(), pa.field("value", pa.int64(), nullable=False))
    assert str(not_null) == str(pa.map_(pa.string(), pa.int64()))
    assert type_from_string(str(not_null)) == pa.map_(pa.string(), pa.int64())
    assert not resolve_schema_compatibility(
        "s", type_from_string(str(not_null)), not_null).is_compatible
    nested = parse_type("p struct<a: array<struct<b: map<string, decimal(38,18)>>>>")
    assert type_from_string(str(nested)) == nested
