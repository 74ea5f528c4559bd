"""The state backend contract (Flink's ``StateBackend`` / ``KeyedStateBackend``).

A :class:`StateBackend` is configuration: small, picklable, sent to executors. It creates a
:class:`KeyedStateBackend`, the keyed state of one subtask, either empty or restored from the
handles of an earlier snapshot (possibly taken at another parallelism: rescaling).

Snapshot protocol (one checkpoint)::

    result = backend.snapshot(checkpoint_id, location)   # synchronous part: freezes a
                                                          # consistent view, returns quickly
    handle = result.materialize()                         # asynchronous part: writes files;
                                                          # safe to run while processing
                                                          # goes on (the runtime calls it in
                                                          # the task, docs/checkpoints.md)
    backend.notify_checkpoint_complete(checkpoint_id)     # the coordinator committed it
      or backend.notify_checkpoint_aborted(checkpoint_id)

Guarantees every backend gives (checked by ``tests/backends/contract/``):

- An incremental snapshot references only files of the last snapshot the coordinator
  *confirmed* (``notify_checkpoint_complete``) or of the restored snapshot when restored with
  ``share_restored_files=True``; an aborted or unconfirmed snapshot never becomes a base.
- ``materialize`` reflects the state exactly as of the ``snapshot`` call.
- A restore checks every handle's key-group range and backend, and the descriptors passed to
  ``get_state`` against the restored :class:`StateMetaInfo` (typed errors otherwise).
- Expired TTL entries are never returned and never written by a full snapshot.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

from keyedstate.backends.base.migration import value_schema_text
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.errors import (
    ConfigurationError,
    KeyGroupRangeError,
    StateTypeMismatchError,
)
from keyedstate.keygroups import KeyGroupRange, check_max_parallelism
from keyedstate.keys import KeySerializer
from keyedstate.serde import TypeSerializer
from keyedstate.state.batch_keys import BatchKeys
from keyedstate.state.descriptors import S, StateDescriptor
from keyedstate.state.timers import InternalTimerService
from keyedstate.state.ttl import SystemTimeProvider, TtlTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle, StateMetaInfo
from keyedstate.storage.location import CheckpointStorageLocation


def meta_info_of(descriptor: StateDescriptor) -> StateMetaInfo:
    """What a snapshot records about a descriptor."""
    return state_meta_info(descriptor.name, str(descriptor.kind), descriptor.value_serializer,
                           descriptor.user_key_serializer,
                           None if descriptor.ttl is None else descriptor.ttl.ttl_ms)


def state_meta_info(name: str, kind: str, value_serializer: TypeSerializer,
                    user_key_serializer: TypeSerializer | None,
                    ttl_ms: int | None) -> StateMetaInfo:
    """What a snapshot records about a state written through these serializers (its types'
    names and, for typed states, its schema: :func:`..migration.value_schema_text`)."""
    return StateMetaInfo(
        name=name,
        kind=kind,
        value_type=value_serializer.type_string,
        user_key_type=None if user_key_serializer is None else user_key_serializer.type_string,
        ttl_ms=ttl_ms,
        value_schema=value_schema_text(value_serializer, user_key_serializer),
    )


def check_compatible(descriptor: StateDescriptor, restored: StateMetaInfo) -> None:
    """Raise :class:`StateTypeMismatchError` unless ``descriptor`` reads the state ``restored``
    describes as it is: kind, value type and map-key type equal, TTL on in both or in neither
    (its duration may change, as in Flink). A restored state whose type evolved goes through
    :func:`..migration.plan_migration` instead; this check is for a registered state asked
    for again, and for paths that can't migrate.
    """
    wanted = meta_info_of(descriptor)
    problems = []
    if wanted.kind != restored.kind:
        problems.append(f"kind {restored.kind} was restored, the descriptor is {wanted.kind}")
    if wanted.value_type != restored.value_type:
        problems.append(f"value type {restored.value_type} was restored, the descriptor "
                        f"declares {wanted.value_type}")
    if wanted.user_key_type != restored.user_key_type:
        problems.append(f"map key type {restored.user_key_type} was restored, the descriptor "
                        f"declares {wanted.user_key_type}")
    if (wanted.ttl_ms is None) != (restored.ttl_ms is None):
        problems.append("TTL is " + ("on" if restored.ttl_ms else "off") +
                        " for the registered state; it is switched only on restore")
    if problems:
        raise StateTypeMismatchError(
            f"state {descriptor.name!r} does not match the snapshot: " + "; ".join(problems) +
            ". Use the descriptor the job was started with, or migrate the state with the state "
            "processor API"
        )


def check_load_compatible(existing: StateMetaInfo | None, loaded: StateMetaInfo,
                          value_serializer: TypeSerializer,
                          user_key_serializer: TypeSerializer | None) -> None:
    """Raise :class:`StateTypeMismatchError` unless records of ``loaded`` may go into a state
    that exists as ``existing`` (None: new state) through the given serializers (the rules of
    :func:`check_compatible`; :meth:`KeyedStateBackend.load_records` calls it first)."""
    problems = []
    if value_serializer.type_string != loaded.value_type or (
            None if user_key_serializer is None else user_key_serializer.type_string
    ) != loaded.user_key_type:
        problems.append(f"the serializers ({value_serializer.type_string}, "
                        f"{None if user_key_serializer is None else user_key_serializer.type_string}"
                        f") do not have its types ({loaded.value_type}, {loaded.user_key_type})")
    if existing is not None:
        if existing.kind != loaded.kind:
            problems.append(f"it is a {existing.kind} state here, {loaded.kind} in the records")
        if existing.value_type != loaded.value_type:
            problems.append(f"its value type is {existing.value_type} here, {loaded.value_type} "
                            f"in the records")
        if existing.user_key_type != loaded.user_key_type:
            problems.append(f"its map key type is {existing.user_key_type} here, "
                            f"{loaded.user_key_type} in the records")
        if (existing.ttl_ms is None) != (loaded.ttl_ms is None):
            problems.append("TTL is " + ("off" if existing.ttl_ms is None else "on") +
                            " here and " + ("off" if loaded.ttl_ms is None else "on") +
                            " in the records")
    if problems:
        raise StateTypeMismatchError(
            f"state {loaded.name!r} can't be loaded: " + "; ".join(problems) + ". Restore with "
            "the descriptor the snapshot was taken with, or migrate the state with the state "
            "processor API"
        )


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One live entry of a state, for canonical savepoints and the state processor API.

    ``user_key`` is the map key for map states (None otherwise); ``value`` is the value, the
    whole list for list states, the accumulator for aggregating states.
    """

    key_group: int
    key_bytes: bytes
    namespace_bytes: bytes
    user_key: Any
    value: Any


@dataclass(frozen=True, slots=True)
class StateRecord:
    """One stored element of a state with its TTL timestamp: a row of a canonical savepoint.

    One record per value (value, reducing and aggregating states: the accumulator), per map
    entry (``user_key`` is the map key; None otherwise) and per list element (the records of
    one list come in list order). ``ttl_timestamp`` is the element's last-access time in ms
    since the epoch under TTL, None without TTL.
    """

    key_group: int
    key_bytes: bytes
    namespace_bytes: bytes
    user_key: Any
    value: Any
    ttl_timestamp: int | None = None


@dataclass(slots=True)
class SnapshotStats:
    """What one snapshot cost, as Flink reports it per subtask."""

    sync_duration_s: float = 0.0
    async_duration_s: float = 0.0
    incremental_bytes: int = 0
    full_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class SnapshotResult(ABC):
    """The product of a snapshot's synchronous part; :meth:`materialize` is the asynchronous
    part (Flink's name: it holds its own view of the state, so it may run while processing
    goes on; the runtime runs it in the subtask's task, on the batch's path, by default, and
    in the Python worker's uploader with ``keyedstate.checkpointing.async-upload``,
    docs/checkpoints.md "The asynchronous phase"). Exactly one of :meth:`materialize` or
    :meth:`discard` must be called."""

    def __init__(self, checkpoint_id: int, sync_duration_s: float) -> None:
        self.checkpoint_id = checkpoint_id
        self.stats = SnapshotStats(sync_duration_s=sync_duration_s)

    def materialize(self) -> KeyedStateHandle:
        start = time.perf_counter()
        handle = self._materialize()
        self.stats.async_duration_s = time.perf_counter() - start
        self.stats.incremental_bytes = handle.incremental_size
        self.stats.full_bytes = handle.full_size
        return handle

    @abstractmethod
    def _materialize(self) -> KeyedStateHandle:
        """Write the files and return the handle (safe on another thread than the one
        processing; the runtime calls it in the task by default, in the process's uploader
        thread with ``keyedstate.checkpointing.async-upload``)."""

    def discard(self) -> None:  # noqa: B027 - a no-op is the right default
        """Release what the synchronous part holds without writing anything."""


class KeyedStateBackend(ABC):
    """Keyed state of one subtask: the states, the timers, snapshots.

    Not thread-safe except that one :meth:`SnapshotResult.materialize` may run concurrently with
    processing. Keys outside ``key_group_range`` are refused (:class:`KeyGroupRangeError`).
    """

    #: the backend's name as written in snapshots ("heap", "rocksdb")
    name: str

    def __init__(self, *, subtask_index: int, key_group_range: KeyGroupRange,
                 max_parallelism: int, key_serializer: KeySerializer,
                 time_provider: TtlTimeProvider | None = None) -> None:
        check_max_parallelism(max_parallelism)
        if not KeyGroupRange(0, max_parallelism - 1).contains_range(key_group_range):
            raise ConfigurationError(
                f"{key_group_range} does not fit max parallelism {max_parallelism}"
            )
        self.subtask_index = subtask_index
        self.key_group_range = key_group_range
        self.max_parallelism = max_parallelism
        self.key_serializer = key_serializer
        self.time_provider: TtlTimeProvider = time_provider or SystemTimeProvider()
        self.current_key: Any = None
        self.current_key_bytes: bytes | None = None
        self.current_key_group: int = -1

    # -- key context ---------------------------------------------------------------------------

    def set_current_key(self, key: Any, key_group: int | None = None) -> None:
        """Make ``key`` current for every state and the timer service. ``key_group`` may be
        passed when already known (the Spark runtime computes it in the JVM); it is checked
        against this subtask's range."""
        if key_group is None:
            key_bytes, key_group = self.key_serializer.serialize_with_key_group(
                key, self.max_parallelism)
        else:
            key_bytes = self.key_serializer.serialize(key)
        self._set_current(key, key_bytes, key_group)

    def set_current_batch_key(self, keys: BatchKeys, index: int) -> None:
        """Make key ``index`` of ``keys`` current, with the bytes and key group ``keys``
        already holds (the per-key runtime loop encodes a batch's keys in one pass)."""
        self._set_current(keys.keys[index], keys.key_bytes[index], keys.key_groups[index])

    def set_current_key_bytes(self, key_bytes: bytes, key_group: int) -> None:
        """Make a stored key current (timers, restore, state processor)."""
        self._set_current(None, key_bytes, key_group)

    def _set_current(self, key: Any, key_bytes: bytes, key_group: int) -> None:
        if not self.key_group_range.start <= key_group <= self.key_group_range.end:
            raise KeyGroupRangeError(
                f"key {key!r} is in key group {key_group}, outside subtask {self.subtask_index}'s "
                f"{self.key_group_range}; it was routed to the wrong subtask"
            )
        self.current_key = key
        self.current_key_bytes = key_bytes
        self.current_key_group = key_group

    def clear_current_key(self) -> None:
        """Make no key current: per-key state calls and timer registrations then raise until a
        key is set again (the runtime calls it before a vectorized ``process_batch``)."""
        self.current_key = None
        self.current_key_bytes = None
        self.current_key_group = -1

    def check_batch_keys(self, keys: BatchKeys) -> None:
        """Refuse the keys of a bulk state call when one lies outside this subtask's key-group
        range (:class:`KeyGroupRangeError`, as :meth:`set_current_key` does for one key)."""
        groups = keys.key_groups
        if not len(groups):
            return
        rng = self.key_group_range
        if rng.start <= min(groups) and max(groups) <= rng.end:
            return
        at = next(i for i, g in enumerate(groups) if not rng.start <= g <= rng.end)
        raise KeyGroupRangeError(
            f"key {keys.keys[at]!r} is in key group {groups[at]}, outside subtask "
            f"{self.subtask_index}'s {rng}; it was routed to the wrong subtask")

    def get_current_key(self) -> Any:
        if self.current_key is None and self.current_key_bytes is not None:
            self.current_key = self.key_serializer.deserialize(self.current_key_bytes)
        return self.current_key

    # -- states --------------------------------------------------------------------------------

    @abstractmethod
    def get_state(self, descriptor: StateDescriptor[S]) -> S:
        """The state for ``descriptor`` (created on first use, then cached by name), of the
        descriptor's state class (``ValueStateDescriptor`` -> ``ValueState``). Raises
        :class:`StateTypeMismatchError` if a state of that name exists (registered or
        restored) with another kind or type."""

    @abstractmethod
    def state_meta_infos(self) -> list[StateMetaInfo]:
        """Registered and restored states (internal ones excluded)."""

    @abstractmethod
    def iter_entries(self, state_name: str) -> Iterator[StateEntry]:
        """Every live entry of a state (restored states too, even if never registered), ordered
        by key group. Raises :class:`StateNotFoundError` for an unknown name."""

    @abstractmethod
    def iter_records(self, state_name: str) -> Iterator[StateRecord]:
        """Every live element of a state as :class:`StateRecord` (TTL timestamps included),
        ordered by key group; expired elements are left out. Restored states count even if
        never registered. Raises :class:`StateNotFoundError` for an unknown name."""

    @abstractmethod
    def load_records(self, meta: StateMetaInfo, value_serializer: TypeSerializer,
                     user_key_serializer: TypeSerializer | None,
                     records: Iterable[StateRecord]) -> int:
        """Bulk-load ``records`` of state ``meta.name`` (restore from a canonical savepoint);
        returns how many were loaded.

        Contract: afterwards the state is known as a restored state is (listed by
        :meth:`state_meta_infos`, read by :meth:`iter_entries`, checked by :meth:`get_state`),
        even when ``records`` is empty. ``value_serializer`` and ``user_key_serializer`` must
        have ``meta``'s type strings. A state of that name that already exists (registered or
        loaded) must match ``meta`` in kind, types and TTL on/off, else
        :class:`StateTypeMismatchError` before anything is written. Every value and map key is
        checked against its serializer (:class:`SerializationError` naming the state); a
        record outside this backend's key-group range raises :class:`KeyGroupRangeError`.
        Under TTL a record without ``ttl_timestamp`` gets the current time. A later record of
        the same key, namespace (and map key) replaces an earlier one, except that list
        records append in the order given. Records already written when an error is raised
        stay: load into a fresh backend and close it on failure.
        """

    @abstractmethod
    def drop_state(self, state_name: str) -> bool:
        """Drop a restored state that no descriptor registered (``JobConfig.drop_states``):
        its entries are gone and the next snapshot neither lists nor references it. Returns
        False when the backend has no such state; raises :class:`ConfigurationError` for a
        registered one."""

    @property
    @abstractmethod
    def timer_service(self) -> InternalTimerService: ...

    # -- snapshots -----------------------------------------------------------------------------

    @abstractmethod
    def snapshot(self, checkpoint_id: int, location: CheckpointStorageLocation,
                 *, full: bool = False) -> SnapshotResult:
        """Synchronous part of a snapshot; ``full=True`` forces a snapshot that references no
        earlier file (NO_CLAIM's first checkpoint, savepoints)."""

    @abstractmethod
    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` is committed: its files may be the next base."""

    def catch_up(self, handles: Sequence[KeyedStateHandle], storage: CheckpointStorage) -> bool:
        """Bring this backend, a live copy left unchanged since its own last snapshot, to the
        state of ``handles`` (a later checkpoint of the same job at the same parallelism, in
        ``storage``) by applying only what was written after that snapshot; True when done.

        False, with the backend unchanged, when it can't: the checkpoint does not continue
        this copy's snapshot (another chain, a full snapshot since, another key-group range),
        or the backend has no such path (the default). The caller then closes the copy and
        restores from scratch. What a subtask costs when Spark runs its task in another
        process than the last time: the changes since, not the whole state."""
        return False

    @abstractmethod
    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` will never complete: never build on it."""

    @abstractmethod
    def close(self) -> None:
        """Release native resources and local working files. Idempotent."""

    def __enter__(self) -> KeyedStateBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The per-state size of what no state owns in a snapshot (RocksDB's MANIFEST and OPTIONS,
#: heap footers): :meth:`StateBackend.state_sizes` reports it under this name.
OTHER_FILES = "(other files)"


class StateBackend(ABC):
    """Backend configuration; pickles; creates :class:`KeyedStateBackend` instances."""

    name: str
    #: How :meth:`state_sizes` measures (shown by ``keyedstate checkpoints show``).
    state_sizes_method: str

    @abstractmethod
    def state_sizes(self, storage: CheckpointStorage, handle: KeyedStateHandle
                    ) -> dict[str, int]:
        """Bytes per state name in one subtask's snapshot ``handle`` (read from ``storage``),
        plus :data:`OTHER_FILES` for what no state owns; the values sum to the handle's
        files. Reads the files, writes nothing."""

    @abstractmethod
    def create_keyed_backend(self, parameters: KeyedStateBackendParameters
                             ) -> KeyedStateBackend:
        """A keyed backend for one subtask, restored from ``parameters.restore_handles`` when
        given (contract in :class:`KeyedStateBackendParameters`). A backend that keeps working
        files keeps them in this process's directory below ``parameters.local_dir``
        (:func:`keyedstate.backends.base.working_dirs.worker_dir`) and deletes them on
        ``close()``."""


def check_restore_handles(backend_name: str, key_group_range: KeyGroupRange,
                          max_parallelism: int,
                          handles: Sequence[KeyedStateHandle]) -> list[KeyedStateHandle]:
    """The handles that overlap ``key_group_range``, after checking each one fits
    ``max_parallelism`` and was written by ``backend_name`` (typed errors otherwise)."""
    full = KeyGroupRange(0, max_parallelism - 1)
    chosen = []
    for handle in handles:
        if not full.contains_range(handle.key_group_range):
            raise KeyGroupRangeError(
                f"snapshot handle of subtask {handle.subtask_index} covers "
                f"{handle.key_group_range}, which does not fit max parallelism "
                f"{max_parallelism}; the snapshot was taken with another max parallelism"
            )
        if handle.backend != backend_name:
            raise StateTypeMismatchError(
                f"snapshot handle of subtask {handle.subtask_index} was written by the "
                f"{handle.backend!r} backend and can't be restored by {backend_name!r}; take a "
                f"canonical savepoint to change backends"
            )
        if handle.key_group_range.intersection(key_group_range):
            chosen.append(handle)
    return chosen
