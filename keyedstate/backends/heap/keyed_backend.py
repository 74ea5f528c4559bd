"""The heap keyed backend of one subtask: its state tables, timers, snapshots (full or
incremental, rolling materialization) and restore; created by
:meth:`~keyedstate.backends.heap.backend.HeapStateBackend.create_keyed_backend`."""


from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence, cast

from keyedstate.backends.base.backend import (
    KeyedStateBackend,
    SnapshotResult,
    StateEntry,
    StateRecord,
    check_compatible,
    check_load_compatible,
)
from keyedstate.backends.base.migration import plan_migration
from keyedstate.backends.heap.images import KeyGroupRanges, latest_images, plan_rolling, ranges_of
from keyedstate.backends.heap.restore import HeapRestoreOperation, chain_of, images_of
from keyedstate.backends.heap.snapshot import (
    DIFF,
    FULL,
    FileStateInfo,
    HeapSnapshotResult,
    Journal,
    SnapshotJob,
    capture_state,
    type_schema,
)
from keyedstate.backends.heap.state_table import StateTable
from keyedstate.backends.heap.states import create_state
from keyedstate.backends.heap.timers import HeapInternalTimerService, TimerQueue
from keyedstate.errors import BackendError, ConfigurationError, StateNotFoundError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.serde import TypeSerializer
from keyedstate.state.api import State
from keyedstate.state.descriptors import S, StateDescriptor, StateKind
from keyedstate.state.timers import TIMER_STATE_NAMES, TimeDomain
from keyedstate.state.ttl import TtlTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.duplication import same_store
from keyedstate.storage.handles import KeyedStateHandle, StateMetaInfo, StreamHandle
from keyedstate.storage.location import CheckpointStorageLocation
from keyedstate.storage.transfer import RestorePhases, TransferStats


@dataclass(frozen=True)
class SnapshotChain:
    """A written snapshot's files, oldest first, and the key groups each images; what the next
    incremental one extends. ``latest``: per key group of the backend's range (from its start),
    the position in ``files`` of its newest image. ``storage``: where the files lie (None: where
    this backend's snapshots go); ``owned`` False: a restored snapshot the job does not own,
    whose files the next snapshot duplicates."""

    checkpoint_id: int
    files: list[tuple[str, StreamHandle]]
    images: list[KeyGroupRanges]
    latest: list[int]
    storage: CheckpointStorage | None = None
    owned: bool = True

    @classmethod
    def of(cls, checkpoint_id: int, files: list[tuple[str, StreamHandle]],
           images: list[KeyGroupRanges], key_groups: KeyGroupRange,
           storage: CheckpointStorage | None = None, owned: bool = True) -> SnapshotChain:
        return cls(checkpoint_id, files, images, latest_images(images, key_groups), storage,
                   owned)


#: Every key group is imaged again within this many + 1 incremental snapshots. 128: at Flink's
#: default max parallelism (128) a snapshot with few changes images one key group, so the
#: bound costs little; a chain then holds at most one file per key group of the subtask.
DEFAULT_MAX_CHAIN_LENGTH = 128


class HeapKeyedStateBackend(KeyedStateBackend):
    """Keyed state of one subtask on the Python heap.

    Contract beyond :class:`KeyedStateBackend`: values handed to a state, and accumulators
    returned by user functions, must not be mutated in place afterwards except through the
    state API (the heap backend stores the objects themselves; a snapshot copies containers and
    serializes reducing and aggregating values, but not user objects inside value, list or map
    states).
    """

    name = "heap"

    def __init__(self, *, subtask_index: int, key_group_range: KeyGroupRange,
                 max_parallelism: int, key_serializer: KeySerializer,
                 time_provider: TtlTimeProvider | None = None,
                 max_chain_length: int = DEFAULT_MAX_CHAIN_LENGTH,
                 incremental: bool = True) -> None:
        super().__init__(subtask_index=subtask_index, key_group_range=key_group_range,
                         max_parallelism=max_parallelism, key_serializer=key_serializer,
                         time_provider=time_provider)
        self.max_chain_length = max_chain_length
        self.incremental = incremental and max_chain_length > 0
        self.tables: dict[str, StateTable] = {}
        self._states: dict[str, State] = {}
        self._timers = HeapInternalTimerService(self)
        self._journal = Journal()
        self._base: SnapshotChain | None = None
        #: snapshots taken and not yet confirmed or aborted; their chain once written.
        self._pending: dict[int, SnapshotChain | None] = {}
        self._last_snapshot_id: int | None = None
        # materialize() may report back from another thread while notifications arrive.
        self._pending_lock = threading.Lock()
        self._closed = False
        #: what the restore of this backend moved, reported by its first snapshot
        self.restore_stats: TransferStats | None = None
        #: how long the restore (or the last catch-up) fetched and decoded (None: neither)
        self.restore_phases: RestorePhases | None = None

    # -- restore -------------------------------------------------------------------------------

    def restore(self, handles: Sequence[KeyedStateHandle], storage: CheckpointStorage,
                share_restored_files: bool) -> None:
        """Load ``handles`` (already checked by :func:`check_restore_handles`)."""
        operation = HeapRestoreOperation(self, handles, storage)
        base = operation.restore(share_restored_files)
        self.restore_stats = operation.stats
        self.restore_phases = operation.phases
        if base is not None and self.incremental:
            self._base = SnapshotChain.of(base.checkpoint_id, base.chain, base.images,
                                          self.key_group_range, base.storage, base.owned)
            self._journal.start(self._journaled())

    def catch_up(self, handles: Sequence[KeyedStateHandle], storage: CheckpointStorage) -> bool:
        """See :meth:`KeyedStateBackend.catch_up`. Possible when this backend's own last
        snapshot was written and the checkpoint's chain for exactly this key-group range goes
        through that snapshot's file (and agrees with the copy's chain up to it): the files
        after it are applied, the chain becomes the base of the next snapshot, and the journal
        starts afresh (its changes are in those files)."""
        self._check_open()
        mine = [h for h in handles if h.key_group_range.intersection(self.key_group_range)]
        if not self.incremental or len(mine) != 1 \
                or mine[0].key_group_range != self.key_group_range:
            return False
        handle = mine[0]
        with self._pending_lock:
            own = self._pending.get(self._last_snapshot_id) \
                if self._last_snapshot_id is not None else None
            if own is None and self._base is not None \
                    and self._base.checkpoint_id == self._last_snapshot_id:
                own = self._base
        chain = chain_of(handle)
        if own is None or handle.checkpoint_id <= own.checkpoint_id \
                or (own.storage is not None and own.storage.url != storage.url) \
                or own.files[-1] not in chain:
            return False
        # The chain goes through this copy's own last file, and what it lists up to there is
        # the end of the copy's chain (the chain may have dropped older files since).
        through = chain.index(own.files[-1]) + 1
        if chain[:through] != own.files[len(own.files) - through:]:
            return False
        images = images_of(handle, len(chain))
        if images is None:  # a chain of format version 1: restored instead
            return False
        operation = HeapRestoreOperation(self, [handle], storage)
        operation.catch_up(handle, skip=through)
        self.restore_stats = operation.stats
        self.restore_phases = operation.phases
        with self._pending_lock:
            self._pending.clear()
            self._base = SnapshotChain.of(handle.checkpoint_id, chain, images,
                                          self.key_group_range, storage)
        self._journal.segments.clear()
        for table in self._journaled():
            table.marks = {}
        self._last_snapshot_id = handle.checkpoint_id
        return True

    # -- states --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(
                f"the heap keyed backend of subtask {self.subtask_index} is closed; create a "
                f"new one (restoring from the last checkpoint)"
            )

    def get_state(self, descriptor: StateDescriptor[S]) -> S:
        self._check_open()
        name = descriptor.name
        state = self._states.get(name)
        if state is not None:
            if getattr(state, "descriptor", None) is not descriptor:
                check_compatible(descriptor, self.tables[name].meta)
            return cast(S, state)  # the kind is checked: the state class is the descriptor's
        table = self.tables.get(name)
        if table is None:
            table = StateTable.of(descriptor)
            if self._journal.tracking:
                table.marks = {}
            self.tables[name] = table
        else:  # restored, first asked for now
            migration = plan_migration(descriptor, table.meta, table.value_serializer)
            table.attach(descriptor)
            if migration is not None:
                # Eager: every value now, as Flink's heap backend does on restore. The chain
                # the restore left holds values of the old type: the next snapshot is full.
                table.migrate_values(migration, self.time_provider.now_ms())
                self._forget_base()
        state = self._states[name] = create_state(self, table, descriptor)
        return cast(S, state)

    def state_meta_infos(self) -> list[StateMetaInfo]:
        return [self.tables[n].meta for n in sorted(self.tables)]

    def drop_state(self, state_name: str) -> bool:
        """See :meth:`KeyedStateBackend.drop_state`; the next snapshot is full (the chain it
        would extend lists the state)."""
        self._check_open()
        if state_name in self._states:
            raise ConfigurationError(f"state {state_name!r} is registered; it can't be dropped")
        if self.tables.pop(state_name, None) is None:
            return False
        self._forget_base()
        return True

    def _forget_base(self) -> None:
        """Build the next snapshot on nothing (a full one): neither the current base nor a
        pending snapshot taken before a state's values changed type or the state went."""
        with self._pending_lock:
            self._base = None
            self._pending.clear()  # their confirmations are ignored (unknown ids)
        self._prune()

    def iter_entries(self, state_name: str) -> Iterator[StateEntry]:
        """Live entries ordered by key group (then key and namespace bytes). The timer state
        names of :data:`TIMER_STATE_NAMES` list timers: ``value`` is the timestamp."""
        self._check_open()
        for domain, timer_name in TIMER_STATE_NAMES.items():
            if state_name == timer_name:
                return (StateEntry(t.key_group, t.key_bytes, t.namespace_bytes, None, t.timestamp)
                        for t in self._timers.timers(domain))
        return self._entries(self._table_of(state_name))

    def _table_of(self, state_name: str) -> StateTable:
        """The table of a registered or restored state, else :class:`StateNotFoundError`."""
        table = self.tables.get(state_name)
        if table is None:
            raise StateNotFoundError(
                f"state {state_name!r} is neither registered nor restored in subtask "
                f"{self.subtask_index} (known: {sorted(self.tables)}); check the state name"
            )
        return table

    def _entries(self, table: StateTable) -> Iterator[StateEntry]:
        # Each key group is copied before yielding, so callers may change state meanwhile.
        ttl = table.ttl_ms is not None
        now = self.time_provider.now_ms() if ttl else 0
        expired = table.is_expired
        for kg in sorted(table.maps):
            group = table.maps.get(kg)
            for (key_bytes, ns), stored in sorted(group.items(), key=_first) if group else ():
                if table.kind is StateKind.MAP:
                    pairs = [(u, e[0]) for u, e in stored.items() if not expired(e[1], now)] \
                        if ttl else list(stored.items())
                    for user_key, v in pairs:
                        yield StateEntry(kg, key_bytes, ns, user_key, v)
                elif table.kind is StateKind.LIST:
                    elements = [e[0] for e in stored if not expired(e[1], now)] if ttl \
                        else list(stored)
                    if elements:
                        yield StateEntry(kg, key_bytes, ns, None, elements)
                elif not ttl:
                    yield StateEntry(kg, key_bytes, ns, None, stored)
                elif not expired(stored[1], now):
                    yield StateEntry(kg, key_bytes, ns, None, stored[0])

    def iter_records(self, state_name: str) -> Iterator[StateRecord]:
        """Live elements ordered by key group (then key and namespace bytes); list elements in
        list order."""
        self._check_open()
        return self._records(self._table_of(state_name))

    def _records(self, table: StateTable) -> Iterator[StateRecord]:
        # As _entries: each key group is copied before yielding.
        ttl = table.ttl_ms is not None
        now = self.time_provider.now_ms() if ttl else 0
        expired = table.is_expired
        kind = table.kind
        for kg in sorted(table.maps):
            group = table.maps.get(kg)
            for (key_bytes, ns), stored in sorted(group.items(), key=_first) if group else ():
                if kind is StateKind.MAP:
                    for user_key, v in list(stored.items()):
                        if not ttl:
                            yield StateRecord(kg, key_bytes, ns, user_key, v)
                        elif not expired(v[1], now):
                            yield StateRecord(kg, key_bytes, ns, user_key, v[0], v[1])
                elif kind is StateKind.LIST:
                    for element in list(stored):
                        if not ttl:
                            yield StateRecord(kg, key_bytes, ns, None, element)
                        elif not expired(element[1], now):
                            yield StateRecord(kg, key_bytes, ns, None, element[0], element[1])
                elif not ttl:
                    yield StateRecord(kg, key_bytes, ns, None, stored)
                elif not expired(stored[1], now):
                    yield StateRecord(kg, key_bytes, ns, None, stored[0], stored[1])

    def load_records(self, meta: StateMetaInfo, value_serializer: TypeSerializer,
                     user_key_serializer: TypeSerializer | None,
                     records: Iterable[StateRecord]) -> int:
        """See :meth:`KeyedStateBackend.load_records`. Values are checked and copied as a
        write through the state API would; changes are journaled (an incremental snapshot
        after the load holds them)."""
        self._check_open()
        table = self.tables.get(meta.name)
        check_load_compatible(None if table is None else table.meta, meta, value_serializer,
                              user_key_serializer)
        if table is None:
            table = StateTable(meta, value_serializer, user_key_serializer)
            if self._journal.tracking:
                table.marks = {}
            self.tables[meta.name] = table
        ttl = table.ttl_ms is not None
        now = self.time_provider.now_ms()
        kind = table.kind
        key_groups = self.key_group_range
        count = 0
        for record in records:
            kg = record.key_group
            if kg not in key_groups:
                key_groups.check_key_group(kg)
            value = table.check_value(record.value)
            if ttl:
                value = (value, now if record.ttl_timestamp is None else record.ttl_timestamp)
            key = (record.key_bytes, record.namespace_bytes)
            if kind is StateKind.VALUE or kind is StateKind.REDUCING \
                    or kind is StateKind.AGGREGATING:
                table.put(kg, key, value)
            else:
                group = table.maps.get(kg)
                if group is None:
                    group = table.maps[kg] = {}
                stored = group.get(key)
                if kind is StateKind.LIST:
                    if stored is None:
                        group[key] = [value]
                        table.mark_appended(kg, key, 0)
                    else:
                        table.mark_appended(kg, key, len(stored))
                        stored.append(value)
                else:
                    table.check_user_key(record.user_key)
                    if stored is None:
                        stored = group[key] = {}
                    stored[record.user_key] = value
                    table.mark_user_key(kg, key, record.user_key)
            count += 1
        return count

    @property
    def timer_service(self) -> HeapInternalTimerService:
        return self._timers

    @property
    def timer_queues(self) -> dict[TimeDomain, TimerQueue]:
        return self._timers.queues

    # -- snapshots -----------------------------------------------------------------------------

    def snapshot(self, checkpoint_id: int, location: CheckpointStorageLocation,
                 *, full: bool = False) -> SnapshotResult:
        """Synchronous part. Incremental when a confirmed base exists and ``full`` is False: the
        changed entries as ops, plus images of the key groups whose latest image is oldest,
        until the imaged entries reach the changed ones and at least ``ceil(key groups /
        (max_chain_length + 1))`` key groups are imaged (:func:`.images.plan_rolling`); its
        cost then follows the change. A full one images every key group: it copies every table
        (C-speed dict copies; reducing and aggregating values are serialized now)."""
        start = time.perf_counter()
        self._check_open()
        base = self._base
        # The base chain is referenced in place when it is the job's own and in this root,
        # duplicated by the store when it is not (NO_CLAIM) or in another root of the store;
        # a chain in another store can't be extended (a full snapshot starts a new one).
        duplicate_from = None
        if base is not None and base.storage is not None and not (
                base.owned and base.storage.url == location.storage.url):
            if same_store(base.storage, location.storage):
                duplicate_from = base.storage
            else:
                base = None
        if not (self.incremental and not full and base is not None
                and checkpoint_id > base.checkpoint_id):
            base = None
        tables = [self.tables[n] for n in sorted(self.tables)]
        infos = [FileStateInfo(t.meta, type_schema(t.value_serializer),
                               type_schema(t.user_key_serializer)) for t in tables]
        queues = self.timer_queues
        key_groups = self.key_group_range
        changed: int | None
        if base is not None:
            changes = self._journal.changes([*tables, *queues.values()])
            plan = plan_rolling(base.latest, len(base.files), key_groups, changes, tables,
                                list(queues.values()), self.max_chain_length)
            imaged = set(plan.images)
            images = ranges_of(plan.images)
            captures = [capture_state(t, i, imaged, changes.get(t.name))
                        for i, t in enumerate(tables)]
            # Timers: a changed key group's whole (even empty: it replaces), an imaged one's
            # only when it has any (an image is the key group's whole content anyway).
            timers = {d: {**q.copy_key_groups(k for k in changes.get(q.name, ())
                                              if k not in imaged),
                          **{k: v for k, v in q.copy_key_groups(plan.images).items() if v}}
                      for d, q in queues.items()}
            base_files = base.files[plan.first_needed:]
            base_images = base.images[plan.first_needed:]
            changed, image_entries = plan.changed_entries, plan.image_entries
        else:
            changed = None  # no journal to count: everything is written
            image_entries = sum(len(g) for t in tables for g in t.maps.values()) + \
                sum(len(q) for q in queues.values())
            images = [(key_groups.start, key_groups.end)] if key_groups else []
            captures = [capture_state(t, i, None) for i, t in enumerate(tables)]
            timers = {d: q.copy_key_groups() for d, q in queues.items()}
            base_files, base_images = [], []
        job = SnapshotJob(
            checkpoint_id=checkpoint_id,
            kind=DIFF if base_files else FULL,
            subtask_index=self.subtask_index,
            key_group_range=key_groups,
            max_parallelism=self.max_parallelism,
            now_ms=self.time_provider.now_ms(),
            infos=infos,
            # None: keep expired entries (TTL config opted out of full-snapshot cleanup).
            ttl_ms=[t.ttl_ms if t.cleanup_in_full_snapshot else None for t in tables],
            captures=captures,
            timers=timers,
            images=images,
            base_chain=list(base_files),
            base_images=list(base_images),
            duplicate_from=duplicate_from if base_files else None,
            restore_stats=self.restore_stats,
        )
        self.restore_stats = None
        self._start_segment(checkpoint_id)
        result = HeapSnapshotResult(job, location, time.perf_counter() - start,
                                    self._on_written, self._on_discarded)
        if changed is not None:
            result.stats.extra["changed_entries"] = changed
        result.stats.extra["image_entries"] = image_entries
        return result

    def _journaled(self) -> list[StateTable | TimerQueue]:
        return [*self.tables.values(), *self.timer_queues.values()]

    def _start_segment(self, checkpoint_id: int) -> None:
        if not self.incremental:
            return
        if self._last_snapshot_id is not None and checkpoint_id <= self._last_snapshot_id:
            # Ids must increase for a chain; such a snapshot is never a base and its changes
            # simply stay in the open segment.
            return
        self._last_snapshot_id = checkpoint_id
        if not self._journal.tracking:
            self._journal.start(self._journaled())
        self._journal.seal(checkpoint_id, self._journaled())
        with self._pending_lock:
            self._pending[checkpoint_id] = None
        self._prune()

    def _potential_bases(self) -> list[int]:
        with self._pending_lock:
            pending = list(self._pending)
        return [*([] if self._base is None else [self._base.checkpoint_id]), *pending]

    def _prune(self) -> None:
        self._journal.prune(self._potential_bases())

    def _on_written(self, checkpoint_id: int, files: list[tuple[str, StreamHandle]],
                    images: list[KeyGroupRanges], storage: CheckpointStorage) -> None:
        chain = SnapshotChain.of(checkpoint_id, files, images, self.key_group_range, storage)
        with self._pending_lock:
            if checkpoint_id in self._pending:
                self._pending[checkpoint_id] = chain

    def _on_discarded(self, checkpoint_id: int) -> None:
        self.notify_checkpoint_aborted(checkpoint_id)

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Make ``checkpoint_id``'s chain the base; it subsumes every older pending snapshot.
        Unknown or older ids are ignored (already subsumed, or taken by another incarnation)."""
        with self._pending_lock:
            if checkpoint_id not in self._pending:
                return
            chain = self._pending[checkpoint_id]
            if chain is not None:
                self._base = chain
                for cid in [c for c in self._pending if c <= checkpoint_id]:
                    del self._pending[cid]
        if chain is None:  # confirmed without being materialized: nothing to build on
            self.notify_checkpoint_aborted(checkpoint_id)
            return
        self._prune()

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        """Never build on ``checkpoint_id``; its changes go into the next snapshot."""
        with self._pending_lock:
            if checkpoint_id not in self._pending:
                return
            del self._pending[checkpoint_id]
        self._journal.fold(checkpoint_id, self._journaled())
        self._prune()

    def close(self) -> None:
        """Drop all state. Idempotent; a running ``materialize`` still completes (it holds its
        own copies)."""
        if self._closed:
            return
        self._closed = True
        for table in self.tables.values():  # state objects still held elsewhere see nothing
            table.maps.clear()
            table.marks = None
        self.tables.clear()
        self._states.clear()
        for queue in self.timer_queues.values():
            queue.clear()
        self._pending.clear()
        self._base = None
        self._journal = Journal()


def _first(item: tuple[Any, ...]) -> Any:
    return item[0]
