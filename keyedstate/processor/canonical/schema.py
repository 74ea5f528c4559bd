"""The Arrow side of canonical savepoints: type strings, file schemas, and conversions between
:class:`~keyedstate.backends.base.backend.StateRecord` streams and Arrow tables.

A state's file holds one row per record (:mod:`keyedstate.processor.canonical` lays the files
out; ``docs/canonical-format.md`` is the reference)::

    key_group      int32                the key's key group at the savepoint's max parallelism
    <key columns>  the key types        named after the job's key columns
    namespace      binary               serialize_namespace bytes (VOID_NAMESPACE for None)
    map_key        map key type|binary  map states only; binary = pickled
    position       int32                list states only: the element's index in its list
    value          value type|binary    binary = pickled (untyped descriptor)
    ttl_timestamp  timestamp[us, UTC]   TTL states only: the element's last access

Timer files: ``domain`` (``event_time`` / ``processing_time``), ``timestamp`` (int64 ms),
``key_group``, the key columns, ``namespace``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from keyedstate.backends.base.backend import StateRecord
from keyedstate.errors import ConfigurationError, CorruptCheckpointError, SerializationError
from keyedstate.keys import KeySerializer
from keyedstate.serde import (
    PickleSerializer,
    deserialize_namespace,
    type_from_string,
)
from keyedstate.state.descriptors import StateKind
from keyedstate.state.timers import TimeDomain, Timer
from keyedstate.storage.handles import StateMetaInfo

#: Version of the canonical layout (files, columns); recorded in ``_metadata`` properties.
CANONICAL_FORMAT_VERSION = 1

KEY_GROUP = "key_group"
NAMESPACE = "namespace"
MAP_KEY = "map_key"
POSITION = "position"
VALUE = "value"
TTL_TIMESTAMP = "ttl_timestamp"
DOMAIN = "domain"
TIMESTAMP = "timestamp"
#: Column names a key column may not take.
RESERVED_COLUMNS = frozenset({KEY_GROUP, NAMESPACE, MAP_KEY, POSITION, VALUE, TTL_TIMESTAMP,
                              DOMAIN, TIMESTAMP})
#: Parquet key-value metadata describing the file (JSON), for readers without keyedstate.
SCHEMA_METADATA_KEY = b"keyedstate.canonical"
TTL_ARROW_TYPE = pa.timestamp("us", tz="UTC")
PICKLE = PickleSerializer.type_string

# --------------------------------------------------------------------------------------------
# type strings
# --------------------------------------------------------------------------------------------

def column_type(type_string: str) -> pa.DataType:
    """The column type of values of a type string: the type itself, binary for pickled ones."""
    return pa.binary() if type_string == PICKLE else type_from_string(type_string)


# --------------------------------------------------------------------------------------------
# schemas
# --------------------------------------------------------------------------------------------


def default_key_columns(count: int) -> list[str]:
    """``key``, ``key_1``, ``key_2`` ...: key column names when the snapshot records none."""
    return ["key", *(f"key_{i}" for i in range(1, count))]


def check_key_columns(key_columns: Sequence[str], key_types: Sequence[pa.DataType]) -> None:
    """Raise :class:`ConfigurationError` unless the names fit the key types and no name is a
    column of the canonical layout."""
    if len(key_columns) != len(key_types):
        raise ConfigurationError(
            f"key columns {list(key_columns)} don't match the {len(key_types)} key types "
            f"{[str(t) for t in key_types]}; name one column per key type"
        )
    clash = sorted(set(key_columns) & RESERVED_COLUMNS)
    if clash or len(set(key_columns)) != len(key_columns) or not all(key_columns):
        raise ConfigurationError(
            f"key columns {list(key_columns)} can't be used in a canonical savepoint: names must "
            f"be unique, non-empty and none of {sorted(RESERVED_COLUMNS)}; pass other names "
            f"(key_columns=...)"
        )


def _file_metadata(body: dict[str, Any]) -> dict[bytes, bytes]:
    return {SCHEMA_METADATA_KEY: json.dumps({"format_version": CANONICAL_FORMAT_VERSION,
                                             **body}).encode()}


def state_schema(meta: StateMetaInfo, key_columns: Sequence[str],
                 key_types: Sequence[pa.DataType]) -> pa.Schema:
    """The schema of a state's canonical files (see the module docstring)."""
    check_key_columns(key_columns, key_types)
    fields = [pa.field(KEY_GROUP, pa.int32(), nullable=False),
              *(pa.field(n, t) for n, t in zip(key_columns, key_types)),
              pa.field(NAMESPACE, pa.binary(), nullable=False)]
    if meta.kind == StateKind.MAP:
        assert meta.user_key_type is not None
        fields.append(pa.field(MAP_KEY, column_type(meta.user_key_type)))
    if meta.kind == StateKind.LIST:
        fields.append(pa.field(POSITION, pa.int32(), nullable=False))
    fields.append(pa.field(VALUE, column_type(meta.value_type)))
    if meta.ttl_ms is not None:
        fields.append(pa.field(TTL_TIMESTAMP, TTL_ARROW_TYPE, nullable=False))
    return pa.schema(fields, metadata=_file_metadata({
        "state": {"name": meta.name, "kind": meta.kind, "value_type": meta.value_type,
                  "user_key_type": meta.user_key_type, "ttl_ms": meta.ttl_ms},
        "key_columns": list(key_columns)}))


def timer_schema(key_columns: Sequence[str], key_types: Sequence[pa.DataType]) -> pa.Schema:
    """The schema of the timer files."""
    check_key_columns(key_columns, key_types)
    return pa.schema([pa.field(DOMAIN, pa.string(), nullable=False),
                      pa.field(TIMESTAMP, pa.int64(), nullable=False),
                      pa.field(KEY_GROUP, pa.int32(), nullable=False),
                      *(pa.field(n, t) for n, t in zip(key_columns, key_types)),
                      pa.field(NAMESPACE, pa.binary(), nullable=False)],
                     metadata=_file_metadata({"timers": True,
                                              "key_columns": list(key_columns)}))


def check_schema(actual: pa.Schema, expected: pa.Schema, source: str) -> None:
    """Raise :class:`CorruptCheckpointError` unless the columns are the expected ones."""
    got = [(f.name, f.type) for f in actual]
    want = [(f.name, f.type) for f in expected]
    if got != want:
        raise CorruptCheckpointError(
            f"{source} has columns {[(n, str(t)) for n, t in got]}, the savepoint's metadata "
            f"expects {[(n, str(t)) for n, t in want]}; the file was replaced. Restore from "
            f"another savepoint"
        )


# --------------------------------------------------------------------------------------------
# Python values <-> Arrow
# --------------------------------------------------------------------------------------------


def _fixer(type_: pa.DataType) -> Callable[[Any], Any] | None:
    """A function turning ``to_pylist`` output of ``type_`` into the values the state API uses
    (maps as dicts, not lists of pairs); None when nothing needs turning."""
    if pa.types.is_map(type_):
        fix_key, fix_item = _fixer(type_.key_type), _fixer(type_.item_type)
        fk = fix_key or (lambda v: v)
        fi = fix_item or (lambda v: v)
        return lambda v: None if v is None else {fk(k): fi(x) for k, x in v}
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        item = _fixer(type_.value_type)
        if item is None:
            return None
        return lambda v: None if v is None else [item(x) for x in v]
    if pa.types.is_struct(type_):
        fixes: dict[str, Callable[[Any], Any]] = {}
        for i in range(type_.num_fields):
            fix = _fixer(type_.field(i).type)
            if fix is not None:
                fixes[type_.field(i).name] = fix
        if not fixes:
            return None
        return lambda v: None if v is None else {n: (fixes[n](x) if n in fixes else x)
                                                  for n, x in v.items()}
    return None


def python_values(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """The values of a typed column as the state API takes them."""
    values = column.to_pylist()
    fix = _fixer(column.type)
    return values if fix is None else [fix(v) for v in values]


def _column(values: list[Any], type_string: str, what: str) -> pa.Array:
    if type_string == PICKLE:
        ser = PickleSerializer().serialize
        return pa.array([ser(v) for v in values], pa.binary())
    try:
        return pa.array(values, type=type_from_string(type_string))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        raise SerializationError(f"{what} do not fit type {type_string}: {exc}") from exc


class KeyColumns:
    """Decodes stored key bytes into typed key columns, once per distinct consecutive key."""

    def __init__(self, key_serializer: KeySerializer) -> None:
        self.key_serializer = key_serializer
        self.types = list(key_serializer.arrow_types or [])
        self._last: bytes | None = None
        self._last_key: tuple[Any, ...] = ()

    def columns(self, key_bytes: Iterable[bytes]) -> list[pa.Array]:
        cols: list[list[Any]] = [[] for _ in self.types]
        single = len(self.types) == 1
        for kb in key_bytes:
            if kb != self._last:
                key = self.key_serializer.deserialize(kb)
                self._last, self._last_key = kb, ((key,) if single else key)
            for col, v in zip(cols, self._last_key):
                col.append(v)
        return [pa.array(c, type=t) for c, t in zip(cols, self.types)]


def records_table(records: Sequence[StateRecord], meta: StateMetaInfo, schema: pa.Schema,
                  keys: KeyColumns, positions: dict[tuple[int, bytes, bytes], int] | None = None
                  ) -> pa.Table:
    """The canonical rows of ``records`` (one state). ``positions`` carries the next list
    position per (key group, key, namespace) across successive chunks of one list state."""
    arrays: list[pa.Array] = [pa.array([r.key_group for r in records], pa.int32()),
                              *keys.columns(r.key_bytes for r in records),
                              pa.array([r.namespace_bytes for r in records], pa.binary())]
    what = f"state {meta.name!r}:"
    if meta.kind == StateKind.MAP:
        assert meta.user_key_type is not None
        arrays.append(_column([r.user_key for r in records], meta.user_key_type,
                              f"{what} map keys"))
    if meta.kind == StateKind.LIST:
        assert positions is not None
        out = []
        for r in records:
            ident = (r.key_group, r.key_bytes, r.namespace_bytes)
            n = positions.get(ident, 0)
            positions[ident] = n + 1
            out.append(n)
        arrays.append(pa.array(out, pa.int32()))
    arrays.append(_column([r.value for r in records], meta.value_type, f"{what} values"))
    if meta.ttl_ms is not None:
        arrays.append(pa.array([(r.ttl_timestamp or 0) * 1000 for r in records],
                               pa.int64()).cast(TTL_ARROW_TYPE))
    return pa.Table.from_arrays(arrays, schema=schema)


def drop_expired(table: pa.Table, ttl_ms: int | None, now_ms: int) -> pa.Table:
    """Rows whose TTL has not run out at ``now_ms`` (Flink: expired once last + ttl <= now)."""
    if ttl_ms is None or table.num_rows == 0:
        return table
    last_us = table.column(TTL_TIMESTAMP).cast(pa.int64())
    return table.filter(pc.greater(pc.add(last_us, ttl_ms * 1000), now_ms * 1000))


def table_records(table: pa.Table, meta: StateMetaInfo, key_columns: Sequence[str],
                  key_serializer: KeySerializer, max_parallelism: int, source: str
                  ) -> Iterator[StateRecord]:
    """The records of canonical rows (list rows must be in position order per list). Each
    row's key group is checked against its key (:class:`CorruptCheckpointError` naming
    ``source``); pickled values and map keys are unpickled."""
    n = table.num_rows
    if n == 0:
        return
    kgs = table.column(KEY_GROUP).to_pylist()
    key_cols = [python_values(table.column(c)) for c in key_columns]
    keys = key_cols[0] if len(key_cols) == 1 else list(zip(*key_cols))
    namespaces = table.column(NAMESPACE).to_pylist()
    values = _decoded(table.column(VALUE), meta.value_type)
    user_keys = _decoded(table.column(MAP_KEY), meta.user_key_type or PICKLE) \
        if meta.kind == StateKind.MAP else [None] * n
    ttls = [v // 1000 for v in table.column(TTL_TIMESTAMP).cast(pa.int64()).to_pylist()] \
        if meta.ttl_ms is not None else [None] * n
    last_key: Any = object()
    key_bytes, key_group = b"", -1
    for i in range(n):
        key = keys[i]
        if key != last_key:
            last_key = key
            key_bytes, key_group = key_serializer.serialize_with_key_group(key, max_parallelism)
        if key_group != kgs[i]:
            raise CorruptCheckpointError(
                f"{source}: the row of key {key!r} says key group {kgs[i]}, the key belongs to "
                f"key group {key_group} at max parallelism {max_parallelism}; the savepoint was "
                f"not written for these key types. Restore from another savepoint"
            )
        yield StateRecord(key_group, key_bytes, namespaces[i], user_keys[i], values[i], ttls[i])


def _decoded(column: pa.ChunkedArray, type_string: str) -> list[Any]:
    if type_string == PICKLE:
        de = PickleSerializer().deserialize
        return [None if b is None else de(b) for b in column.to_pylist()]
    return python_values(column)


# --------------------------------------------------------------------------------------------
# timers
# --------------------------------------------------------------------------------------------


def timers_table(timers: Sequence[tuple[TimeDomain, Timer]], schema: pa.Schema,
                 keys: KeyColumns) -> pa.Table:
    return pa.Table.from_arrays([
        pa.array([str(d) for d, _ in timers], pa.string()),
        pa.array([t.timestamp for _, t in timers], pa.int64()),
        pa.array([t.key_group for _, t in timers], pa.int32()),
        *keys.columns(t.key_bytes for _, t in timers),
        pa.array([t.namespace_bytes for _, t in timers], pa.binary()),
    ], schema=schema)


def table_timers(table: pa.Table, key_columns: Sequence[str], key_serializer: KeySerializer,
                 max_parallelism: int, source: str) -> Iterator[tuple[TimeDomain, Timer, Any]]:
    """``(domain, timer, namespace)`` of timer rows, key groups checked as in
    :func:`table_records`."""
    domains = table.column(DOMAIN).to_pylist()
    stamps = table.column(TIMESTAMP).to_pylist()
    kgs = table.column(KEY_GROUP).to_pylist()
    key_cols = [python_values(table.column(c)) for c in key_columns]
    keys = key_cols[0] if len(key_cols) == 1 else list(zip(*key_cols))
    namespaces = table.column(NAMESPACE).to_pylist()
    for i in range(table.num_rows):
        try:
            domain = TimeDomain(domains[i])
        except ValueError:
            raise CorruptCheckpointError(f"{source}: unknown timer domain {domains[i]!r}") from None
        key_bytes, key_group = key_serializer.serialize_with_key_group(keys[i], max_parallelism)
        if key_group != kgs[i]:
            raise CorruptCheckpointError(
                f"{source}: the timer of key {keys[i]!r} says key group {kgs[i]}, the key belongs "
                f"to key group {key_group}; restore from another savepoint"
            )
        yield domain, Timer(stamps[i], key_group, key_bytes, namespaces[i]), \
            deserialize_namespace(namespaces[i])
