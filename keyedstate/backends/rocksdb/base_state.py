"""What every RocksDB state kind shares: the binding to the current key's column family
through the :class:`.RocksDBKeyContext`, namespaces, TTL stamps and checks, the native calls,
and the plumbing of the bulk calls (one write batch per instance). The kinds are
:mod:`.states`."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import rocksdict

from keyedstate.backends.rocksdb.instance import RocksDBInstance, StateBinding
from keyedstate.backends.rocksdb.key_context import RocksDBKeyContext
from keyedstate.backends.rocksdb.key_layout import TIMESTAMP, TS_BYTES, namespace_part
from keyedstate.backends.rocksdb.native import (
    CLOSED,
    estimate_distinct_keys,
    prefix_upper_bound,
    rocksdb_error,
    scan,
    scan_all,
)
from keyedstate.backends.rocksdb.ttl_cleanup import CleanupCursor
from keyedstate.backends.rocksdb.value_cache import (
    ABSENT,
    ENTRY_OVERHEAD,
    decodes_immutable,
    exact_types,
)
from keyedstate.errors import ConfigurationError, KeyedStateError, UserFunctionError
from keyedstate.serde import one_call_codec, serialize_namespace
from keyedstate.state.api import State
from keyedstate.state.batch_keys import BatchKeys
from keyedstate.state.descriptors import StateDescriptor, StateTtlConfig, TtlUpdateType

# Bound once: the hot paths stamp and read TTL timestamps inline.
_pack_ts = TIMESTAMP.pack
_unpack_ts = TIMESTAMP.unpack_from


_UNSET = object()


class RocksDBState(State):
    """A state bound to one column family, the backend's current key and its own namespace.

    The full key is cached and rebuilt only when the backend's key prefix object changes (one
    identity check per access), so get and update cost little more than raw rocksdict. When
    the backend has several RocksDB instances, the state is bound to the column family of the
    current key's instance, rebound on that same path (a key change), so routing costs
    nothing more per access. Every method computes the key (``_key()``) before it touches
    ``_cf``, ``_handle`` or a batch, so the binding is always the current key's.

    Its binding to every instance is built once (:meth:`RocksDBInstance.binding`; a
    registered state's column families never change, ``drop_state`` refuses it): with random
    keys most key changes change the instance, and a rebinding is then one tuple unpacking.
    """

    def __init__(self, context: RocksDBKeyContext, descriptor: StateDescriptor,
                 instance: RocksDBInstance) -> None:
        self._context = context
        self.descriptor = descriptor
        self.name = descriptor.name
        #: each instance's binding, by instance index (the instances' order)
        self._bindings = [inst.binding(self.name) for inst in context.instances]
        self._inst: RocksDBInstance = instance
        self._bind(instance)
        # One Python call per value on the per-key path (same bytes as the serializer's own)
        self._ser, self._deser = one_call_codec(descriptor.value_serializer)
        self._check = descriptor.value_serializer.to_plain
        self._what = f"accessing state {descriptor.name!r}"
        self._ns_part = namespace_part(serialize_namespace(None))
        self._kp: object = _UNSET
        self._full = b""
        ttl = descriptor.ttl
        self._ttl: StateTtlConfig | None = ttl
        self._ttl_ms = ttl.ttl_ms if ttl is not None else 0
        self._refresh_on_read = ttl is not None and ttl.update_type == TtlUpdateType.ON_READ_AND_WRITE
        self._cleanup = (CleanupCursor(context.instances, self.name, self._ttl_ms)
                         if ttl and ttl.incremental_cleanup_size else None)

    # -- keys ----------------------------------------------------------------------------------

    def _key(self) -> bytes:
        kp = self._context.key_prefix
        if kp is self._kp:
            return self._full
        return self._rekey(kp)

    def _rekey(self, kp: bytes | None) -> bytes:
        if kp is None:
            raise ConfigurationError(
                f"state {self.name!r} was used without a current key; call set_current_key() "
                f"on the keyed backend first"
            )
        context = self._context
        if context.sharded:
            instance = context.current_instance
            if instance is not self._inst:
                # _bind inlined: with random keys this runs on most key changes
                (self._inst, self._cf, self._handle, self._get, self._put,
                 self._delete) = self._bindings[instance.index]
        self._kp = kp
        self._full = kp + self._ns_part
        return self._full

    def _bind(self, instance: RocksDBInstance) -> None:
        """Use ``instance``'s column family (a closed backend's stand-in raises)."""
        (self._inst, self._cf, self._handle, self._get, self._put,
         self._delete) = self._bindings[instance.index]

    def set_current_namespace(self, namespace: Any) -> None:
        self._ns_part = namespace_part(serialize_namespace(namespace))
        self._kp = _UNSET

    # -- TTL -----------------------------------------------------------------------------------

    def _now(self) -> int:
        return self._context.time_provider.now_ms()

    def _wrap(self, data: bytes) -> bytes:
        """Stored bytes of a value just written (stamped under TTL)."""
        if self._ttl is None:
            return data
        return _pack_ts(self._now()) + data

    def _live(self, key: bytes, raw: bytes, now: int, batch: rocksdict.WriteBatch | None = None,
              cf: rocksdict.Rdict | None = None) -> bytes | None:
        """The payload of a stored TTL value, or None (and deleted) when it expired; refreshed
        on read under ``ON_READ_AND_WRITE``. Writes go to ``batch`` when given, else to ``cf``
        (default: the current key's column family)."""
        target = self._cf if cf is None else cf
        if _unpack_ts(raw)[0] + self._ttl_ms <= now:
            if batch is None:
                self._native(target.delete, key)
            else:
                batch.delete(key)
            return None
        if self._refresh_on_read:
            fresh = _pack_ts(now) + raw[TS_BYTES:]
            if batch is None:
                self._native(target.put, key, fresh)
            else:
                batch.put(key, fresh)
        return raw[TS_BYTES:]

    def _read(self, key: bytes) -> bytes | None:
        """The live payload stored under ``key`` (None when absent or expired)."""
        try:
            raw = self._get(key)
        except Exception as exc:
            raise rocksdb_error(exc, self._what) from exc
        if raw is None or self._ttl is None:
            return raw
        self._cleanup_step()
        return self._live(key, raw, self._now())

    def _write(self, key: bytes, data: bytes) -> None:
        if self._ttl is not None:
            self._cleanup_step()
            data = _pack_ts(self._now()) + data
        try:
            self._put(key, data)
        except Exception as exc:
            raise rocksdb_error(exc, self._what) from exc

    def _cleanup_step(self) -> None:
        if self._cleanup is not None:
            self._cleanup.step(self._ttl.incremental_cleanup_size, self._now())  # type: ignore[union-attr]

    def reset_cleanup_cursor(self) -> None:
        """Drop the cleanup iterator (it pins files); the next step re-seeks where it was."""
        if self._cleanup is not None:
            self._cleanup.reset()

    # -- native helpers ------------------------------------------------------------------------

    def _native(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            raise rocksdb_error(exc, self._what) from exc

    def _batch(self) -> rocksdict.WriteBatch:
        batch = rocksdict.WriteBatch(raw_mode=True)
        batch.set_default_column_family(self._handle)
        return batch

    def _commit(self, batch: rocksdict.WriteBatch) -> None:
        if len(batch):
            self._native(self._inst.db.write, batch, self._context.write_options)

    def _scan_prefix(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return scan(self._cf, prefix, prefix_upper_bound(prefix), self._what)

    def _delete_prefix(self, prefix: bytes, batch: rocksdict.WriteBatch) -> None:
        # Point deletes, not delete_range: lists and maps are small, and many small range
        # tombstones slow every later read of the column family.
        for key, _ in self._scan_prefix(prefix):
            batch.delete(key)

    def _user_call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except KeyedStateError:
            raise
        except Exception as exc:
            raise self._user_error(what, exc) from exc

    def _user_error(self, what: str, exc: Exception) -> UserFunctionError:
        """The error to raise ``from exc`` for the user function ``what`` (per-key paths)."""
        return UserFunctionError(
            f"the {what} of state {self.name!r} raised {type(exc).__name__}: {exc}; the "
            f"state is unchanged, fix the function")

    # -- bulk ----------------------------------------------------------------------------------

    def _bulk_keys(self, keys: BatchKeys) -> list[bytes]:
        """The stored key of each of ``keys`` in the current namespace (checks the range)."""
        ns = self._ns_part
        return [prefix + ns for prefix in self._context.bulk_key_prefixes(keys)]

    def _bulk_targets(self, keys: BatchKeys) -> _BulkTargets:
        return _BulkTargets(self, keys)

    def _multi_get(self, keys: BatchKeys, stored_keys: list[bytes]) -> list[bytes | None]:
        """The raw stored bytes of ``stored_keys`` (one per key of ``keys``, in the instance of
        that key; None where absent)."""
        # One point lookup per key, not rocksdict's multi-get (``get`` of a list): measured at
        # 50 K keys, 1.1 us per key against 2.5-2.9 us for the multi-get, in memtable and in
        # SST files alike (rocksdict copies and converts more per key in its batched call).
        shards = self._context.bulk_shards(keys)
        try:
            if len(shards) == 1 and shards[0][1] is None:
                get = shards[0][0].cf(self.name).get
                return [get(k) for k in stored_keys]
            out: list[bytes | None] = [None] * len(stored_keys)
            for instance, positions in shards:
                assert positions is not None
                get = instance.cf(self.name).get
                for i in positions:
                    out[i] = get(stored_keys[i])
            return out
        except Exception as exc:
            raise rocksdb_error(exc, self._what) from exc

    def _cleanup_steps(self, accesses: int) -> None:
        """The incremental cleanup of ``accesses`` per-key accesses, at once."""
        if self._cleanup is not None and accesses:
            self._cleanup.step(self._ttl.incremental_cleanup_size * accesses,  # type: ignore[union-attr]
                               self._now())

    def _read_many(self, keys: BatchKeys, stored_keys: list[bytes]) -> list[bytes | None]:
        """The live payload of each of ``stored_keys`` (as :meth:`_read` of each): expired
        values deleted, refreshed on read under ``ON_READ_AND_WRITE``, in one write batch."""
        raws = self._multi_get(keys, stored_keys)
        if self._ttl is None:
            return raws
        # As _read: a cleanup step per key found (after its read, before its expiry check).
        self._cleanup_steps(sum(raw is not None for raw in raws))
        now = self._now()
        targets = self._bulk_targets(keys)
        live = self._live
        out = [None if raw is None else live(key, raw, now, batch)
               for key, raw, batch in zip(stored_keys, raws, targets.batch_of)]
        targets.commit()
        return out

    def _put_many(self, keys: BatchKeys, stored_keys: list[bytes],
                  payloads: list[bytes | None], *, cleanup: bool = True) -> None:
        """Store each payload (stamped under TTL; None deletes) in one write batch per
        instance, as :meth:`_write` (and its cleanup step) of each."""
        if self._ttl is not None and cleanup:
            self._cleanup_steps(len(stored_keys))
        stamp = _pack_ts(self._now()) if self._ttl is not None else b""
        targets = self._bulk_targets(keys)
        for key, data, batch in zip(stored_keys, payloads, targets.batch_of):
            if data is None:
                batch.delete(key)
            else:
                batch.put(key, stamp + data if stamp else data)
        targets.commit()

    def _deser_or_none(self, payloads: list[bytes | None]) -> list[Any]:
        deser = self._deser
        return [None if raw is None else deser(raw) for raw in payloads]

    def clear_many(self, keys: BatchKeys) -> None:
        self._put_many(keys, self._bulk_keys(keys), [None] * len(keys), cleanup=False)

    def clear(self) -> None:
        key = self._key()
        self._native(self._delete, key)

    def close(self) -> None:
        """Drop every native reference so the DB can close (later use raises BackendError)."""
        self._cleanup = None
        self._bindings = [StateBinding(b.instance, CLOSED, None, CLOSED.get, CLOSED.get,
                                       CLOSED.get)
                          for b in self._bindings]
        self._bind(self._inst)


def _closed_cache(*_: Any) -> Any:
    raise rocksdb_error(rocksdict.DbClosedError("the keyed backend is closed"),
                        "accessing a state")


class _ClosedCache(dict):
    """Stands in for the cache's dicts once the backend is closed: a write raises."""

    def __setitem__(self, key: Any, value: Any) -> None:
        _closed_cache()


_CLOSED_CACHE: Any = _ClosedCache()


class RocksDBCachedState(RocksDBState):
    """A single-value state (value, reducing, aggregating) read and written through its keyed
    backend's value cache (:mod:`.value_cache`): what every call returns and what reaches
    RocksDB are those of :class:`RocksDBState`'s calls, the writes later.

    The cache key of the current key (state id + stored key) is rebuilt with the stored key,
    on a key change only. The primitives return and take the *cached form*: the decoded value
    when :attr:`_decoded`, else the serialized bytes; :data:`ABSENT` for no value. TTL
    stamps, expiry, refresh on read and the incremental cleanup's steps happen at the same
    calls, with the same clock readings, as without the cache."""

    def __init__(self, context: RocksDBKeyContext, descriptor: StateDescriptor,
                 instance: RocksDBInstance) -> None:
        self._ck = b""
        super().__init__(context, descriptor, instance)
        cache = context.value_cache
        assert cache is not None
        self._sid = cache.state_id(self.name)
        self._vget: Callable[[bytes], tuple[Any, ...] | None] = cache.entries.get
        self._vput: Callable[[bytes, tuple[Any, ...], bytes | None], None] = cache.put
        self._vfill: Callable[[bytes, tuple[Any, ...]], None] = cache.fill
        self._cache = cache
        self._entries = cache.entries
        self._dirty = cache.dirty
        #: each instance's column family ``get`` (by instance index), for a miss
        self._gets: list[Callable[[bytes], bytes | None]] = [
            binding.get for binding in self._bindings]
        serializer = self.descriptor.value_serializer
        #: entries hold decoded values (immutable ones), else serialized bytes
        self._decoded = decodes_immutable(serializer)
        self._exact = exact_types(serializer)

    def _rekey(self, kp: bytes | None) -> bytes:
        # No rebinding to the key's instance here, unlike RocksDBState._rekey: a hit needs
        # none; a miss binds first (_bound_get).
        if kp is None:
            return super()._rekey(kp)  # raises
        self._kp = kp
        self._full = full = kp + self._ns_part
        self._ck = self._sid + full
        return full

    def _bound_get(self) -> Callable[[bytes], bytes | None]:
        """The column family ``get`` of the current key's instance (looked up on a miss only)."""
        context = self._context
        if context.sharded:
            return self._gets[context.current_instance.index]
        return self._get

    def _current(self) -> tuple[bytes, bytes]:
        """The cache key and the stored key of the current key."""
        kp = self._context.key_prefix
        if kp is not self._kp:
            self._rekey(kp)
        return self._ck, self._full

    def _form(self, value: Any, data: bytes) -> Any:
        """The cached form of ``value``, just serialized to ``data``: what a read of ``data``
        would decode to."""
        if not self._decoded:
            return data
        return value if type(value) in self._exact else self._deser(data)

    def _loaded(self, forms: list[Any], default: Any) -> list[Any]:
        """The values of ``forms`` (``default`` for :data:`ABSENT`), as :meth:`_load` of each."""
        if self._decoded:
            return [default if form is ABSENT else form for form in forms]
        deser = self._deser
        return [default if form is ABSENT else deser(form) for form in forms]

    def _load(self, form: Any) -> Any:
        """The value of a cached form (not :data:`ABSENT`): a fresh object per read where the
        type is mutable."""
        return form if self._decoded else self._deser(form)

    def warm(self) -> int:
        """Fill the value cache with this state's stored values, one scan per instance in key
        order, when its estimated key count fits (:meth:`ValueCache.warm`: until the cache
        would make room); how many. For a backend just restored, before the job reads: a
        scan costs a fraction of a point get a key (docs/rocksdb-backend.md, "The value
        cache"). A TTL state is not warmed: a read of one is a cleanup step, may expire or
        refresh the value, and only the job's reads do that."""
        if self._ttl is not None:
            return 0
        cfs = [binding.cf for binding in self._bindings]
        keys = sum(estimate_distinct_keys(cf, self._what) for cf in cfs)
        if keys == 0 or not self._cache.room_for(keys):
            return 0
        form: Callable[[bytes], Any] = self._deser if self._decoded else bytes
        return self._cache.warm(
            self._sid, (item for cf in cfs for item in scan_all(cf, self._what)), form)

    # -- one key -------------------------------------------------------------------------------

    def _cached(self, ck: bytes, full: bytes) -> Any:
        """The cached form of the live value under ``ck`` (:data:`ABSENT`: none), as
        :meth:`RocksDBState._read`: an expired value deleted, refreshed on read under
        ``ON_READ_AND_WRITE``, a cleanup step when a value is found."""
        entry = self._vget(ck)
        if entry is None:
            try:
                raw = self._bound_get()(full)
            except Exception as exc:
                raise rocksdb_error(exc, self._what) from exc
            return self._filled(ck, raw, None)
        if self._ttl is None:
            return entry[0]
        form = entry[0]
        if form is ABSENT:
            return ABSENT
        self._cleanup_step()
        return self._live_entry(ck, entry, self._now())

    def _live_entry(self, ck: bytes, entry: tuple[Any, ...], now: int) -> Any:
        """The cached form of a TTL state's cached ``entry`` (not absent) read at ``now``."""
        if entry[2] + self._ttl_ms <= now:
            self._vput(ck, (ABSENT, ENTRY_OVERHEAD + len(ck), 0, b""), None)
            return ABSENT
        if self._refresh_on_read:
            payload = entry[3]
            self._vput(ck, (entry[0], entry[1], now, payload), _pack_ts(now) + payload)
        return entry[0]

    def _filled(self, ck: bytes, raw: bytes | None, now: int | None) -> Any:
        """Cache what RocksDB holds under ``ck`` (``raw``) and return its cached form, as
        :meth:`_cached`; ``now``: the clock reading of a bulk read (its cleanup steps are
        done), None: one key's read (a cleanup step here when a value is found)."""
        if raw is None:
            if self._ttl is None:
                self._vfill(ck, (ABSENT, ENTRY_OVERHEAD + len(ck)))
            else:
                self._vfill(ck, (ABSENT, ENTRY_OVERHEAD + len(ck), 0, b""))
            return ABSENT
        if self._ttl is None:
            form = self._deser(raw) if self._decoded else raw
            # ValueCache.fill inlined (the miss path of a state larger than the cache)
            cache = self._cache
            cache.misses += 1
            size = ENTRY_OVERHEAD + len(ck) + len(raw)
            old = self._vget(ck)
            self._entries[ck] = (form, size)
            cache.bytes += size if old is None else size - old[1]
            if cache.bytes > cache.capacity:
                cache.make_room()
            return form
        if now is None:
            self._cleanup_step()
            now = self._now()
        payload = raw[TS_BYTES:]
        if _unpack_ts(raw)[0] + self._ttl_ms <= now:
            self._vput(ck, (ABSENT, ENTRY_OVERHEAD + len(ck), 0, b""), None)
            return ABSENT
        form = self._deser(payload) if self._decoded else payload
        size = ENTRY_OVERHEAD + len(ck) + 2 * len(payload)
        if self._refresh_on_read:
            self._vput(ck, (form, size, now, payload), _pack_ts(now) + payload)
        else:
            self._vfill(ck, (form, size, _unpack_ts(raw)[0], payload))
        return form

    def _store(self, ck: bytes, value: Any, data: bytes) -> None:
        """Write ``value`` (serialized: ``data``) under ``ck``, as :meth:`RocksDBState._write`
        (stamped under TTL, after a cleanup step)."""
        if self._ttl is None:
            self._vput(ck, (self._form(value, data), ENTRY_OVERHEAD + len(ck) + len(data)),
                       data)
            return
        self._cleanup_step()
        now = self._now()
        self._vput(ck, (self._form(value, data), ENTRY_OVERHEAD + len(ck) + 2 * len(data),
                        now, data), _pack_ts(now) + data)

    def _remove(self, ck: bytes) -> None:
        """Delete the value under ``ck`` (no cleanup step, as :meth:`RocksDBState.clear`)."""
        if self._ttl is None:
            self._vput(ck, (ABSENT, ENTRY_OVERHEAD + len(ck)), None)
        else:
            self._vput(ck, (ABSENT, ENTRY_OVERHEAD + len(ck), 0, b""), None)

    def clear(self) -> None:
        self._remove(self._current()[0])

    # -- bulk ----------------------------------------------------------------------------------

    def _cache_keys(self, keys: BatchKeys) -> list[bytes]:
        """The cache key of each of ``keys`` in the current namespace (checks the range)."""
        head = self._sid
        ns = self._ns_part
        return [head + prefix + ns for prefix in self._context.bulk_key_prefixes(keys)]

    def _cached_many(self, keys: BatchKeys, cks: list[bytes]) -> list[Any]:
        """The cached form of each of ``cks`` (:data:`ABSENT`: none), as
        :meth:`RocksDBState._read_many`: missing entries read from RocksDB with one point
        lookup per key (in the instance of its key), then one cleanup step per value found,
        then every expiry check at one clock reading."""
        vget = self._vget
        entries = [vget(ck) for ck in cks]
        raws: list[bytes | None] = []
        misses = [i for i, entry in enumerate(entries) if entry is None]
        if misses:
            raws = self._fetch(keys, cks, misses)
        if self._ttl is None:
            out = [None if entry is None else entry[0] for entry in entries]
            for i, raw in zip(misses, raws):
                out[i] = self._filled(cks[i], raw, None)
            return out
        found = sum(1 for entry in entries if entry is not None and entry[0] is not ABSENT)
        self._cleanup_steps(found + sum(1 for raw in raws if raw is not None))
        now = self._now()
        out = [None] * len(cks)
        fetched = dict(zip(misses, raws))
        live = self._live_entry
        for i, (ck, entry) in enumerate(zip(cks, entries)):
            if entry is None:
                out[i] = self._filled(ck, fetched[i], now)
            elif entry[0] is ABSENT:
                out[i] = ABSENT
            else:
                out[i] = live(ck, entry, now)
        return out

    def _fetch(self, keys: BatchKeys, cks: list[bytes], positions: list[int]
               ) -> list[bytes | None]:
        """RocksDB's bytes of ``cks[i]`` for each of ``positions`` (point lookups in the
        instance of each key)."""
        shards = self._context.bulk_shards(keys)
        try:
            if len(shards) == 1 and shards[0][1] is None:
                get = shards[0][0].cf(self.name).get
                return [get(cks[i][2:]) for i in positions]
            instance_at: dict[int, RocksDBInstance] = {}
            for instance, where in shards:
                assert where is not None
                for i in where:
                    instance_at[i] = instance
            return [instance_at[i].cf(self.name).get(cks[i][2:]) for i in positions]
        except Exception as exc:
            raise rocksdb_error(exc, self._what) from exc

    def _store_many(self, cks: list[bytes], values: list[Any], payloads: list[bytes | None],
                    *, cleanup: bool = True) -> None:
        """Write each value (serialized: its payload; None deletes), as
        :meth:`RocksDBState._put_many`: the cleanup steps of every write first, one stamp."""
        put = self._vput
        if self._ttl is None:
            # ValueCache.put inlined, as in ValueState.update
            vget, entries, dirty, cache = self._vget, self._entries, self._dirty, self._cache
            exact, form_of = self._exact, self._form
            for ck, value, data in zip(cks, values, payloads):
                if data is None:
                    entry: tuple[Any, ...] = (ABSENT, ENTRY_OVERHEAD + len(ck))
                else:
                    entry = (value if type(value) in exact else form_of(value, data),
                             ENTRY_OVERHEAD + len(ck) + len(data))
                old = vget(ck)
                entries[ck] = entry
                dirty[ck] = data
                cache.bytes += entry[1] if old is None else entry[1] - old[1]
                if cache.bytes > cache.capacity:
                    cache.make_room()
            return
        if cleanup:
            self._cleanup_steps(len(cks))
        now = self._now()
        stamp = _pack_ts(now)
        for ck, value, data in zip(cks, values, payloads):
            if data is None:
                put(ck, (ABSENT, ENTRY_OVERHEAD + len(ck), 0, b""), None)
            else:
                put(ck, (self._form(value, data), ENTRY_OVERHEAD + len(ck) + 2 * len(data),
                         now, data), stamp + data)

    def clear_many(self, keys: BatchKeys) -> None:
        cks = self._cache_keys(keys)
        self._store_many(cks, [None] * len(cks), [None] * len(cks), cleanup=False)

    def close(self) -> None:
        super().close()
        self._vget = self._vput = self._vfill = _closed_cache
        self._entries = self._dirty = _CLOSED_CACHE
        self._gets = [CLOSED.get] * len(self._gets)  # native references go before the DBs


class _BulkTargets:
    """Where a bulk call over ``keys`` writes and scans: one write batch per instance, and
    per key (in the keys' order) the batch and column family of its instance."""

    def __init__(self, state: RocksDBState, keys: BatchKeys) -> None:
        self._state = state
        self.batches: list[tuple[RocksDBInstance, rocksdict.WriteBatch]] = []
        n = len(keys)
        self.batch_of: list[rocksdict.WriteBatch] = []
        self.cf_of: list[rocksdict.Rdict] = []
        for instance, positions in state._context.bulk_shards(keys):
            batch = rocksdict.WriteBatch(raw_mode=True)
            batch.set_default_column_family(instance.handles.get(state.name))
            self.batches.append((instance, batch))
            cf = instance.cf(state.name)
            if positions is None:
                self.batch_of, self.cf_of = [batch] * n, [cf] * n
                break
            if not self.batch_of:
                self.batch_of, self.cf_of = [batch] * n, [cf] * n
            for i in positions:
                self.batch_of[i] = batch
                self.cf_of[i] = cf

    def commit(self) -> None:
        write_options = self._state._context.write_options
        for instance, batch in self.batches:
            if len(batch):
                self._state._native(instance.db.write, batch, write_options)
