"""The value cache of a RocksDB keyed backend: a bounded write-back cache of the values of its
single-value states (value, reducing, aggregating) in front of rocksdict, so that a key read
and written in every batch costs dict operations, not RocksDB point lookups and puts
(docs/rocksdb-backend.md, "The value cache").

What is stored does not change: a value reaches RocksDB with the exact bytes (TTL stamp
included) it would have had without the cache, only later, in one write batch per instance:
at :meth:`ValueCache.flush` (every snapshot, before its files are frozen; before any scan of
the state's column families) and when :meth:`ValueCache.put` needs room (the oldest entries go,
their unwritten values written first).

An entry is a tuple whose first item is the *cached form* of the value (:data:`ABSENT` when the
key has none: read as absent, cleared or expired) and whose second is its estimated size in
bytes; a TTL state's entry adds the last-access stamp (ms) and the value's serialized bytes
(``(form, size, stamp, payload)``). The cached form is the decoded value for states whose type
decodes to immutable Python values (scalars: one decode per fill, no decode per read), else
the serialized bytes, decoded on every read (a caller changing a list or dict it read must
not change the state, as without the cache). Keys are the state's two-byte id followed by the
stored key (``[kg][key][ns]``), so one dict holds every state and its insertion order is the
order entries are evicted in: first in, first out (a hit or a write leaves an entry where it
is: moving it would cost every write a dict slot).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import pyarrow as pa
import rocksdict

from keyedstate.backends.rocksdb.instance import RocksDBInstance
from keyedstate.backends.rocksdb.native import rocksdb_error
from keyedstate.config_values import Invalid, parse_bytes
from keyedstate.errors import BackendError, ConfigurationError
from keyedstate.serde import TypeSerializer

MiB = 1 << 20

#: The default bound of one keyed backend's value cache (``value_cache_size``): off. Measured
#: (docs/rocksdb-backend.md, "The value cache"), the cache makes a per-key access cheaper only
#: while the keys a job touches fit in it, and dearer when the state is larger: a job turns
#: it on for a hot set it knows fits.
DEFAULT_VALUE_CACHE_SIZE = 0

#: The configuration key of the bound (``JobConfig.rocksdb_value_cache_size``).
VALUE_CACHE_SIZE_KEY = "keyedstate.backend.rocksdb.value-cache-size"

#: Estimated Python bytes of one entry beside its key's and value's bytes: the dict slot, the
#: key's bytes object, the entry tuple, the decoded object, and while it is unwritten its
#: slot in the dirty dict and its stored bytes. Measured with tracemalloc (20,000 keys of 13
#: bytes, bigint and short string values): 200-230 bytes an entry written out, 300-325 while
#: unwritten; estimated 285-290, so the bound holds within about 10% while every entry is
#: unwritten, with room to spare once they are written.
ENTRY_OVERHEAD = 260

#: Eviction frees an eighth of the bound at once (one write batch per instance for the
#: unwritten values among the evicted, and the dict's front scanned once per eighth).
_EVICT_FRACTION = 8

#: The id of the first state; ids are two bytes (at most 65,536 states per keyed backend).
_MAX_STATES = 1 << 16


class _Absent:
    """The cached form of a key without a value (read as absent, cleared or expired)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()


def decodes_immutable(serializer: TypeSerializer) -> bool:
    """True when every value ``serializer`` decodes is an immutable Python value (a typed
    state of a scalar type, evolved or not): its cache entries hold decoded values, shared
    by every read. Nested types (lists, maps, structs) and untyped (pickled) states decode to
    objects a caller may change, so their entries hold the serialized bytes."""
    arrow_type = getattr(serializer, "arrow_type", None)
    return isinstance(arrow_type, pa.DataType) and not pa.types.is_nested(arrow_type)


def exact_types(serializer: TypeSerializer) -> frozenset[type]:
    """The Python types whose values ``serializer`` decodes back to an equal value of the very
    same type: a written value of one of them is cached as it is; any other is cached as its
    bytes decode (a numpy integer, a bool for a bigint, a naive datetime: what a read from
    RocksDB would return)."""
    t = getattr(serializer, "arrow_type", None)
    if not isinstance(t, pa.DataType) or not decodes_immutable(serializer):
        return frozenset()
    if pa.types.is_integer(t):
        return frozenset({int})
    if pa.types.is_float64(t):
        return frozenset({float})
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return frozenset({str})
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return frozenset({bytes})
    if pa.types.is_boolean(t):
        return frozenset({bool})
    return frozenset()


def parse_value_cache_size(value: Any) -> int:
    """``value_cache_size`` as bytes: an int, or a size string (``"32 mb"``); 0 switches the
    cache off. Anything else (negative, not a size, a bool) is a
    :class:`~keyedstate.errors.ConfigurationError` naming the value and the way out."""
    try:
        if isinstance(value, bool):
            raise Invalid
        size = parse_bytes(value)
        if size < 0:
            raise Invalid
    except Invalid:
        raise ConfigurationError(
            f"value_cache_size ({VALUE_CACHE_SIZE_KEY}) can't be {value!r}: it takes a number "
            f"of bytes, an integer or a size such as '32 mb' (0, the default, switches the "
            f"value cache off)") from None
    return size


class ValueCache:
    """The value cache of one keyed backend (module docstring): at most about ``capacity``
    estimated bytes of entries, its unwritten values (``dirty``: cache key -> stored bytes,
    None deletes) written to the instance owning their key group.

    States read ``entries`` directly (bound ``entries.get``) and change it only through
    :meth:`put` (a write: dirty until written), :meth:`fill` (a value read from RocksDB) and
    :meth:`warm` (a restored state's values, read by one scan).
    """

    def __init__(self, capacity: int, instances: Sequence[RocksDBInstance],
                 key_group_prefix_bytes: int, write_options: rocksdict.WriteOptions) -> None:
        if capacity < 1:
            raise ConfigurationError(f"a value cache needs a positive size, got {capacity}")
        self.capacity = capacity
        self._low_water = capacity - capacity // _EVICT_FRACTION
        self._instances = tuple(instances)
        self._kg_bytes = key_group_prefix_bytes
        #: key group -> index of its instance (the key groups of every instance)
        self._route: dict[int, int] = {kg: inst.index for inst in self._instances
                                       for kg in inst.key_group_range}
        #: state id -> the state's column family handle in each instance
        self._handles: dict[bytes, list[rocksdict.ColumnFamily]] = {}
        self._write_options = write_options
        #: cache key (state id + stored key) -> entry, oldest first
        self.entries: dict[bytes, tuple[Any, ...]] = {}
        #: cache key -> the bytes to store (None: delete), for values not yet in RocksDB
        self.dirty: dict[bytes, bytes | None] = {}
        #: estimated bytes of every entry
        self.bytes = 0
        self._ids: dict[str, bytes] = {}
        self._names: dict[bytes, str] = {}
        #: values read from RocksDB (a miss), entries evicted, values written (evictions and
        #: flushes): for tests and benchmarks
        self.misses = 0
        self.evictions = 0
        self.written = 0
        #: entries filled by :meth:`warm`
        self.warmed = 0

    def state_id(self, name: str) -> bytes:
        """The two-byte prefix of every cache key of state ``name`` (one per name)."""
        sid = self._ids.get(name)
        if sid is None:
            if len(self._ids) >= _MAX_STATES:
                raise BackendError(f"more than {_MAX_STATES} states in one keyed backend")
            sid = len(self._ids).to_bytes(2, "big")
            self._ids[name] = sid
            self._names[sid] = name
        return sid

    # -- the hot path ------------------------------------------------------------------------

    def put(self, ck: bytes, entry: tuple[Any, ...], stored: bytes | None) -> None:
        """A write: ``entry`` becomes the entry of ``ck`` and ``stored`` (None: a delete) its
        bytes to write. (``ValueState.update`` inlines this.)"""
        # In place: an entry keeps its place in the eviction order (its first entry), and the
        # dict no dummy slot (pop and insert would leave one per write, a resize per pass).
        entries = self.entries
        old = entries.get(ck)
        entries[ck] = entry
        self.dirty[ck] = stored
        self.bytes += entry[1] if old is None else entry[1] - old[1]
        if self.bytes > self.capacity:
            self.make_room()

    def fill(self, ck: bytes, entry: tuple[Any, ...]) -> None:
        """A value read from RocksDB (or its absence): ``entry``, nothing to write."""
        self.misses += 1
        entries = self.entries
        old = entries.get(ck)  # not None: a key twice in one bulk call
        entries[ck] = entry
        self.bytes += entry[1] if old is None else entry[1] - old[1]
        if self.bytes > self.capacity:
            self.make_room()

    # -- warming -------------------------------------------------------------------------------

    def room_for(self, entries: int) -> bool:
        """Whether ``entries`` more entries may fit below the point where the cache makes room
        (counted at their overhead alone: a lower bound of what they take)."""
        return self.bytes + entries * ENTRY_OVERHEAD <= self._low_water

    def warm(self, sid: bytes, stored: Iterable[tuple[bytes, bytes]],
             form: Callable[[bytes], Any]) -> int:
        """Fill the cache with state ``sid``'s stored ``(key, bytes)`` pairs (a scan of
        RocksDB; ``form``: the cached form of the bytes) until one would pass the point where
        the cache makes room: nothing is evicted or written, and no entry already cached is
        replaced (it may be newer than RocksDB). How many were filled (:attr:`warmed`)."""
        entries = self.entries
        # Room left below the low water, counted down locally (no attribute per entry).
        room = self._low_water - self.bytes
        filled = 0
        try:
            for key, raw in stored:
                ck = sid + key
                size = ENTRY_OVERHEAD + len(ck) + len(raw)
                if size > room:
                    break
                if ck not in entries:
                    entries[ck] = (form(raw), size)
                    room -= size
                    filled += 1
        finally:
            self.bytes = self._low_water - room
            self.warmed += filled
        return filled

    # -- writing out -------------------------------------------------------------------------

    def make_room(self) -> None:
        """Evict the oldest entries down to seven eighths of the bound, their unwritten values
        written first (one write batch per instance)."""
        excess = self.bytes - self._low_water
        victims: list[bytes] = []
        freed = 0
        for ck, entry in self.entries.items():
            victims.append(ck)
            freed += entry[1]
            if freed >= excess:
                break
        dirty = self.dirty
        self._write([(ck, dirty[ck]) for ck in victims if ck in dirty])
        entries = self.entries
        for ck in victims:
            del entries[ck]
            dirty.pop(ck, None)
        self.bytes -= freed
        self.evictions += len(victims)

    def flush(self) -> None:
        """Write every unwritten value (one write batch per instance); the entries stay,
        clean. Before a snapshot freezes the files and before any scan of the state."""
        dirty = self.dirty
        if dirty:
            self._write(dirty.items())
            dirty.clear()

    def _write(self, items: Iterable[tuple[bytes, bytes | None]]) -> None:
        """Write ``(cache key, stored bytes or None)`` pairs, one write batch per instance;
        they stay dirty when a write fails (the caller drops them once this returns)."""
        instances = self._instances
        route = self._route
        two_bytes = self._kg_bytes == 2
        batches = [rocksdict.WriteBatch(raw_mode=True) for _ in instances]
        puts = [batch.put for batch in batches]
        deletes = [batch.delete for batch in batches]
        count = 0
        # A state's column family is each batch's default while its pairs go in: passed with
        # every put, rocksdict converts the handle on every call.
        for sid, pairs in self._by_state(items):
            for batch, handle in zip(batches, self._column_families(sid)):
                batch.set_default_column_family(handle)
            for ck, stored in pairs:
                # The key group is the stored key's first byte(s): ck[2] (and ck[3]).
                i = route[(ck[2] << 8 | ck[3]) if two_bytes else ck[2]]
                if stored is None:
                    deletes[i](ck[2:])
                else:
                    puts[i](ck[2:], stored)
                count += 1
        for instance, batch in zip(instances, batches):
            if len(batch):
                try:
                    instance.db.write(batch, self._write_options)
                except Exception as exc:
                    raise rocksdb_error(exc, "writing the value cache's buffered values") \
                        from exc
        self.written += count

    def _by_state(self, items: Iterable[tuple[bytes, bytes | None]]
                  ) -> Iterable[tuple[bytes, Iterable[tuple[bytes, bytes | None]]]]:
        """``items`` grouped by their state id; as they are when the cache has seen one
        state (most jobs), whose id every cache key starts with."""
        if len(self._names) == 1:
            return ((next(iter(self._names)), items),)
        groups: dict[bytes, list[tuple[bytes, bytes | None]]] = {}
        for pair in items:
            sid = pair[0][:2]
            group = groups.get(sid)
            if group is None:
                group = groups[sid] = []
            group.append(pair)
        return groups.items()

    def _column_families(self, sid: bytes) -> list[rocksdict.ColumnFamily]:
        """State ``sid``'s column family handle in each instance."""
        of_state = self._handles.get(sid)
        if of_state is None:
            name = self._names[sid]
            of_state = self._handles[sid] = [inst.handles[name] for inst in self._instances]
        return of_state

    def forget(self, name: str) -> None:
        """Write every unwritten value, then drop state ``name``'s entries (something wrote
        its column family behind the cache: records loaded into it)."""
        self.flush()
        sid = self._ids.get(name)
        if sid is None:
            return
        entries = self.entries
        for ck in [ck for ck in entries if ck[:2] == sid]:
            self.bytes -= entries.pop(ck)[1]

    def close(self) -> None:
        """Drop every entry, written or not (the keyed backend is closing: its DBs go)."""
        self.entries.clear()
        self.dirty.clear()
        self._handles.clear()  # native references: the DBs close after this
        self.bytes = 0
