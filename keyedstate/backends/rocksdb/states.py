"""The five state kinds over RocksDB column families (their bytes: :mod:`.key_layout`; what
they share: :mod:`.base_state`; what they read of their keyed backend:
:class:`.RocksDBKeyContext`).

Bulk calls (``get_many``, ``update_many``, ...) build the keys of all their keys from the
backend's per-batch prefixes (:meth:`.RocksDBKeyContext.bulk_key_prefixes`, the bytes
``set_current_key`` builds), read with one point lookup per key (faster than rocksdict's
multi-get, see ``RocksDBState._multi_get``) and write with one write batch per instance: the same bytes as
the per-key calls, in the same order (list sequence numbers included).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import rocksdict

from keyedstate.backends.rocksdb.base_state import RocksDBCachedState, RocksDBState
from keyedstate.backends.rocksdb.instance import RocksDBInstance
from keyedstate.backends.rocksdb.key_context import RocksDBKeyContext
from keyedstate.backends.rocksdb.key_layout import SEQUENCE
from keyedstate.backends.rocksdb.native import prefix_upper_bound, rocksdb_error, scan
from keyedstate.backends.rocksdb.value_cache import ABSENT, ENTRY_OVERHEAD
from keyedstate.errors import KeyedStateError
from keyedstate.serde import TypeSerializer
from keyedstate.state.api import AggregatingState, ListState, MapState, ReducingState, ValueState
from keyedstate.state.batch_keys import BatchKeys, values_of
from keyedstate.state.descriptors import StateDescriptor, StateKind, ValueStateDescriptor

# Bound once: list elements' sequence numbers are packed inline.
_SEQ = SEQUENCE.pack


class RocksDBValueState(RocksDBState, ValueState[Any]):
    def __init__(self, context: RocksDBKeyContext, descriptor: StateDescriptor,
                 instance: RocksDBInstance) -> None:
        super().__init__(context, descriptor, instance)
        assert isinstance(descriptor, ValueStateDescriptor)
        self._default = descriptor.default

    # The hot path: the key check is inlined (no _key() call) and TTL costs one branch.

    def value(self) -> Any:
        kp = self._context.key_prefix
        key = self._full if kp is self._kp else self._rekey(kp)
        if self._ttl is None:
            try:
                raw = self._get(key)
            except Exception as exc:
                raise rocksdb_error(exc, self._what) from exc
        else:
            raw = self._read(key)
        return self._default if raw is None else self._deser(raw)

    def update(self, value: Any) -> None:
        if value is None:
            self.clear()
            return
        kp = self._context.key_prefix
        key = self._full if kp is self._kp else self._rekey(kp)
        if self._ttl is None:
            try:
                self._put(key, self._ser(value))
            except KeyedStateError:
                raise
            except Exception as exc:
                raise rocksdb_error(exc, self._what) from exc
        else:
            self._write(key, self._ser(value))

    def get_many(self, keys: BatchKeys) -> list[Any]:
        default, deser = self._default, self._deser
        return [default if raw is None else deser(raw)
                for raw in self._read_many(keys, self._bulk_keys(keys))]

    def update_many(self, keys: BatchKeys, values: Any) -> None:
        ser = self._ser
        payloads = [None if v is None else ser(v) for v in values_of(keys, values)]
        # A None clears, and clear() does no cleanup step: only the writes count as accesses.
        if self._ttl is not None:
            self._cleanup_steps(sum(p is not None for p in payloads))
        self._put_many(keys, self._bulk_keys(keys), payloads, cleanup=False)


class RocksDBListState(RocksDBState, ListState[Any]):
    def get(self) -> list[Any]:
        base = self._key()
        deser = self._deser
        if self._ttl is None:
            return [deser(raw) for _, raw in self._scan_prefix(base)]
        self._cleanup_step()
        now, batch, out = self._now(), self._batch(), []
        for key, raw in self._scan_prefix(base):
            live = self._live(key, raw, now, batch)
            if live is not None:
                out.append(deser(live))
        self._commit(batch)
        return out

    def add(self, value: Any) -> None:
        self._write(self._key() + _SEQ(self._context.next_list_seq()), self._ser(value))

    def add_all(self, values: Iterable[Any]) -> None:
        base = self._key()
        batch = self._batch()
        self._append(batch, base, values)
        self._commit(batch)

    def update(self, values: Iterable[Any]) -> None:
        base = self._key()
        batch = self._batch()
        self._delete_prefix(base, batch)
        self._append(batch, base, values)
        self._commit(batch)

    def _append(self, batch: rocksdict.WriteBatch, base: bytes, values: Iterable[Any]) -> None:
        ser, wrap, seq = self._ser, self._wrap, self._context.next_list_seq
        for value in values:
            batch.put(base + _SEQ(seq()), wrap(ser(value)))

    def clear(self) -> None:
        base = self._key()
        batch = self._batch()
        self._delete_prefix(base, batch)
        self._commit(batch)

    def get_many(self, keys: BatchKeys) -> list[list[Any]]:
        bases = self._bulk_keys(keys)
        targets = self._bulk_targets(keys)
        deser, what = self._deser, self._what
        out: list[list[Any]] = []
        if self._ttl is None:
            for base, cf in zip(bases, targets.cf_of):
                out.append([deser(raw) for _, raw in
                            scan(cf, base, prefix_upper_bound(base), what)])
            return out
        self._cleanup_steps(len(bases))
        now, live = self._now(), self._live
        for base, cf, batch in zip(bases, targets.cf_of, targets.batch_of):
            elements = []
            for key, raw in scan(cf, base, prefix_upper_bound(base), what):
                payload = live(key, raw, now, batch)
                if payload is not None:
                    elements.append(deser(payload))
            out.append(elements)
        targets.commit()
        return out

    def add_many(self, keys: BatchKeys, elements: Any) -> None:
        bases = self._bulk_keys(keys)
        targets = self._bulk_targets(keys)
        for base, values, batch in zip(bases, values_of(keys, elements, "element lists"),
                                       targets.batch_of):
            self._append(batch, base, values)
        targets.commit()

    def clear_many(self, keys: BatchKeys) -> None:
        _clear_prefixes(self, keys)


class RocksDBMapState(RocksDBState, MapState[Any, Any]):
    def __init__(self, context: RocksDBKeyContext, descriptor: StateDescriptor,
                 instance: RocksDBInstance) -> None:
        super().__init__(context, descriptor, instance)
        user_key: TypeSerializer = descriptor.user_key_serializer  # type: ignore[assignment]
        self._user_ser = user_key.serialize
        self._user_deser = user_key.deserialize

    def get(self, key: Any) -> Any:
        raw = self._read(self._key() + self._user_ser(key))
        return None if raw is None else self._deser(raw)

    def put(self, key: Any, value: Any) -> None:
        self._write(self._key() + self._user_ser(key), self._ser(value))

    def put_all(self, mapping: dict[Any, Any]) -> None:
        base, batch = self._key(), self._batch()
        for k, v in mapping.items():
            batch.put(base + self._user_ser(k), self._wrap(self._ser(v)))
        self._commit(batch)

    def remove(self, key: Any) -> None:
        # The key first: computing it rebinds ``_delete`` to the current key's instance.
        full = self._key() + self._user_ser(key)
        self._native(self._delete, full)

    def contains(self, key: Any) -> bool:
        return self._read(self._key() + self._user_ser(key)) is not None

    def items(self) -> Iterator[tuple[Any, Any]]:
        base = self._key()
        start = len(base)
        if self._ttl is not None:
            self._cleanup_step()
        now = self._now() if self._ttl is not None else 0
        # A lazy iteration may outlive the current key: TTL writes go to the column family of
        # the key being iterated, not to the one of whatever key is current by then.
        cf = self._cf
        for key, raw in self._scan_prefix(base):
            if self._ttl is not None:
                live = self._live(key, raw, now, cf=cf)
                if live is None:
                    continue
                raw = live
            yield self._user_deser(key[start:]), self._deser(raw)

    def is_empty(self) -> bool:
        return next(iter(self.items()), None) is None

    def clear(self) -> None:
        base = self._key()
        batch = self._batch()
        self._delete_prefix(base, batch)
        self._commit(batch)

    def _entry_keys(self, keys: BatchKeys, user_keys: Any) -> list[bytes]:
        user_ser = self._user_ser
        return [base + user_ser(uk) for base, uk in
                zip(self._bulk_keys(keys), values_of(keys, user_keys, "map keys"))]

    def get_many(self, keys: BatchKeys, user_keys: Any) -> list[Any]:
        return self._deser_or_none(self._read_many(keys, self._entry_keys(keys, user_keys)))

    def put_many(self, keys: BatchKeys, user_keys: Any, values: Any) -> None:
        ser = self._ser
        payloads: list[bytes | None] = [ser(v) for v in values_of(keys, values)]
        self._put_many(keys, self._entry_keys(keys, user_keys), payloads)

    def clear_many(self, keys: BatchKeys) -> None:
        _clear_prefixes(self, keys)


class RocksDBReducingState(RocksDBState, ReducingState[Any]):
    def get(self) -> Any:
        raw = self._read(self._key())
        return None if raw is None else self._deser(raw)

    def add(self, value: Any) -> None:
        key = self._key()
        raw = self._read(key)
        if raw is not None:
            # The input is checked against the type before the user function sees it.
            self._check(value)
            reduce = self.descriptor.reduce_function  # type: ignore[attr-defined]
            value = self._user_call("reduce function", reduce, self._deser(raw), value)
        self._write(key, self._ser(value))

    def get_many(self, keys: BatchKeys) -> list[Any]:
        return self._deser_or_none(self._read_many(keys, self._bulk_keys(keys)))

    def add_many(self, keys: BatchKeys, values: Any) -> None:
        stored_keys = self._bulk_keys(keys)
        values = values_of(keys, values)
        raws = self._read_many(keys, stored_keys)
        reduce = self.descriptor.reduce_function  # type: ignore[attr-defined]
        check, deser, ser, call = self._check, self._deser, self._ser, self._user_call
        payloads: list[bytes | None] = []
        for raw, value in zip(raws, values):
            if raw is not None:
                check(value)
                value = call("reduce function", reduce, deser(raw), value)
            payloads.append(ser(value))
        self._put_many(keys, stored_keys, payloads)


class RocksDBAggregatingState(RocksDBState, AggregatingState[Any]):
    def get(self) -> Any:
        raw = self._read(self._key())
        if raw is None:
            return None
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        return self._user_call("aggregate function's get_result", function.get_result,
                               self._deser(raw))

    def add(self, value: Any) -> None:
        key = self._key()
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        raw = self._read(key)
        if raw is None:
            acc = self._user_call("aggregate function's create_accumulator",
                                  function.create_accumulator)
        else:
            acc = self._deser(raw)
        acc = self._user_call("aggregate function's add", function.add, value, acc)
        self._write(key, self._ser(acc))

    # An accumulator is absent when nothing is stored, as in get and add: not when it decodes
    # to None (an untyped function's accumulator may be None).

    def get_many(self, keys: BatchKeys) -> list[Any]:
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        deser = self._deser
        return [None if raw is None else
                self._user_call("aggregate function's get_result", function.get_result,
                                deser(raw))
                for raw in self._read_many(keys, self._bulk_keys(keys))]

    def add_many(self, keys: BatchKeys, values: Any) -> None:
        stored_keys = self._bulk_keys(keys)
        values = values_of(keys, values)
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        call, deser, ser = self._user_call, self._deser, self._ser
        payloads: list[bytes | None] = []
        for raw, value in zip(self._read_many(keys, stored_keys), values):
            if raw is None:
                acc = call("aggregate function's create_accumulator",
                           function.create_accumulator)
            else:
                acc = deser(raw)
            payloads.append(ser(call("aggregate function's add", function.add, value, acc)))
        self._put_many(keys, stored_keys, payloads)


def _clear_prefixes(state: RocksDBState, keys: BatchKeys) -> None:
    """``clear_many`` of a list or map state: every entry under each key's prefix."""
    bases = state._bulk_keys(keys)
    targets = state._bulk_targets(keys)
    for base, cf, batch in zip(bases, targets.cf_of, targets.batch_of):
        for key, _ in scan(cf, base, prefix_upper_bound(base), state._what):
            batch.delete(key)
    targets.commit()


# -- through the value cache (docs/rocksdb-backend.md, "The value cache") ------------------------


class CachedValueState(RocksDBCachedState, ValueState[Any]):
    """:class:`RocksDBValueState` through the value cache."""

    def __init__(self, context: RocksDBKeyContext, descriptor: StateDescriptor,
                 instance: RocksDBInstance) -> None:
        super().__init__(context, descriptor, instance)
        assert isinstance(descriptor, ValueStateDescriptor)
        self._default = descriptor.default

    # The hot path: the key check and a hit inlined (no TTL: one dict lookup).

    def value(self) -> Any:
        kp = self._context.key_prefix
        if kp is not self._kp:
            self._rekey(kp)
        ck = self._ck
        if self._ttl is None:
            entry = self._vget(ck)
            form = self._cached(ck, self._full) if entry is None else entry[0]
        else:
            form = self._cached(ck, self._full)
        if form is ABSENT:
            return self._default
        return form if self._decoded else self._deser(form)

    def update(self, value: Any) -> None:
        if value is None:
            self.clear()
            return
        kp = self._context.key_prefix
        if kp is not self._kp:
            self._rekey(kp)
        data = self._ser(value)
        if self._ttl is None:
            # _store and ValueCache.put inlined: a value of an exact type is its own cached form
            ck = self._ck
            form = value if type(value) in self._exact else self._form(value, data)
            size = ENTRY_OVERHEAD + len(ck) + len(data)
            old = self._vget(ck)
            self._entries[ck] = (form, size)
            self._dirty[ck] = data
            cache = self._cache
            cache.bytes += size if old is None else size - old[1]
            if cache.bytes > cache.capacity:
                cache.make_room()
        else:
            self._store(self._ck, value, data)

    def get_many(self, keys: BatchKeys) -> list[Any]:
        return self._loaded(self._cached_many(keys, self._cache_keys(keys)), self._default)

    def update_many(self, keys: BatchKeys, values: Any) -> None:
        ser = self._ser
        values = values_of(keys, values)
        payloads = [None if v is None else ser(v) for v in values]
        # A None clears, and clear() does no cleanup step: only the writes count as accesses.
        if self._ttl is not None:
            self._cleanup_steps(sum(p is not None for p in payloads))
        self._store_many(self._cache_keys(keys), values, payloads, cleanup=False)


class CachedReducingState(RocksDBCachedState, ReducingState[Any]):
    """:class:`RocksDBReducingState` through the value cache."""

    def get(self) -> Any:
        form = self._cached(*self._current())
        return None if form is ABSENT else self._load(form)

    def add(self, value: Any) -> None:
        ck, full = self._current()
        form = self._cached(ck, full)
        if form is not ABSENT:
            # The input is checked against the type before the user function sees it.
            self._check(value)
            reduce = self.descriptor.reduce_function  # type: ignore[attr-defined]
            value = self._user_call("reduce function", reduce, self._load(form), value)
        self._store(ck, value, self._ser(value))

    def get_many(self, keys: BatchKeys) -> list[Any]:
        return self._loaded(self._cached_many(keys, self._cache_keys(keys)), None)

    def add_many(self, keys: BatchKeys, values: Any) -> None:
        cks = self._cache_keys(keys)
        values = values_of(keys, values)
        forms = self._cached_many(keys, cks)
        reduce = self.descriptor.reduce_function  # type: ignore[attr-defined]
        check, load, ser, call = self._check, self._load, self._ser, self._user_call
        results: list[Any] = []
        payloads: list[bytes | None] = []
        for form, value in zip(forms, values):
            if form is not ABSENT:
                check(value)
                value = call("reduce function", reduce, load(form), value)
            results.append(value)
            payloads.append(ser(value))
        self._store_many(cks, results, payloads)


class CachedAggregatingState(RocksDBCachedState, AggregatingState[Any]):
    """:class:`RocksDBAggregatingState` through the value cache."""

    def get(self) -> Any:
        form = self._cached(*self._current())
        if form is ABSENT:
            return None
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        return self._user_call("aggregate function's get_result", function.get_result,
                               self._load(form))

    def add(self, value: Any) -> None:
        ck, full = self._current()
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        form = self._cached(ck, full)
        if form is ABSENT:
            acc = self._user_call("aggregate function's create_accumulator",
                                  function.create_accumulator)
        else:
            acc = self._load(form)
        acc = self._user_call("aggregate function's add", function.add, value, acc)
        self._store(ck, acc, self._ser(acc))

    def get_many(self, keys: BatchKeys) -> list[Any]:
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        load, call = self._load, self._user_call
        return [None if form is ABSENT else
                call("aggregate function's get_result", function.get_result, load(form))
                for form in self._cached_many(keys, self._cache_keys(keys))]

    def add_many(self, keys: BatchKeys, values: Any) -> None:
        cks = self._cache_keys(keys)
        values = values_of(keys, values)
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        call, load, ser = self._user_call, self._load, self._ser
        accs: list[Any] = []
        payloads: list[bytes | None] = []
        for form, value in zip(self._cached_many(keys, cks), values):
            if form is ABSENT:
                acc = call("aggregate function's create_accumulator",
                           function.create_accumulator)
            else:
                acc = load(form)
            acc = call("aggregate function's add", function.add, value, acc)
            accs.append(acc)
            payloads.append(ser(acc))
        self._store_many(cks, accs, payloads)


#: The state kinds the value cache serves (a list or map is read by prefix scans, which see
#: RocksDB only: those kinds go to RocksDB directly).
CACHED_STATE_CLASSES: dict[StateKind, type[RocksDBState]] = {
    StateKind.VALUE: CachedValueState,
    StateKind.REDUCING: CachedReducingState,
    StateKind.AGGREGATING: CachedAggregatingState,
}


STATE_CLASSES: dict[StateKind, type[RocksDBState]] = {
    StateKind.VALUE: RocksDBValueState,
    StateKind.LIST: RocksDBListState,
    StateKind.MAP: RocksDBMapState,
    StateKind.REDUCING: RocksDBReducingState,
    StateKind.AGGREGATING: RocksDBAggregatingState,
}
