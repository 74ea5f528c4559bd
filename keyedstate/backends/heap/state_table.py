"""The heap backend's state table: one state's entries as Python objects, per key group.

A :class:`StateTable` maps ``(key_bytes, namespace_bytes) -> stored`` per key group, where
``stored`` is the value (value, reducing and aggregating states), a list (list state) or a dict
of user key -> value (map state). Under TTL every value, list element and map value is a
``(value, last_access_ms)`` tuple, so expiry is per element and per map entry, as in Flink.

Every change is also recorded in the table's open journal segment (``marks``, see
:mod:`keyedstate.backends.heap.snapshot`): only *which* entry changed, never the value, so that
repeated updates of a key squash into one entry of the next incremental snapshot.
"""

from __future__ import annotations

from typing import Any

from keyedstate.backends.base.backend import meta_info_of
from keyedstate.backends.base.migration import StateMigration
from keyedstate.errors import SerializationError
from keyedstate.serde import PickleSerializer, TypeSerializer
from keyedstate.state.descriptors import StateDescriptor, StateKind, TtlUpdateType
from keyedstate.storage.handles import StateMetaInfo

EntryKey = tuple[bytes, bytes]
#: Journal mark of an entry: REPLACED (write it whole, or its removal), for a list only
#: appended to the length it had before the first append, for a map the set of changed user keys.
Mark = int | set[Any]
KeyGroupMarks = dict[int, dict[EntryKey, Mark]]
REPLACED = -1


class StateTable:
    """One state's entries (registered, or restored and not yet registered).

    ``descriptor`` is None for a restored state nobody asked for yet; its values were decoded
    with serializers rebuilt from the snapshot, which equal the descriptor's once it registers
    (:func:`check_compatible` compares the type strings).
    """

    def __init__(self, meta: StateMetaInfo, value_serializer: TypeSerializer,
                 user_key_serializer: TypeSerializer | None,
                 descriptor: StateDescriptor | None = None) -> None:
        self.name = meta.name
        self.kind = StateKind(meta.kind)
        self.meta = meta
        self.descriptor = descriptor
        self.value_serializer = value_serializer
        self.user_key_serializer = user_key_serializer
        self.ttl_ms: int | None = meta.ttl_ms
        self.update_on_read = False
        self.cleanup_size = 0
        self.cleanup_in_full_snapshot = True
        self.maps: dict[int, dict[EntryKey, Any]] = {}
        #: the open journal segment; None while nothing can be a base (no tracking needed).
        self.marks: KeyGroupMarks | None = None
        self._cursor_key_groups: list[int] = []
        self._cursor_group = -1
        self._cursor_keys: list[EntryKey] = []
        self._cursor_pos = 0
        if descriptor is not None:
            self.attach(descriptor)

    @classmethod
    def of(cls, descriptor: StateDescriptor) -> StateTable:
        return cls(meta_info_of(descriptor), descriptor.value_serializer,
                   descriptor.user_key_serializer, descriptor)

    def attach(self, descriptor: StateDescriptor) -> None:
        """Adopt the descriptor (TTL duration may differ from the restored one, as in Flink)."""
        self.descriptor = descriptor
        self.meta = meta_info_of(descriptor)
        self.value_serializer = descriptor.value_serializer
        self.user_key_serializer = descriptor.user_key_serializer
        ttl = descriptor.ttl
        self.ttl_ms = None if ttl is None else ttl.ttl_ms
        self.update_on_read = ttl is not None and ttl.update_type == TtlUpdateType.ON_READ_AND_WRITE
        self.cleanup_size = 0 if ttl is None else ttl.incremental_cleanup_size
        self.cleanup_in_full_snapshot = ttl is None or ttl.cleanup_in_full_snapshot

    def migrate_values(self, migration: StateMigration, now_ms: int) -> None:
        """Apply ``migration`` to every entry, after :meth:`attach` (the eager migration of a
        restored state whose type evolved or whose TTL was switched,
        :mod:`keyedstate.backends.base.migration`): values (list elements and map values one
        by one) migrated; TTL switched on stamps them ``now_ms``, switched off drops the
        timestamps and the entries already expired; otherwise timestamps are kept."""
        migrate = migration.migrate
        ttl = self.ttl_ms is not None
        if migration.ttl is None:  # the type alone: one call per value
            for group in self.maps.values():
                for key, stored in group.items():
                    if self.kind is StateKind.LIST:
                        group[key] = [(migrate(v), ts) for v, ts in stored] if ttl \
                            else [migrate(v) for v in stored]
                    elif self.kind is StateKind.MAP:
                        group[key] = {k: (migrate(v), ts) for k, (v, ts) in stored.items()} \
                            if ttl else {k: migrate(v) for k, v in stored.items()}
                    else:
                        group[key] = (migrate(stored[0]), stored[1]) if ttl else migrate(stored)
            return
        dropped = object()

        def one(stored: Any) -> Any:
            if ttl:  # switched on
                return (migrate(stored), now_ms)
            value, timestamp = stored
            return dropped if migration.expired(timestamp, now_ms) else migrate(value)

        for kg in list(self.maps):
            group = self.maps[kg]
            for key in list(group):
                stored = group[key]
                if self.kind is StateKind.LIST:
                    new: Any = [x for x in map(one, stored) if x is not dropped] or dropped
                elif self.kind is StateKind.MAP:
                    new = {k: x for k, v in stored.items() if (x := one(v)) is not dropped} \
                        or dropped
                else:
                    new = one(stored)
                if new is dropped:
                    del group[key]
                else:
                    group[key] = new
            if not group:
                del self.maps[kg]

    # -- checks --------------------------------------------------------------------------------

    def check_value(self, value: Any) -> Any:
        """The value to store: checked against the type, and a private copy of a mutable
        value (the caller's later changes must not reach the state or a running snapshot)."""
        return self._check(self.value_serializer, value, "value")

    def check_user_key(self, user_key: Any) -> None:
        if self.user_key_serializer is not None:
            self._check(self.user_key_serializer, user_key, "map key")

    def _check(self, serializer: TypeSerializer, value: Any, what: str) -> Any:
        try:
            # Untyped values are pickled to copy them: only pickling proves a value can be
            # snapshotted, and failing here names the write at fault, not a later checkpoint.
            return serializer.copy(value)
        except SerializationError as exc:
            hint = "store picklable values or declare a type" \
                if isinstance(serializer, PickleSerializer) \
                else f"pass a {what} of the declared type {serializer.type_string}"
            raise SerializationError(f"state {self.name!r}: {exc}; {hint}") from exc

    # -- journal -------------------------------------------------------------------------------

    def _marks_of(self, key_group: int) -> dict[EntryKey, Mark] | None:
        marks = self.marks
        if marks is None:
            return None
        group = marks.get(key_group)
        if group is None:
            group = marks[key_group] = {}
        return group

    def mark_replaced(self, key_group: int, key: EntryKey) -> None:
        group = self._marks_of(key_group)
        if group is not None:
            group[key] = REPLACED

    def mark_appended(self, key_group: int, key: EntryKey, old_len: int) -> None:
        group = self._marks_of(key_group)
        if group is not None:
            # An earlier mark (REPLACED or an earlier start) already covers this append.
            group.setdefault(key, old_len)

    def mark_user_key(self, key_group: int, key: EntryKey, user_key: Any) -> None:
        group = self._marks_of(key_group)
        if group is not None:
            mark = group.get(key)
            if mark is None:
                group[key] = {user_key}
            elif type(mark) is set:
                mark.add(user_key)

    # -- entries -------------------------------------------------------------------------------

    def get(self, key_group: int, key: EntryKey) -> Any:
        group = self.maps.get(key_group)
        return None if group is None else group.get(key)

    def put(self, key_group: int, key: EntryKey, stored: Any) -> None:
        group = self.maps.get(key_group)
        if group is None:
            group = self.maps[key_group] = {}
        group[key] = stored
        self.mark_replaced(key_group, key)

    def remove(self, key_group: int, key: EntryKey) -> None:
        group = self.maps.get(key_group)
        if group is not None and group.pop(key, None) is not None:
            self.mark_replaced(key_group, key)
            if not group:
                del self.maps[key_group]

    def is_expired(self, last_access_ms: int, now: int) -> bool:
        # keyedstate.state.ttl.is_expired, inlined: it runs for every element read under TTL.
        return last_access_ms + self.ttl_ms <= now  # type: ignore[operator]

    def purge(self, key_group: int, key: EntryKey, stored: Any, now: int) -> Any:
        """Drop what expired in one entry (journaled); returns what is left, None if nothing."""
        expired = self.is_expired
        if self.kind is StateKind.LIST:
            live = [e for e in stored if not expired(e[1], now)]
            if len(live) == len(stored):
                return stored
            if live:
                self.put(key_group, key, live)
                return live
        elif self.kind is StateKind.MAP:
            for user_key in [uk for uk, e in stored.items() if expired(e[1], now)]:
                del stored[user_key]
                self.mark_user_key(key_group, key, user_key)
            if stored:
                return stored
        elif not expired(stored[1], now):
            return stored
        self.remove(key_group, key)
        return None

    def cleanup(self, now: int, accesses: int = 1) -> None:
        """Flink's incremental cleanup: check the next ``incremental_cleanup_size`` entries
        (per access: a bulk call counts each of its keys) after a persistent cursor and drop
        expired ones. The cursor walks a copy of one key group's keys at a time, so it survives
        concurrent changes and costs O(1) per step."""
        budget = self.cleanup_size * accesses
        rounds = 0
        while budget > 0:
            if self._cursor_pos >= len(self._cursor_keys):
                if not self._cursor_key_groups:
                    self._cursor_key_groups = sorted(self.maps, reverse=True)
                    rounds += 1
                    # Empty, or every entry was already looked at during this access.
                    if not self._cursor_key_groups or rounds > 2:
                        return
                kg = self._cursor_key_groups.pop()
                self._cursor_keys = list(self.maps.get(kg, ()))
                self._cursor_pos = 0
                self._cursor_group = kg
                continue
            key = self._cursor_keys[self._cursor_pos]
            self._cursor_pos += 1
            budget -= 1
            stored = self.get(self._cursor_group, key)
            if stored is not None:
                self.purge(self._cursor_group, key, stored, now)
