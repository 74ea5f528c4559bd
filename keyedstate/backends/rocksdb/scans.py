"""Whole-state passes over one state's column family: the full-snapshot cleanup of expired
entries, rewriting every value (state migration, TTL switched), and reading every record or
entry (canonical savepoints, the state processor)."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import rocksdict

from keyedstate.backends.base.backend import StateEntry, StateRecord
from keyedstate.backends.rocksdb.instance import RocksDBInstance
from keyedstate.backends.rocksdb.key_layout import TS_BYTES, split_state_key, unpack_timestamp
from keyedstate.backends.rocksdb.native import column_family_batch, native, rocksdb_error, scan
from keyedstate.serde import TypeSerializer
from keyedstate.state.descriptors import StateKind

#: Entries per write batch of a whole-state write (:func:`rewrite_values`,
#: :meth:`~.keyed_backend.RocksDBKeyedStateBackend.load_records`).
LOAD_BATCH = 10_000


def purge_expired(db: rocksdict.Rdict, cf: rocksdict.Rdict, handle: rocksdict.ColumnFamily, *,
                  name: str, ttl_ms: int, now_ms: int,
                  write_options: rocksdict.WriteOptions) -> int:
    """Delete every expired entry of one TTL state's column family (before a full snapshot, so
    a restore can never bring them back); returns how many went."""
    what = f"removing expired entries of state {name!r} before a full snapshot"
    batch = column_family_batch(handle)
    removed = 0
    for key, raw in scan(cf, None, None, what):
        if unpack_timestamp(raw) + ttl_ms <= now_ms:
            batch.delete(key)
            removed += 1
    if removed:
        try:
            db.write(batch, write_options)
        except Exception as exc:
            raise rocksdb_error(exc, what) from exc
    return removed


def iter_state_records(cf: rocksdict.Rdict, *, name: str, kind: str,
                       value_serializer: TypeSerializer,
                       user_key_serializer: TypeSerializer | None, ttl_ms: int | None,
                       now_ms: int, key_group_prefix_bytes: int) -> Iterator[StateRecord]:
    """Every live element of one state's column family with its TTL timestamp, in key order
    (so by key group, and list elements in list order)."""
    deser = value_serializer.deserialize
    user_deser = None if user_key_serializer is None else user_key_serializer.deserialize
    for raw_key, raw in scan(cf, None, None, f"reading every record of state {name!r}"):
        ts = None
        if ttl_ms is not None:
            ts = unpack_timestamp(raw)
            if ts + ttl_ms <= now_ms:
                continue
            raw = raw[TS_BYTES:]
        key_group, key, namespace, rest = split_state_key(raw_key, key_group_prefix_bytes)
        user_key = None
        if kind == StateKind.MAP:
            assert user_deser is not None
            user_key = user_deser(rest)
        yield StateRecord(key_group, key, namespace, user_key, deser(raw), ts)


def iter_state_entries(cf: rocksdict.Rdict, *, name: str, kind: str,
                       value_serializer: TypeSerializer,
                       user_key_serializer: TypeSerializer | None, ttl_ms: int | None,
                       now_ms: int, key_group_prefix_bytes: int) -> Iterator[StateEntry]:
    """Every live entry of one state's column family, in key order (so by key group). A list
    becomes one entry holding its live elements; expired values and elements are left out."""
    deser = value_serializer.deserialize
    pending: tuple[int, bytes, bytes] | None = None
    elements: list[Any] = []
    for raw_key, raw in scan(cf, None, None, f"reading every entry of state {name!r}"):
        if ttl_ms is not None:
            if unpack_timestamp(raw) + ttl_ms <= now_ms:
                continue
            raw = raw[TS_BYTES:]
        key_group, key, namespace, rest = split_state_key(raw_key, key_group_prefix_bytes)
        if kind == StateKind.LIST:
            if pending != (key_group, key, namespace):
                if pending is not None and elements:
                    yield StateEntry(*pending, None, elements)
                pending, elements = (key_group, key, namespace), []
            elements.append(deser(raw))
            continue
        user_key = None
        if kind == StateKind.MAP:
            assert user_key_serializer is not None
            user_key = user_key_serializer.deserialize(rest)
        yield StateEntry(key_group, key, namespace, user_key, deser(raw))
    if pending is not None and elements:
        yield StateEntry(*pending, None, elements)


def rewrite_values(instances: Sequence[RocksDBInstance], name: str, what: str,
                   rewrite: Callable[[bytes], bytes | None],
                   write_options: rocksdict.WriteOptions) -> None:
    """Replace every stored value of state ``name`` by ``rewrite(value)`` (None deletes
    the entry): one scan per instance, write batches of :data:`LOAD_BATCH` entries. The
    scan's iterator reads the state as it was before the first write."""
    for instance in instances:
        cf, handle = instance.column_family(name)
        batch, pending = column_family_batch(handle), 0
        for raw_key, raw in scan(cf, None, None, what):
            value = rewrite(raw)
            if value is None:
                batch.delete(raw_key)
            else:
                batch.put(raw_key, value)
            pending += 1
            if pending == LOAD_BATCH:
                with native(what):
                    instance.db.write(batch, write_options)
                batch, pending = column_family_batch(handle), 0
        with native(what):
            instance.db.write(batch, write_options)
