"""The RocksDB keyed backend of one subtask: its key context, states, timers, snapshots and
lifecycle over its RocksDB instances (:mod:`.instance`); created by
:meth:`~keyedstate.backends.rocksdb.backend.RocksDBStateBackend.create_keyed_backend`.
Whole-state passes (reading every entry, purging expired ones) are :mod:`.scans`.
"""

from __future__ import annotations

import copy
import itertools
import os
import shutil
import time
import uuid
from typing import Any, Callable, Iterable, Iterator, Sequence, cast

from keyedstate.backends.base.backend import (
    KeyedStateBackend,
    SnapshotResult,
    StateEntry,
    StateRecord,
    check_compatible,
    check_load_compatible,
    meta_info_of,
)
from keyedstate.backends.base.migration import TTL_ON, StateMigration, plan_migration
from keyedstate.backends.rocksdb.base_state import RocksDBCachedState, RocksDBState
from keyedstate.backends.rocksdb.instance import RocksDBInstance, rolling_compaction
from keyedstate.backends.rocksdb.key_layout import (
    SEQUENCE,
    SHORT_VARINTS,
    TS_BYTES,
    key_prefix,
    pack_timestamp,
    state_key,
    unpack_timestamp,
    varint,
)
from keyedstate.backends.rocksdb.native import CLOSED, column_family_batch, native
from keyedstate.backends.rocksdb.options import RocksDBOptions
from keyedstate.backends.rocksdb.restore import RestoredInstance
from keyedstate.backends.rocksdb.scans import (
    LOAD_BATCH,
    iter_state_entries,
    iter_state_records,
    purge_expired,
    rewrite_values,
)
from keyedstate.backends.rocksdb.snapshot import (
    META_FILE,
    PROP_BASE_CHECKPOINT,
    PROP_COMPACTED_INSTANCE,
    PROP_INSTANCES,
    PROP_KEY_GROUP_PREFIX_BYTES,
    PROP_LIST_SEQUENCE,
    InstanceSnapshot,
    MetaFile,
    RocksDBSnapshotResult,
    StateMetaInfoSnapshot,
    format_instance_ranges,
    instance_prefix,
    write_meta_file,
)
from keyedstate.backends.rocksdb.states import CACHED_STATE_CLASSES, STATE_CLASSES
from keyedstate.backends.rocksdb.timers import RocksDBTimerService
from keyedstate.backends.rocksdb.value_cache import DEFAULT_VALUE_CACHE_SIZE, ValueCache
from keyedstate.errors import (
    BackendError,
    ConfigurationError,
    SerializationError,
    StateNotFoundError,
)
from keyedstate.keygroups import KeyGroupRange, key_group_prefix_bytes, serialize_key_group
from keyedstate.keys import KeySerializer
from keyedstate.serde import TypeSerializer
from keyedstate.state.batch_keys import BatchKeys
from keyedstate.state.descriptors import S, StateDescriptor, StateKind
from keyedstate.state.timers import TIMER_STATE_NAMES
from keyedstate.state.ttl import TtlTimeProvider
from keyedstate.storage.handles import StateMetaInfo
from keyedstate.storage.location import CheckpointStorageLocation
from keyedstate.storage.transfer import RESTORE_PREFIX, RestorePhases, TransferStats

BACKEND_NAME = "rocksdb"
_pack_seq = SEQUENCE.pack


class RocksDBKeyedStateBackend(KeyedStateBackend):
    """Keyed state of one subtask in one or more RocksDB instances (key-group shards, see
    :class:`RocksDBInstance`), in key-group order and together covering ``key_group_range``
    exactly. ``RocksDBOptions.key_group_shards`` instances when fresh; a restore keeps the
    restored handles' instances (:mod:`.restore`). Created by
    :meth:`RocksDBStateBackend.create_keyed_backend`; removes its directory on :meth:`close`.
    Its states and timers see it as their :class:`.RocksDBKeyContext`: they read
    ``key_prefix``, ``current_instance`` and ``sharded``; only the backend writes them.

    With ``value_cache_size`` > 0 its value, reducing and aggregating states go through a
    :class:`.ValueCache` of about that many bytes (:mod:`.value_cache`): its buffered writes
    reach RocksDB at every :meth:`snapshot` (before the files are frozen), before every whole-state
    read (:meth:`iter_entries`, :meth:`iter_records`, :meth:`load_records`) and when it evicts.
    """

    name = BACKEND_NAME

    def __init__(self, *, subtask_index: int, key_group_range: KeyGroupRange,
                 max_parallelism: int, key_serializer: KeySerializer,
                 time_provider: TtlTimeProvider | None, instances: Sequence[RestoredInstance],
                 instance_dir: str, options: RocksDBOptions, incremental: bool,
                 restored_states: dict[str, StateMetaInfoSnapshot],
                 list_sequence: int, state_migration: str = "lazy",
                 value_cache_size: int = DEFAULT_VALUE_CACHE_SIZE) -> None:
        super().__init__(subtask_index=subtask_index, key_group_range=key_group_range,
                         max_parallelism=max_parallelism, key_serializer=key_serializer,
                         time_provider=time_provider)
        if not key_group_range.is_split_into([i.key_group_range for i in instances]):
            raise BackendError(
                f"RocksDB instances {[str(i.key_group_range) for i in instances]} do not cover "
                f"{key_group_range} exactly; this is a bug in the restore")
        self._instances = [
            RocksDBInstance(index=k, key_group_range=r.key_group_range, db=r.db, path=r.path,
                            options=options, incremental=incremental)
            for k, r in enumerate(instances)]
        for instance, restored in zip(self._instances, instances):
            if restored.base is not None and incremental:
                instance.snapshot_strategy.set_restored_base(restored.base)
        #: more than one instance: states and timers route by key group
        self.sharded = len(self._instances) > 1
        #: the instance owning each key group of the range (index: key group - range start)
        self._instance_of = [inst for inst in self._instances for _ in inst.key_group_range]
        #: the instance of the current key (kept up to date only when sharded)
        self.current_instance = self._instances[0]
        self.db = self._instances[0].db
        self.instance_dir = instance_dir
        self.options = options
        self.write_options = options.write_options()
        self.key_group_prefix_bytes = key_group_prefix_bytes(max_parallelism)
        self._kg_bytes = [serialize_key_group(kg, self.key_group_prefix_bytes)
                          for kg in range(key_group_range.start, key_group_range.end + 1)]
        #: ``[key group][varint len][key]`` of the current key; a new object on every key
        #: change, so states notice with one identity check.
        self.key_prefix: bytes | None = None
        self._list_sequence = list_sequence
        self._restored = dict(restored_states)
        self._states: dict[str, RocksDBState] = {}
        self.state_migration = state_migration
        self._closed = False
        self.incremental = incremental
        #: what the restore moved, reported by the first snapshot's properties
        self.restore_stats: TransferStats | None = None
        #: how long the restore fetched its files and opened its instances (None: no restore)
        self.restore_phases: RestorePhases | None = None
        #: sub-handles the restore rewrote key by key into SST files (over ``max_instances``)
        self.ingested_on_restore = 0
        with native(f"opening the column families of {instance_dir}"):
            for name in [*self._restored, *TIMER_STATE_NAMES.values()]:
                self._column_family(name)
        self._timers = RocksDBTimerService(self)
        #: the value cache of the single-value states (None: off)
        self.value_cache = (ValueCache(value_cache_size, self._instances,
                                       self.key_group_prefix_bytes, self.write_options)
                            if value_cache_size > 0 else None)

    @property
    def instances(self) -> tuple[RocksDBInstance, ...]:
        """The RocksDB instances, in key-group order."""
        return tuple(self._instances)

    def instance_of(self, key_group: int) -> RocksDBInstance:
        """The instance owning ``key_group`` (which must be in this backend's range)."""
        return self._instance_of[key_group - self.key_group_range.start]

    # -- key context ---------------------------------------------------------------------------

    def _set_current(self, key: Any, key_bytes: bytes, key_group: int) -> None:
        # The base class's check and assignments inlined (no super() call on the per-key path);
        # the base raises the error of a key group outside the range.
        key_groups = self.key_group_range
        offset = key_group - key_groups.start
        if offset < 0 or key_group > key_groups.end:
            super()._set_current(key, key_bytes, key_group)
        self.current_key = key
        self.current_key_bytes = key_bytes
        self.current_key_group = key_group
        if self.sharded:
            # Set before the new prefix object: states rebind when they see the prefix change.
            self.current_instance = self._instance_of[offset]
        # key_prefix() inlined: no call on the per-key path
        n = len(key_bytes)
        self.key_prefix = (self._kg_bytes[offset] + (SHORT_VARINTS[n] if n < 0x80 else varint(n))
                           + key_bytes)

    def set_current_batch_key(self, keys: BatchKeys, index: int) -> None:
        # _set_current's body once more, not a call to it: the per-key runtime loop calls this
        # for every key of a batch, and the call saved is about a fifth of a key change.
        key_group = keys.key_groups[index]
        key_groups = self.key_group_range
        offset = key_group - key_groups.start
        if offset < 0 or key_group > key_groups.end:
            super()._set_current(keys.keys[index], keys.key_bytes[index], key_group)  # raises
        key_bytes = keys.key_bytes[index]
        self.current_key = keys.keys[index]
        self.current_key_bytes = key_bytes
        self.current_key_group = key_group
        if self.sharded:
            self.current_instance = self._instance_of[offset]
        n = len(key_bytes)
        self.key_prefix = (self._kg_bytes[offset] + (SHORT_VARINTS[n] if n < 0x80 else varint(n))
                           + key_bytes)

    def clear_current_key(self) -> None:
        super().clear_current_key()
        self.key_prefix = None

    def bulk_key_prefixes(self, keys: BatchKeys) -> list[bytes]:
        """``[key group][varint len][key]`` of each of ``keys`` (the bytes :meth:`_set_current`
        builds for one key), built once per batch keys and shared by every state's bulk
        calls. Checks the key groups against this backend's range first."""
        def build() -> list[bytes]:
            self.check_batch_keys(keys)
            start = self.key_group_range.start
            kg_bytes = self._kg_bytes
            return [key_prefix(kg_bytes[kg - start], kb)
                    for kb, kg in zip(keys.key_bytes, keys.key_groups)]
        return cast(list[bytes], keys.cached(("rocksdb-prefixes", id(self)), build))

    def bulk_shards(self, keys: BatchKeys) -> list[tuple[RocksDBInstance, list[int] | None]]:
        """The instances ``keys`` lie in, each with the positions of its keys (None: all of
        them, the one instance of an unsharded backend)."""
        if not self.sharded:
            return [(self._instances[0], None)]

        def build() -> list[tuple[RocksDBInstance, list[int] | None]]:
            start = self.key_group_range.start
            positions: dict[int, list[int]] = {}
            for i, kg in enumerate(keys.key_groups):
                positions.setdefault(self._instance_of[kg - start].index, []).append(i)
            return [(self._instances[k], positions[k]) for k in sorted(positions)]
        return cast(list[tuple[RocksDBInstance, "list[int] | None"]],
                    keys.cached(("rocksdb-shards", id(self)), build))

    def next_list_seq(self) -> int:
        """The next list element's sequence number (only grows, survives restore)."""
        self._list_sequence += 1
        return self._list_sequence

    # -- column families -----------------------------------------------------------------------

    def _column_family(self, name: str) -> None:
        """Create the column family of a state in every instance when missing."""
        for instance in self._instances:
            instance.column_family(name)

    # -- states --------------------------------------------------------------------------------

    def get_state(self, descriptor: StateDescriptor[S]) -> S:
        state = self._states.get(descriptor.name)
        if state is not None:
            if state.descriptor is not descriptor:
                check_compatible(descriptor, meta_info_of(state.descriptor))
            return cast(S, state)  # the kind is checked: the state class is the descriptor's
        self._check_open()
        restored = self._restored.get(descriptor.name)
        bound = descriptor
        if restored is not None:
            migration = plan_migration(descriptor, restored.meta, restored.value_serializer)
            if migration is not None and migration.ttl is not None:
                # Switching TTL rewrites every stored value's timestamp prefix, not the value.
                self._switch_ttl(descriptor.name, migration)
            if migration is not None and migration.resolution is None:
                migration = None  # TTL switched, the type as is
            if migration is not None and self.state_migration == "eager":
                self._migrate_eagerly(descriptor.name, migration, descriptor.ttl is not None)
            elif migration is not None or restored.value_serializer != descriptor.value_serializer:
                # The state reads and writes through the restored state's history of types
                # (plus the new one): bound to a copy of the descriptor carrying that
                # serializer, so every path (states, snapshots, iteration) uses it.
                bound = copy.copy(descriptor)
                bound.value_serializer = (restored.value_serializer if migration is None
                                          else migration.evolved_serializer())
        with native(f"creating the column family of state {descriptor.name!r}"):
            self._column_family(descriptor.name)
        state_class = STATE_CLASSES[descriptor.kind]
        if self.value_cache is not None:
            state_class = CACHED_STATE_CLASSES.get(descriptor.kind, state_class)
        state = state_class(self, bound, self.current_instance)
        self._states[descriptor.name] = state
        if restored is not None and isinstance(state, RocksDBCachedState):
            # Restored values read back by one scan before the job's first read, not by a
            # point get each (docs/rocksdb-backend.md, "The value cache").
            state.warm()
        return cast(S, state)

    def _migrate_eagerly(self, name: str, migration: StateMigration, ttl: bool) -> None:
        """Rewrite every stored value of state ``name`` in the new type; TTL timestamps are
        kept as they are."""
        deserialize, migrate = migration.old.deserialize, migration.migrate
        serialize = migration.new.serialize
        skip = TS_BYTES if ttl else 0
        rewrite_values(self._instances, name, f"migrating state {name!r}",
                       lambda raw: raw[:skip] + serialize(migrate(deserialize(raw[skip:]))),
                       self.write_options)

    def _switch_ttl(self, name: str, migration: StateMigration) -> None:
        """TTL switched on: prefix every stored value with the restore time; off: strip the
        prefixes and delete the entries already expired."""
        now = self.time_provider.now_ms()
        stamp = pack_timestamp(now)
        what = f"switching TTL of state {name!r}"
        if migration.ttl == TTL_ON:
            rewrite_values(self._instances, name, what, lambda raw: stamp + raw,
                           self.write_options)
        else:
            rewrite_values(self._instances, name, what,
                           lambda raw: None if migration.expired(unpack_timestamp(raw), now)
                           else raw[TS_BYTES:], self.write_options)

    def drop_state(self, state_name: str) -> bool:
        """See :meth:`KeyedStateBackend.drop_state`: drops its column family in every instance
        (the next snapshot references none of its SST files)."""
        self._check_open()
        if state_name in self._states:
            raise ConfigurationError(f"state {state_name!r} is registered; it can't be dropped")
        if self._restored.pop(state_name, None) is None:
            return False
        with native(f"dropping state {state_name!r}"):
            for instance in self._instances:
                instance.drop_column_family(state_name)
        return True

    def _state_snapshots(self) -> dict[str, StateMetaInfoSnapshot]:
        """Every known state: registered ones (from their descriptors) and restored ones."""
        known = dict(self._restored)
        for name, state in self._states.items():
            d = state.descriptor
            known[name] = StateMetaInfoSnapshot(meta_info_of(d), d.value_serializer,
                                                d.user_key_serializer)
        return dict(sorted(known.items()))

    def state_meta_infos(self) -> list[StateMetaInfo]:
        return [s.meta for s in self._state_snapshots().values()]

    def _known(self, state_name: str) -> StateMetaInfoSnapshot:
        info = self._state_snapshots().get(state_name)
        if info is None:
            raise StateNotFoundError(
                f"state {state_name!r} is neither registered nor in the restored snapshot of "
                f"subtask {self.subtask_index}; known states: "
                f"{sorted(self._state_snapshots())}"
            )
        self._check_open()
        return info

    def iter_entries(self, state_name: str) -> Iterator[StateEntry]:
        return self._read_every_instance(state_name, iter_state_entries)

    def iter_records(self, state_name: str) -> Iterator[StateRecord]:
        return self._read_every_instance(state_name, iter_state_records)

    def _read_every_instance(self, state_name: str, read: Callable[..., Iterator[Any]]
                             ) -> Iterator[Any]:
        """``read`` (:func:`iter_state_entries` or :func:`iter_state_records`) over every
        instance. Instances are in key-group order and each reads in key order, so the whole is
        ordered by key group (and a list never spans two instances: its key group is in one)."""
        info = self._known(state_name)
        now = self.time_provider.now_ms()
        return itertools.chain.from_iterable(
            read(self._flushed(inst).cf(state_name), name=state_name, kind=info.meta.kind,
                 value_serializer=info.value_serializer,
                 user_key_serializer=info.user_key_serializer, ttl_ms=info.meta.ttl_ms,
                 now_ms=now, key_group_prefix_bytes=self.key_group_prefix_bytes)
            for inst in self._instances)

    def _flushed(self, instance: RocksDBInstance) -> RocksDBInstance:
        """``instance``, the value cache's buffered writes written first: a scan starting now
        sees every write made so far, as it would without the cache (each instance's scan
        starts lazily, when the one before it is done)."""
        if self.value_cache is not None:
            self.value_cache.flush()
        return instance

    def load_records(self, meta: StateMetaInfo, value_serializer: TypeSerializer,
                     user_key_serializer: TypeSerializer | None,
                     records: Iterable[StateRecord]) -> int:
        """See :meth:`KeyedStateBackend.load_records`: each record goes to the instance of its
        key group, in write batches of :data:`~.scans.LOAD_BATCH` entries (WAL off, as every write)."""
        self._check_open()
        existing = self._state_snapshots().get(meta.name)
        check_load_compatible(None if existing is None else existing.meta, meta,
                              value_serializer, user_key_serializer)
        what = f"loading records of state {meta.name!r}"
        if self.value_cache is not None:
            # The records are written behind the cache: its entries of the state would hide them.
            self.value_cache.forget(meta.name)
        with native(what):
            self._column_family(meta.name)
        if existing is None:
            self._restored[meta.name] = StateMetaInfoSnapshot(meta, value_serializer,
                                                              user_key_serializer)
        else:  # write with the serializers the state already uses (same type strings)
            value_serializer = existing.value_serializer
            user_key_serializer = existing.user_key_serializer
        ser = value_serializer.serialize
        user_ser = None if user_key_serializer is None else user_key_serializer.serialize
        ttl = meta.ttl_ms is not None
        now = self.time_provider.now_ms()
        kind = meta.kind
        kg_range = self.key_group_range
        instances = self._instances
        handles = [inst.handles[meta.name] for inst in instances]
        batches = [column_family_batch(h) for h in handles]
        pending = [0] * len(instances)
        count = 0
        for record in records:
            kg = record.key_group
            if kg not in kg_range:
                kg_range.check_key_group(kg)
            key = state_key(self._kg_bytes[kg - kg_range.start], record.key_bytes,
                            record.namespace_bytes)
            if kind == StateKind.LIST:
                key += _pack_seq(self.next_list_seq())
            elif kind == StateKind.MAP:
                assert user_ser is not None
                key += _checked(user_ser, record.user_key, meta.name, "map key")
            data = _checked(ser, record.value, meta.name, "value")
            if ttl:
                data = pack_timestamp(now if record.ttl_timestamp is None
                                      else record.ttl_timestamp) + data
            k = self._instance_of[kg - kg_range.start].index
            batches[k].put(key, data)
            count += 1
            pending[k] += 1
            if pending[k] == LOAD_BATCH:
                with native(what):
                    instances[k].db.write(batches[k], self.write_options)
                batches[k], pending[k] = column_family_batch(handles[k]), 0
        for k, n in enumerate(pending):
            if n:
                with native(what):
                    instances[k].db.write(batches[k], self.write_options)
        return count

    @property
    def timer_service(self) -> RocksDBTimerService:
        return self._timers

    # -- snapshots -----------------------------------------------------------------------------

    def snapshot(self, checkpoint_id: int, location: CheckpointStorageLocation,
                 *, full: bool = False) -> SnapshotResult:
        """Flush and checkpoint every instance into one local directory; the result stores
        them as one handle. One instance: the layout of every handle before instances
        existed (unprefixed names, no :data:`PROP_INSTANCES`). Several: each instance's files
        named ``i<k>/<file>``, their ranges in :data:`PROP_INSTANCES`, one meta file.

        With rolling compaction (:attr:`RocksDBOptions.rolling_compaction`) an incremental
        snapshot first fully compacts at most one instance (:func:`rolling_compaction`)."""
        self._check_open()
        start = time.perf_counter()
        if self.value_cache is not None:
            self.value_cache.flush()  # the buffered writes belong to this snapshot
        for state in self._states.values():
            state.reset_cleanup_cursor()  # a live iterator would pin files the DB replaced
        states = self._state_snapshots()
        if full:
            self._purge_expired(states)
        compacted = None
        if self.options.rolling_compaction and self.incremental and not full:
            compacted = rolling_compaction(
                self._instances, self.options.rolling_compaction_amplification_percent)
        meta = MetaFile(self.max_parallelism, self.key_group_prefix_bytes,
                        self._list_sequence, states)
        root = os.path.join(self.instance_dir, "snapshots")
        local_dir = os.path.join(root, f"chk-{checkpoint_id}-{uuid.uuid4().hex}")
        os.makedirs(root, exist_ok=True)
        parts: list[tuple[str, InstanceSnapshot]] = []
        try:
            if not self.sharded:
                inst = self._instances[0]
                parts.append(("", inst.snapshot_strategy.snapshot(
                    checkpoint_id, inst.db, list(inst.cfs.values()), local_dir, full=full)))
            else:
                os.makedirs(local_dir)
                for inst in self._instances:
                    parts.append((instance_prefix(inst.index), inst.snapshot_strategy.snapshot(
                        checkpoint_id, inst.db, list(inst.cfs.values()),
                        os.path.join(local_dir, f"i{inst.index}"), full=full)))
            write_meta_file(os.path.join(local_dir, META_FILE), meta)
        except BaseException:
            shutil.rmtree(local_dir, ignore_errors=True)
            raise
        properties = {
            PROP_KEY_GROUP_PREFIX_BYTES: str(meta.key_group_prefix_bytes),
            PROP_LIST_SEQUENCE: str(meta.list_sequence),
            # One base per instance (comma-separated when sharded).
            PROP_BASE_CHECKPOINT: ",".join("" if p.base is None else str(p.base.checkpoint_id)
                                           for _, p in parts),
        }
        if self.sharded:
            properties[PROP_INSTANCES] = format_instance_ranges(
                [inst.key_group_range for inst in self._instances])
        if compacted is not None:
            properties[PROP_COMPACTED_INSTANCE] = str(compacted)
        restore_stats, self.restore_stats = self.restore_stats, None
        if restore_stats is not None:
            properties.update(restore_stats.to_properties(RESTORE_PREFIX))
        return RocksDBSnapshotResult(
            backend_name=BACKEND_NAME, subtask_index=self.subtask_index,
            key_group_range=self.key_group_range, checkpoint_id=checkpoint_id,
            local_dir=local_dir, parts=parts, location=location,
            states=[s.meta for s in states.values()], properties=properties,
            sync_duration_s=time.perf_counter() - start)

    def _purge_expired(self, states: dict[str, StateMetaInfoSnapshot]) -> None:
        """Expired entries are never written by a full snapshot (``cleanup_in_full_snapshot``;
        restored states not registered again keep Flink's default, on)."""
        now = self.time_provider.now_ms()
        for name, info in states.items():
            registered = self._states.get(name)
            ttl = registered.descriptor.ttl if registered is not None else None
            if info.meta.ttl_ms is None or (ttl is not None and not ttl.cleanup_in_full_snapshot):
                continue
            for inst in self._instances:
                cf, handle = inst.column_family(name)
                purge_expired(inst.db, cf, handle, name=name, ttl_ms=info.meta.ttl_ms,
                              now_ms=now, write_options=self.write_options)

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        for inst in self._instances:
            inst.snapshot_strategy.notify_checkpoint_complete(checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        for inst in self._instances:
            inst.snapshot_strategy.notify_checkpoint_aborted(checkpoint_id)

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> RocksDBKeyedStateBackend:
        return self

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"the RocksDB keyed backend of subtask {self.subtask_index} is "
                               f"closed; create a new one")

    def close(self) -> None:
        """Close every RocksDB instance and delete the backend's directory. Idempotent.
        Snapshots not yet materialized can't be materialized afterwards (their local files
        are gone)."""
        if self._closed:
            return
        self._closed = True
        # Every native reference must go before a DB closes, or RocksDB keeps it open.
        for state in self._states.values():
            state.close()
        if self.value_cache is not None:
            self.value_cache.close()  # unwritten values go with the DBs
        self.db = CLOSED
        try:
            errors = []
            for inst in self._instances:
                try:
                    inst.close()
                except BackendError as exc:  # close the others anyway
                    errors.append(exc)
            if errors:
                raise errors[0]
        finally:
            shutil.rmtree(self.instance_dir, ignore_errors=True)

    def __del__(self) -> None:
        # A backend dropped without close() must not leak its directory.
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass


def _checked(serialize: Callable[[Any], bytes], value: Any, state: str, what: str) -> bytes:
    try:
        return serialize(value)
    except SerializationError as exc:
        raise SerializationError(f"state {state!r}: {exc}; load a {what} of the state's "
                                 f"declared type") from exc
