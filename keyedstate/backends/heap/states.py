"""The heap backend's five state kinds over its state tables (:mod:`.state_table`).

A state reads and writes its :class:`~.state_table.StateTable` as Python objects: nothing is
serialized on access; typed values are only checked (``to_plain``) when written, untyped ones
are pickled once on write as their check. Under TTL every value, list element and map value is
a ``(value, last_access_ms)`` tuple, so expiry is per element and per map entry, as in Flink.

Bulk calls (``get_many``, ``update_many``, ...) loop over their keys inside, once per call,
through the same table operations (hence the same journal marks) as the per-key calls; the
incremental TTL cleanup of all their accesses runs once at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from keyedstate.backends.heap.state_table import EntryKey, StateTable
from keyedstate.errors import ConfigurationError, KeyedStateError, UserFunctionError
from keyedstate.serde import VOID_NAMESPACE, serialize_namespace
from keyedstate.state.api import (
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    State,
    ValueState,
)
from keyedstate.state.batch_keys import BatchKeys, values_of
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateKind,
)

if TYPE_CHECKING:
    from keyedstate.backends.base.backend import KeyedStateBackend

class _HeapState(State):
    """Shared plumbing: the current key comes from the backend, the namespace is per state."""

    def __init__(self, backend: KeyedStateBackend, table: StateTable,
                 descriptor: StateDescriptor) -> None:
        self._backend = backend
        self._table = table
        self.descriptor = descriptor
        self._ns = VOID_NAMESPACE

    def set_current_namespace(self, namespace: Any) -> None:
        self._ns = serialize_namespace(namespace)

    def _key(self) -> tuple[int, EntryKey]:
        backend = self._backend
        key_bytes = backend.current_key_bytes
        if key_bytes is None:
            raise ConfigurationError(
                f"state {self._table.name!r} was accessed without a current key: call "
                f"set_current_key(...) on the keyed backend first"
            )
        return backend.current_key_group, (key_bytes, self._ns)

    def _now(self) -> int:
        return self._backend.time_provider.now_ms()

    def _read(self) -> tuple[int, EntryKey, Any, int]:
        """(key group, entry key, live stored entry or None, now); purges what expired."""
        kg, key = self._key()
        table = self._table
        stored = table.get(kg, key)
        if table.ttl_ms is None:
            return kg, key, stored, 0
        now = self._now()
        if stored is not None:
            stored = table.purge(kg, key, stored, now)
        return kg, key, stored, now

    def _done(self, now: int) -> None:
        if self._table.cleanup_size:
            self._table.cleanup(now)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except KeyedStateError:
            raise
        except Exception as exc:  # any user error, wrapped so callers see which state failed
            raise UserFunctionError(
                f"the {what} of state {self._table.name!r} raised {type(exc).__name__}: {exc}; "
                f"fix the function or the values added to the state"
            ) from exc

    def clear(self) -> None:
        kg, key = self._key()
        self._table.remove(kg, key)
        if self._table.ttl_ms is not None:
            self._done(self._now())

    # -- bulk ----------------------------------------------------------------------------------

    def _bulk(self, keys: BatchKeys) -> list[EntryKey]:
        """The entry key of each of ``keys`` in the current namespace (checks the range)."""
        backend = self._backend
        def check() -> bool:
            backend.check_batch_keys(keys)
            return True
        keys.cached(("heap-checked", id(backend)), check)
        ns = self._ns
        return [(key_bytes, ns) for key_bytes in keys.key_bytes]

    def _read_many(self, keys: BatchKeys) -> tuple[list[EntryKey], list[Any], int]:
        """(entry keys, live stored entry or None of each, now) as :meth:`_read` of each."""
        entry_keys = self._bulk(keys)
        table = self._table
        maps = table.maps
        stored: list[Any] = []
        for kg, key in zip(keys.key_groups, entry_keys):
            group = maps.get(kg)
            stored.append(None if group is None else group.get(key))
        if table.ttl_ms is None:
            return entry_keys, stored, 0
        now = self._now()
        purge = table.purge
        for i, (kg, key, entry) in enumerate(zip(keys.key_groups, entry_keys, stored)):
            if entry is not None:
                stored[i] = purge(kg, key, entry, now)
        return entry_keys, stored, now

    def _done_many(self, now: int, accesses: int) -> None:
        if self._table.cleanup_size and accesses:
            self._table.cleanup(now, accesses)

    def clear_many(self, keys: BatchKeys) -> None:
        table = self._table
        for kg, key in zip(keys.key_groups, self._bulk(keys)):
            table.remove(kg, key)
        if table.ttl_ms is not None:
            self._done_many(self._now(), len(keys))


class _SingleValueState(_HeapState):
    """Value, reducing and aggregating states: one stored value per key and namespace."""

    def _get(self) -> Any:
        kg, key, stored, now = self._read()
        table = self._table
        if table.ttl_ms is None:
            return stored
        if stored is None:
            self._done(now)
            return None
        if table.update_on_read:
            table.put(kg, key, (stored[0], now))
        self._done(now)
        return stored[0]

    def _set(self, kg: int, key: EntryKey, value: Any, now: int) -> None:
        table = self._table
        if value is None:
            table.remove(kg, key)
        else:
            value = table.check_value(value)
            table.put(kg, key, value if table.ttl_ms is None else (value, now))
        if table.ttl_ms is not None:
            self._done(now)


    def _get_many(self, keys: BatchKeys) -> list[Any]:
        """:meth:`_get` of each of ``keys``."""
        entry_keys, stored, now = self._read_many(keys)
        table = self._table
        if table.ttl_ms is None:
            return stored
        out: list[Any] = []
        for kg, key, entry in zip(keys.key_groups, entry_keys, stored):
            if entry is None:
                out.append(None)
                continue
            if table.update_on_read:
                table.put(kg, key, (entry[0], now))
            out.append(entry[0])
        self._done_many(now, len(entry_keys))
        return out

    def _set_many(self, keys: BatchKeys, entry_keys: list[EntryKey], values: list[Any],
                  now: int) -> None:
        """:meth:`_set` of each of ``keys``."""
        table = self._table
        check, put, remove = table.check_value, table.put, table.remove
        ttl = table.ttl_ms is not None
        for kg, key, value in zip(keys.key_groups, entry_keys, values):
            if value is None:
                remove(kg, key)
            else:
                value = check(value)
                put(kg, key, (value, now) if ttl else value)
        if ttl:
            self._done_many(now, len(entry_keys))


class HeapValueState(_SingleValueState, ValueState[Any]):
    def value(self) -> Any:
        stored = self._get()
        default: Any = getattr(self.descriptor, "default", None)
        return default if stored is None else stored

    def update(self, value: Any) -> None:
        kg, key = self._key()
        self._set(kg, key, value, self._now() if self._table.ttl_ms is not None else 0)

    def get_many(self, keys: BatchKeys) -> list[Any]:
        default: Any = getattr(self.descriptor, "default", None)
        return [default if v is None else v for v in self._get_many(keys)]

    def update_many(self, keys: BatchKeys, values: Any) -> None:
        values = values_of(keys, values)
        self._set_many(keys, self._bulk(keys), values,
                       self._now() if self._table.ttl_ms is not None else 0)


class HeapReducingState(_SingleValueState, ReducingState[Any]):
    def get(self) -> Any:
        return self._get()

    def add(self, value: Any) -> None:
        # Input and result are of the declared type: refuse a bad input before reducing it.
        value = self._table.check_value(value)
        kg, key, stored, now = self._read()
        if stored is not None and self._table.ttl_ms is not None:
            stored = stored[0]
        assert isinstance(self.descriptor, ReducingStateDescriptor)
        if stored is not None:
            value = self._call("reduce function", self.descriptor.reduce_function, stored, value)
        self._set(kg, key, value, now)

    def get_many(self, keys: BatchKeys) -> list[Any]:
        return self._get_many(keys)

    def add_many(self, keys: BatchKeys, values: Any) -> None:
        check = self._table.check_value
        values = [check(v) for v in values_of(keys, values)]
        entry_keys, stored, now = self._read_many(keys)
        ttl = self._table.ttl_ms is not None
        assert isinstance(self.descriptor, ReducingStateDescriptor)
        reduce = self.descriptor.reduce_function
        for i, entry in enumerate(stored):
            if entry is not None:
                values[i] = self._call("reduce function", reduce, entry[0] if ttl else entry,
                                       values[i])
        self._set_many(keys, entry_keys, values, now)


class HeapAggregatingState(_SingleValueState, AggregatingState[Any]):
    def get(self) -> Any:
        acc = self._get()
        if acc is None:
            return None
        assert isinstance(self.descriptor, AggregatingStateDescriptor)
        return self._call("aggregate function's get_result",
                          self.descriptor.aggregate_function.get_result, acc)

    def add(self, value: Any) -> None:
        kg, key, acc, now = self._read()
        if acc is not None and self._table.ttl_ms is not None:
            acc = acc[0]
        assert isinstance(self.descriptor, AggregatingStateDescriptor)
        fn = self.descriptor.aggregate_function
        if acc is None:
            acc = self._call("aggregate function's create_accumulator", fn.create_accumulator)
        self._set(kg, key, self._call("aggregate function's add", fn.add, value, acc), now)

    def get_many(self, keys: BatchKeys) -> list[Any]:
        assert isinstance(self.descriptor, AggregatingStateDescriptor)
        get_result = self.descriptor.aggregate_function.get_result
        return [None if acc is None else
                self._call("aggregate function's get_result", get_result, acc)
                for acc in self._get_many(keys)]

    def add_many(self, keys: BatchKeys, values: Any) -> None:
        values = values_of(keys, values)
        entry_keys, stored, now = self._read_many(keys)
        ttl = self._table.ttl_ms is not None
        assert isinstance(self.descriptor, AggregatingStateDescriptor)
        fn = self.descriptor.aggregate_function
        accs: list[Any] = []
        for entry, value in zip(stored, values):
            acc = entry[0] if entry is not None and ttl else entry
            if acc is None:
                acc = self._call("aggregate function's create_accumulator",
                                 fn.create_accumulator)
            accs.append(self._call("aggregate function's add", fn.add, value, acc))
        self._set_many(keys, entry_keys, accs, now)


class HeapListState(_HeapState, ListState[Any]):
    def _checked(self, values: Iterable[Any]) -> list[Any]:
        check = self._table.check_value
        return [check(v) for v in values]

    def get(self) -> list[Any]:
        kg, key, stored, now = self._read()
        table = self._table
        if stored is None:
            if table.ttl_ms is not None:
                self._done(now)
            return []
        if table.ttl_ms is None:
            return list(stored)
        if table.update_on_read:
            table.put(kg, key, [(v, now) for v, _ in stored])
        self._done(now)
        return [v for v, _ in stored]

    def add(self, value: Any) -> None:
        self.add_all((value,))

    def add_all(self, values: Iterable[Any]) -> None:
        new = self._checked(values)
        if not new:
            return
        kg, key, stored, now = self._read()
        self._append(kg, key, stored, new, now)
        if self._table.ttl_ms is not None:
            self._done(now)

    def _append(self, kg: int, key: EntryKey, stored: list[Any] | None, new: list[Any],
                now: int) -> None:
        """Append the checked elements ``new`` to the list ``stored`` (None: no list yet),
        stamped ``now`` under TTL, with the journal mark an incremental snapshot needs."""
        table = self._table
        if table.ttl_ms is not None:
            new = [(v, now) for v in new]
        if stored is None:
            group = table.maps.get(kg)
            if group is None:
                group = table.maps[kg] = {}
            group[key] = new
            table.mark_appended(kg, key, 0)
        else:
            table.mark_appended(kg, key, len(stored))
            stored.extend(new)

    def update(self, values: Iterable[Any]) -> None:
        new = self._checked(values)
        kg, key = self._key()
        table = self._table
        now = self._now() if table.ttl_ms is not None else 0
        if not new:
            table.remove(kg, key)
        else:
            table.put(kg, key, new if table.ttl_ms is None else [(v, now) for v in new])
        if table.ttl_ms is not None:
            self._done(now)

    def get_many(self, keys: BatchKeys) -> list[list[Any]]:
        entry_keys, stored, now = self._read_many(keys)
        table = self._table
        if table.ttl_ms is None:
            return [[] if entry is None else list(entry) for entry in stored]
        out: list[list[Any]] = []
        for kg, key, entry in zip(keys.key_groups, entry_keys, stored):
            if entry is None:
                out.append([])
                continue
            if table.update_on_read:
                table.put(kg, key, [(v, now) for v, _ in entry])
            out.append([v for v, _ in entry])
        self._done_many(now, len(entry_keys))
        return out

    def add_many(self, keys: BatchKeys, elements: Any) -> None:
        new_lists = [self._checked(values)
                     for values in values_of(keys, elements, "element lists")]
        entry_keys, stored, now = self._read_many(keys)
        accesses = 0
        for kg, key, entry, new in zip(keys.key_groups, entry_keys, stored, new_lists):
            if not new:
                continue
            accesses += 1
            self._append(kg, key, entry, new, now)
        if self._table.ttl_ms is not None:
            self._done_many(now, accesses)


class HeapMapState(_HeapState, MapState[Any, Any]):
    def get(self, key: Any) -> Any:
        kg, ekey, stored, now = self._read()
        if stored is None:
            result = None
        elif self._table.ttl_ms is None:
            result = stored.get(key)
        else:
            entry = stored.get(key)
            result = None if entry is None else entry[0]
            if entry is not None and self._table.update_on_read:
                stored[key] = (result, now)
                self._table.mark_user_key(kg, ekey, key)
        if self._table.ttl_ms is not None:
            self._done(now)
        return result

    def contains(self, key: Any) -> bool:
        kg, ekey, stored, now = self._read()
        if self._table.ttl_ms is not None:
            self._done(now)
        return stored is not None and key in stored

    def put(self, key: Any, value: Any) -> None:
        self.put_all({key: value})

    def put_all(self, mapping: dict[Any, Any]) -> None:
        table = self._table
        for k in mapping:
            table.check_user_key(k)
        mapping = {k: table.check_value(v) for k, v in mapping.items()}
        if not mapping:
            return
        kg, ekey, stored, now = self._read()
        if stored is None:
            group = table.maps.get(kg)
            if group is None:
                group = table.maps[kg] = {}
            stored = group[ekey] = {}
        ttl = table.ttl_ms is not None
        for k, v in mapping.items():
            stored[k] = (v, now) if ttl else v
            table.mark_user_key(kg, ekey, k)
        if ttl:
            self._done(now)

    def remove(self, key: Any) -> None:
        kg, ekey, stored, now = self._read()
        table = self._table
        if stored is not None and key in stored:
            del stored[key]
            table.mark_user_key(kg, ekey, key)
            if not stored:
                table.remove(kg, ekey)
        if table.ttl_ms is not None:
            self._done(now)

    def items(self) -> Iterator[tuple[Any, Any]]:
        kg, ekey, stored, now = self._read()
        table = self._table
        if stored is None:
            pairs: list[tuple[Any, Any]] = []
        elif table.ttl_ms is None:
            pairs = list(stored.items())
        else:
            pairs = [(k, e[0]) for k, e in stored.items()]
            if table.update_on_read:
                for k, v in pairs:
                    stored[k] = (v, now)
                    table.mark_user_key(kg, ekey, k)
        if table.ttl_ms is not None:
            self._done(now)
        return iter(pairs)

    def get_many(self, keys: BatchKeys, user_keys: Any) -> list[Any]:
        user_keys = values_of(keys, user_keys, "map keys")
        entry_keys, stored, now = self._read_many(keys)
        table = self._table
        if table.ttl_ms is None:
            return [None if entry is None else entry.get(uk)
                    for entry, uk in zip(stored, user_keys)]
        out: list[Any] = []
        for kg, key, entry, uk in zip(keys.key_groups, entry_keys, stored, user_keys):
            pair = None if entry is None else entry.get(uk)
            out.append(None if pair is None else pair[0])
            if pair is not None and table.update_on_read:
                entry[uk] = (pair[0], now)
                table.mark_user_key(kg, key, uk)
        self._done_many(now, len(entry_keys))
        return out

    def put_many(self, keys: BatchKeys, user_keys: Any, values: Any) -> None:
        table = self._table
        user_keys = values_of(keys, user_keys, "map keys")
        for uk in user_keys:
            table.check_user_key(uk)
        values = [table.check_value(v) for v in values_of(keys, values)]
        entry_keys, stored, now = self._read_many(keys)
        ttl = table.ttl_ms is not None
        for kg, key, entry, uk, value in zip(keys.key_groups, entry_keys, stored, user_keys,
                                             values):
            if entry is None:
                group = table.maps.get(kg)
                if group is None:
                    group = table.maps[kg] = {}
                entry = group[key] = {}
            entry[uk] = (value, now) if ttl else value
            table.mark_user_key(kg, key, uk)
        if ttl:
            self._done_many(now, len(entry_keys))


STATE_CLASSES: dict[StateKind, type[_HeapState]] = {
    StateKind.VALUE: HeapValueState,
    StateKind.LIST: HeapListState,
    StateKind.MAP: HeapMapState,
    StateKind.REDUCING: HeapReducingState,
    StateKind.AGGREGATING: HeapAggregatingState,
}


def create_state(backend: KeyedStateBackend, table: StateTable,
                 descriptor: StateDescriptor) -> State:
    """The state object of ``descriptor``'s kind over ``table``."""
    return STATE_CLASSES[descriptor.kind](backend, table, descriptor)

