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

from typing import Any, Callable, Iterable, Iterator

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


class _ValueSteps(RocksDBState, ValueState[Any]):
    """What both value states (:class:`RocksDBValueState`, :class:`CachedValueState`) share
    beside where a value is read and written: the default and a bulk update's bytes."""

    def __init__(self, context: RocksDBKeyContext, descriptor: StateDescriptor,
                 instance: RocksDBInstance) -> None:
        super().__init__(context, descriptor, instance)
        assert isinstance(descriptor, ValueStateDescriptor)
        self._default = descriptor.default

    def _update_payloads(self, values: list[Any]) -> list[bytes | None]:
        """The bytes of each of ``values`` (None: a clear), once the cleanup steps of its
        writes are done (the caller stores them with ``cleanup=False``)."""
        ser = self._ser
        payloads = [None if v is None else ser(v) for v in values]
        # A None clears, and clear() does no cleanup step: only the writes count as accesses.
        if self._ttl is not None:
            self._cleanup_steps(sum(p is not None for p in payloads))
        return payloads


class RocksDBValueState(_ValueSteps):
    # The hot path: the key check is inlined (no _key() call) and TTL costs one branch.

    def value(self) -> Any:
        context = self._context
        kp = context.key_prefix
        if kp is self._kp:
            key = self._full
        elif kp is None:
            key = self._rekey(kp)  # raises: no current key
        else:
            # RocksDBState._rekey inlined: the first access after a key change, on every key
            # of the per-key path
            if context.sharded:
                instance = context.current_instance
                if instance is not self._inst:
                    (self._inst, self._cf, self._handle, self._get, self._put,
                     self._delete) = self._bindings[instance.index]
            self._kp = kp
            self._full = key = kp + self._ns_part
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
        payloads = self._update_payloads(values_of(keys, values))
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


class _ReducingSteps(RocksDBState, ReducingState[Any]):
    """The reduce step of both reducing states (:class:`RocksDBReducingState`,
    :class:`CachedReducingState`): they differ only in where a value is read and written.
    The per-key step calls the user function in its own ``try`` (one frame, as a direct
    ``_user_call``)."""

    def _reduced(self, stored: Any, value: Any) -> Any:
        """``value`` reduced into ``stored``, the key's value."""
        # The input is checked against the type before the user function sees it.
        self._check(value)
        try:
            return self.descriptor.reduce_function(stored, value)  # type: ignore[attr-defined]
        except KeyedStateError:
            raise
        except Exception as exc:
            raise self._user_error("reduce function", exc) from exc

    def _reduce_all(self, stored: list[Any], absent: Any, load: Callable[[Any], Any],
                    values: Iterable[Any]) -> list[Any]:
        """Each of ``values`` reduced into its key's value: ``load`` of its ``stored`` item,
        none where that is ``absent``."""
        reduced = self._reduced
        return [value if old is absent else reduced(load(old), value)
                for old, value in zip(stored, values)]


class RocksDBReducingState(_ReducingSteps):
    def get(self) -> Any:
        raw = self._read(self._key())
        return None if raw is None else self._deser(raw)

    def add(self, value: Any) -> None:
        key = self._key()
        raw = self._read(key)
        if raw is not None:
            value = self._reduced(self._deser(raw), value)
        self._write(key, self._ser(value))

    def get_many(self, keys: BatchKeys) -> list[Any]:
        return self._deser_or_none(self._read_many(keys, self._bulk_keys(keys)))

    def add_many(self, keys: BatchKeys, values: Any) -> None:
        stored_keys = self._bulk_keys(keys)
        values = values_of(keys, values)
        results = self._reduce_all(self._read_many(keys, stored_keys), None, self._deser, values)
        ser = self._ser
        self._put_many(keys, stored_keys, [ser(value) for value in results])


class _AggregatingSteps(RocksDBState, AggregatingState[Any]):
    """The aggregate function's steps of both aggregating states
    (:class:`RocksDBAggregatingState`, :class:`CachedAggregatingState`): they differ only in
    where an accumulator is read and written. Each step calls the user function in its own
    ``try`` (one frame, as a direct ``_user_call``)."""

    def _new_accumulator(self) -> Any:
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        try:
            return function.create_accumulator()
        except KeyedStateError:
            raise
        except Exception as exc:
            raise self._user_error("aggregate function's create_accumulator", exc) from exc

    def _added(self, value: Any, acc: Any) -> Any:
        """``acc`` with ``value`` added."""
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        try:
            return function.add(value, acc)
        except KeyedStateError:
            raise
        except Exception as exc:
            raise self._user_error("aggregate function's add", exc) from exc

    def _result(self, acc: Any) -> Any:
        function = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        try:
            return function.get_result(acc)
        except KeyedStateError:
            raise
        except Exception as exc:
            raise self._user_error("aggregate function's get_result", exc) from exc

    def _results(self, stored: list[Any], absent: Any, load: Callable[[Any], Any]) -> list[Any]:
        """The result of each key's accumulator: ``load`` of its ``stored`` item, None where
        that is ``absent``."""
        result = self._result
        return [None if acc is absent else result(load(acc)) for acc in stored]

    def _accumulate_all(self, stored: list[Any], absent: Any, load: Callable[[Any], Any],
                        values: Iterable[Any]) -> list[Any]:
        """Each key's accumulator (``load`` of its ``stored`` item, a new one where that is
        ``absent``) with its value added."""
        new, added = self._new_accumulator, self._added
        return [added(value, new() if acc is absent else load(acc))
                for acc, value in zip(stored, values)]


class RocksDBAggregatingState(_AggregatingSteps):
    def get(self) -> Any:
        raw = self._read(self._key())
        return None if raw is None else self._result(self._deser(raw))

    def add(self, value: Any) -> None:
        key = self._key()
        raw = self._read(key)
        acc = self._new_accumulator() if raw is None else self._deser(raw)
        self._write(key, self._ser(self._added(value, acc)))

    def get_many(self, keys: BatchKeys) -> list[Any]:
        return self._results(self._read_many(keys, self._bulk_keys(keys)), None, self._deser)

    def add_many(self, keys: BatchKeys, values: Any) -> None:
        stored_keys = self._bulk_keys(keys)
        values = values_of(keys, values)
        accs = self._accumulate_all(self._read_many(keys, stored_keys), None, self._deser,
                                    values)
        ser = self._ser
        self._put_many(keys, stored_keys, [ser(acc) for acc in accs])


def _clear_prefixes(state: RocksDBState, keys: BatchKeys) -> None:
    """``clear_many`` of a list or map state: every entry under each key's prefix."""
    bases = state._bulk_keys(keys)
    targets = state._bulk_targets(keys)
    for base, cf, batch in zip(bases, targets.cf_of, targets.batch_of):
        for key, _ in scan(cf, base, prefix_upper_bound(base), state._what):
            batch.delete(key)
    targets.commit()


# -- through the value cache (docs/rocksdb-backend.md, "The value cache") ------------------------


class CachedValueState(RocksDBCachedState, _ValueSteps):
    """:class:`RocksDBValueState` through the value cache."""

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
        values = values_of(keys, values)
        payloads = self._update_payloads(values)
        self._store_many(self._cache_keys(keys), values, payloads, cleanup=False)


class CachedReducingState(RocksDBCachedState, _ReducingSteps):
    """:class:`RocksDBReducingState` through the value cache."""

    def get(self) -> Any:
        form = self._cached(*self._current())
        return None if form is ABSENT else self._load(form)

    def add(self, value: Any) -> None:
        ck, full = self._current()
        form = self._cached(ck, full)
        if form is not ABSENT:
            value = self._reduced(self._load(form), value)
        self._store(ck, value, self._ser(value))

    def get_many(self, keys: BatchKeys) -> list[Any]:
        return self._loaded(self._cached_many(keys, self._cache_keys(keys)), None)

    def add_many(self, keys: BatchKeys, values: Any) -> None:
        cks = self._cache_keys(keys)
        values = values_of(keys, values)
        results = self._reduce_all(self._cached_many(keys, cks), ABSENT, self._load, values)
        ser = self._ser
        self._store_many(cks, results, [ser(value) for value in results])


class CachedAggregatingState(RocksDBCachedState, _AggregatingSteps):
    """:class:`RocksDBAggregatingState` through the value cache."""

    def get(self) -> Any:
        form = self._cached(*self._current())
        return None if form is ABSENT else self._result(self._load(form))

    def add(self, value: Any) -> None:
        ck, full = self._current()
        form = self._cached(ck, full)
        acc = self._new_accumulator() if form is ABSENT else self._load(form)
        acc = self._added(value, acc)
        self._store(ck, acc, self._ser(acc))

    def get_many(self, keys: BatchKeys) -> list[Any]:
        return self._results(self._cached_many(keys, self._cache_keys(keys)), ABSENT,
                             self._load)

    def add_many(self, keys: BatchKeys, values: Any) -> None:
        cks = self._cache_keys(keys)
        values = values_of(keys, values)
        accs = self._accumulate_all(self._cached_many(keys, cks), ABSENT, self._load, values)
        ser = self._ser
        self._store_many(cks, accs, [ser(acc) for acc in accs])


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
