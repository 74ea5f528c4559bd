"""Incremental snapshots of a RocksDB instance (Flink's ``RocksDBIncrementalSnapshotStrategy``).

Synchronous part (:meth:`RocksDBIncrementalSnapshotStrategy.snapshot`, processing is paused;
before it, a ``full`` snapshot deletes expired TTL entries so a restore can't revive them):

1. flush every column family, so the memtables are in SST files (the WAL is off);
2. create a RocksDB checkpoint (hard links of the live SST files, copies of MANIFEST, CURRENT,
   OPTIONS) in a fresh local snapshot directory, and write the state meta file next to them;
3. take the base: the SST files of the last *confirmed* snapshot (none when ``full``, when
   incremental snapshots are off, or when no snapshot was confirmed yet).

Asynchronous part (:meth:`RocksDBSnapshotResult.materialize`; it reads only the hard links,
so processing goes on meanwhile when the runtime runs it in the process's uploader (the Python
worker's on Spark), with
``keyedstate.checkpointing.async-upload``; by default the task calls it, on the batch's path:
docs/checkpoints.md "The asynchronous phase"):

1. every SST file the base already has (same name, same size) is re-referenced by its existing
   :class:`StreamHandle` when the base is the job's own and lies in this storage root; when it
   is a restored snapshot the job does not own (NO_CLAIM) or lies in another root of the same
   store, it is duplicated by the store (server-side copy, no byte through this process) as a
   new shared file instead; every other SST file is stored as a shared file;
   RocksDB's OPTIONS file is treated as an SST (immutable, numbered, the same in every
   snapshot until the options change): stored once, then re-referenced;
2. every other file (MANIFEST, CURRENT, the meta file ...) is stored as a private
   file of this checkpoint, except an empty WAL (``*.log``): with the WAL off and every column
   family flushed it holds nothing, and RocksDB opens without it. Storing goes through
   :meth:`~keyedstate.storage.location.CheckpointStorageLocation.put_files`: small files are
   inlined into ``_metadata`` or merged into one object, the rest uploaded in parallel;
3. the local snapshot directory is deleted; the shared files become a base candidate that only
   :meth:`~RocksDBIncrementalSnapshotStrategy.notify_checkpoint_complete` turns into the base.

SST files are immutable and their names are never reused within one DB, so a name the confirmed
snapshot has is the same bytes (the premise of Flink's incremental checkpoints).
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import rocksdict

from keyedstate.backends.base.backend import SnapshotResult, state_meta_info
from keyedstate.backends.rocksdb.native import native
from keyedstate.errors import (
    BackendError,
    CorruptCheckpointError,
    UnsupportedFormatVersionError,
)
from keyedstate.keygroups import KeyGroupRange
from keyedstate.serde import TypeSerializer
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.duplication import same_store
from keyedstate.storage.filesystem import file_checksum
from keyedstate.storage.handles import KeyedStateHandle, StateMetaInfo, StreamHandle
from keyedstate.storage.location import CheckpointStorageLocation, StateFile

#: Private file of every snapshot holding the states' meta infos and serializers.
META_FILE = "KEYEDSTATE-META"
META_FORMAT_VERSION = 1
SST_SUFFIX = ".sst"
OPTIONS_PREFIX = "OPTIONS-"
WAL_SUFFIX = ".log"

#: ``KeyedStateHandle.properties`` keys.
PROP_KEY_GROUP_PREFIX_BYTES = "rocksdb.key-group-prefix-bytes"
PROP_LIST_SEQUENCE = "rocksdb.list-sequence"
PROP_BASE_CHECKPOINT = "rocksdb.base-checkpoint-id"
#: The key-group ranges of the instances of a multi-instance handle (absent: one instance,
#: file names unprefixed, as every handle written before instances existed).
PROP_INSTANCES = "rocksdb.instances"
#: The instance the rolling compaction fully compacted before this snapshot (absent: none).
PROP_COMPACTED_INSTANCE = "rocksdb.compacted-instance"


@dataclass(frozen=True, slots=True)
class StateMetaInfoSnapshot:
    """What restoring needs about one state without its descriptor (Flink's
    ``StateMetaInfoSnapshot``): the meta info and the serializers that wrote its bytes."""

    meta: StateMetaInfo
    value_serializer: TypeSerializer
    user_key_serializer: TypeSerializer | None


@dataclass(frozen=True, slots=True)
class MetaFile:
    """Content of :data:`META_FILE`."""

    max_parallelism: int
    key_group_prefix_bytes: int
    list_sequence: int
    states: Mapping[str, StateMetaInfoSnapshot]


def write_meta_file(path: str, meta: MetaFile) -> None:
    # Pickle: serializers are Python objects; this file is only read back by the job that
    # wrote it, after its size and checksum were verified against the handle.
    body = {
        "format_version": META_FORMAT_VERSION,
        "max_parallelism": meta.max_parallelism,
        "key_group_prefix_bytes": meta.key_group_prefix_bytes,
        "list_sequence": meta.list_sequence,
        "states": {
            name: (s.meta.name, s.meta.kind, s.meta.value_type, s.meta.user_key_type,
                   s.meta.ttl_ms, s.value_serializer, s.user_key_serializer)
            for name, s in meta.states.items()
        },
    }
    with open(path, "wb") as f:
        pickle.dump(body, f, protocol=pickle.HIGHEST_PROTOCOL)


def read_meta_file(path: str, source: str) -> MetaFile:
    """Parse a meta file; ``source`` names it in errors."""
    try:
        with open(path, "rb") as f:
            body: dict[str, Any] = pickle.load(f)
        version = body["format_version"]
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{source} is not a keyedstate RocksDB meta file ({exc}); restore from another "
            f"checkpoint or savepoint"
        ) from exc
    if version != META_FORMAT_VERSION:
        raise UnsupportedFormatVersionError(
            f"{source} has RocksDB meta format {version}, this keyedstate reads "
            f"{META_FORMAT_VERSION}; upgrade keyedstate to read it"
        )
    states = {}
    for name, (n, kind, value_type, user_key_type, ttl_ms, ser, user_ser) in \
            body["states"].items():
        # The meta info is rebuilt from the serializers (its recorded schema included).
        meta = state_meta_info(n, kind, ser, user_ser, ttl_ms)
        if meta.value_type != value_type or meta.user_key_type != user_key_type:
            raise CorruptCheckpointError(f"{source}: state {n!r} records {value_type} but its "
                                         f"serializer writes {meta.value_type}")
        states[name] = StateMetaInfoSnapshot(meta, ser, user_ser)
    return MetaFile(body["max_parallelism"], body["key_group_prefix_bytes"],
                    body["list_sequence"], states)


@dataclass(frozen=True, slots=True)
class SharedBase:
    """The SST files of one snapshot, as stored in one storage root. ``owned`` False: a
    restored snapshot the job does not own (NO_CLAIM); its files are duplicated into the job's
    root by the next snapshot, never referenced. ``storage`` is where the files lie (needed
    to duplicate them)."""

    checkpoint_id: int
    storage_url: str
    sst_files: Mapping[str, StreamHandle]
    storage: CheckpointStorage | None = None
    owned: bool = True


# --------------------------------------------------------------------------------------------
# instances inside one handle
# --------------------------------------------------------------------------------------------


def instance_prefix(index: int) -> str:
    """Prefix of instance ``index``'s files in a multi-instance handle: ``i<k>/``. File numbers
    are unique only within one DB, so the prefix keeps the names of two instances apart."""
    return f"i{index}/"


def format_instance_ranges(ranges: Sequence[KeyGroupRange]) -> str:
    """:data:`PROP_INSTANCES`: ``"start-end,start-end,..."``, instance ``k`` is the k-th."""
    return ",".join(f"{r.start}-{r.end}" for r in ranges)


@dataclass(frozen=True, slots=True)
class InstanceHandle:
    """One RocksDB instance inside a :class:`KeyedStateHandle` (a "sub-handle"): its key-group
    range and its files under their names within that DB (prefix stripped). ``index`` is None
    for a handle with one instance and unprefixed names, as every handle written before
    instances existed (and every single-instance handle since)."""

    handle: KeyedStateHandle
    index: int | None
    key_group_range: KeyGroupRange
    files: Mapping[str, StreamHandle]

    @property
    def sst_files(self) -> dict[str, StreamHandle]:
        """The shared files (SSTs, OPTIONS) by local name: the next snapshot's base."""
        prefix = "" if self.index is None else instance_prefix(self.index)
        return {name[len(prefix):]: s for name, s in self.handle.shared.items()
                if name != META_FILE and name.startswith(prefix)}

    def describe(self) -> str:
        where = "" if self.index is None else f" instance {self.index}"
        return (f"subtask {self.handle.subtask_index}{where} of checkpoint "
                f"{self.handle.checkpoint_id} ({self.key_group_range})")


def split_instances(handle: KeyedStateHandle) -> list[InstanceHandle]:
    """The instances of ``handle`` in key-group order; they cover its range exactly. A handle
    without :data:`PROP_INSTANCES` is one instance covering the handle's range."""
    files = {n: s for n, s in [*handle.shared.items(), *handle.private.items()]
             if n != META_FILE}
    layout = handle.properties.get(PROP_INSTANCES)
    if not layout:
        return [InstanceHandle(handle, None, handle.key_group_range, files)]
    what = (f"the RocksDB snapshot of subtask {handle.subtask_index} (checkpoint "
            f"{handle.checkpoint_id})")
    try:
        ranges = [KeyGroupRange(*(int(x) for x in part.split("-")))
                  for part in layout.split(",")]
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{what} has an unreadable {PROP_INSTANCES} {layout!r}; "
                                     f"restore from another checkpoint") from exc
    if not handle.key_group_range.is_split_into(ranges):
        raise CorruptCheckpointError(
            f"{what}: its instances {layout!r} do not cover {handle.key_group_range} "
            f"contiguously; restore from another checkpoint")
    out = []
    for index, r in enumerate(ranges):
        prefix = instance_prefix(index)
        out.append(InstanceHandle(handle, index, r, {n[len(prefix):]: s for n, s in files.items()
                                                     if n.startswith(prefix)}))
    if sum(len(i.files) for i in out) != len(files):
        raise CorruptCheckpointError(f"{what} has files of no instance; restore from another "
                                     f"checkpoint")
    return out


# --------------------------------------------------------------------------------------------
# the strategy (per instance) and the result (per subtask)
# --------------------------------------------------------------------------------------------


class RocksDBIncrementalSnapshotStrategy:
    """Snapshots one RocksDB instance and remembers which of its snapshots is the confirmed
    base. A keyed backend has one per instance, so each instance uploads only its new SSTs.

    Thread-safe between the task thread (snapshot, notifications) and a thread running
    ``materialize``.
    """

    def __init__(self, *, incremental: bool) -> None:
        self.incremental = incremental
        self._lock = threading.Lock()
        self._confirmed: SharedBase | None = None
        self._pending: dict[int, SharedBase] = {}
        self._aborted: set[int] = set()

    @property
    def confirmed_base(self) -> SharedBase | None:
        with self._lock:
            return self._confirmed

    def set_restored_base(self, base: SharedBase) -> None:
        """The restored files of this instance may be the base (see the restore)."""
        with self._lock:
            self._confirmed = base

    def snapshot(self, checkpoint_id: int, db: rocksdict.Rdict,
                 column_families: Sequence[rocksdict.Rdict], local_dir: str, *, full: bool
                 ) -> InstanceSnapshot:
        """Steps 1-3 of the synchronous part for this instance, into ``local_dir`` (which must
        not exist; its parent must)."""
        # Step 1. Flush every column family.
        with native(f"flushing column families for checkpoint {checkpoint_id}"):
            for cf in column_families:
                cf.flush(True)
        # Step 2. Hard-link the live files into the local snapshot directory.
        with native(f"creating the local RocksDB checkpoint {local_dir}"):
            rocksdict.Checkpoint(db).create_checkpoint(local_dir)
        # Step 3. The base: only a confirmed snapshot, never a pending or aborted one.
        base = None if full or not self.incremental else self.confirmed_base
        return InstanceSnapshot(self, local_dir, base)

    # -- called by results and by the coordinator's notifications ------------------------------

    def _materialized(self, checkpoint_id: int, shared: SharedBase) -> None:
        with self._lock:
            confirmed = self._confirmed.checkpoint_id if self._confirmed else -1
            if checkpoint_id not in self._aborted and checkpoint_id > confirmed:
                self._pending[checkpoint_id] = shared

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        with self._lock:
            shared = self._pending.get(checkpoint_id)
            if shared is not None:
                self._confirmed = shared
            # Older pending snapshots can never become the base any more (Flink drops them too).
            for cid in [c for c in self._pending if c <= checkpoint_id]:
                del self._pending[cid]
            self._aborted = {c for c in self._aborted if c > checkpoint_id}

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        with self._lock:
            self._pending.pop(checkpoint_id, None)
            self._aborted.add(checkpoint_id)


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """The frozen local checkpoint of one instance and the base it may build on."""

    strategy: RocksDBIncrementalSnapshotStrategy
    local_dir: str
    base: SharedBase | None


class RocksDBSnapshotResult(SnapshotResult):
    """The frozen local checkpoints of every instance of one keyed backend, waiting to be
    uploaded as one :class:`KeyedStateHandle`.

    ``parts`` are ``(name prefix, instance snapshot)`` in key-group order; the prefix is empty
    for a single instance (the layout of every handle before instances existed) and
    :func:`instance_prefix` otherwise. ``local_dir`` holds everything (removed when done).
    """

    def __init__(self, *, backend_name: str, subtask_index: int,
                 key_group_range: KeyGroupRange, checkpoint_id: int, local_dir: str,
                 parts: Sequence[tuple[str, InstanceSnapshot]],
                 location: CheckpointStorageLocation, states: list[StateMetaInfo],
                 properties: dict[str, str], sync_duration_s: float) -> None:
        super().__init__(checkpoint_id, sync_duration_s)
        self.local_dir = local_dir
        self._backend_name = backend_name
        self._subtask_index = subtask_index
        self._key_group_range = key_group_range
        self._parts = list(parts)
        self._location = location
        self._states = states
        self._properties = properties
        self._done = False

    def _materialize(self) -> KeyedStateHandle:
        if self._done:
            raise BackendError(f"snapshot {self.checkpoint_id} was already materialized or "
                               f"discarded; take a new snapshot")
        self._done = True
        location = self._location
        storage = location.storage
        # Handle names (prefix + local name) of what is stored, in the order of ``to_store``.
        to_store: list[StateFile] = []
        store_names: list[str] = []
        referenced: dict[str, StreamHandle] = {}
        # Per part: handle names of duplicated files, their sources, and the storage to copy from.
        duplicates: list[tuple[CheckpointStorage, list[tuple[str, StreamHandle]]]] = []
        part_names: list[list[str]] = []  # shared handle names of each part
        try:
            # A local directory removed meanwhile (the backend closed) is reported by _collect,
            # which lists every instance's directory below it before anything is stored.
            if self._parts and self._parts[0][0]:
                # Several instances: the meta file lies next to their directories.
                path = os.path.join(self.local_dir, META_FILE)
                to_store.append(StateFile(META_FILE, False, local_path=path))
                store_names.append(META_FILE)
            for prefix, part in self._parts:
                names: list[str] = []
                part_names.append(names)
                to_dup: list[tuple[str, StreamHandle]] = []
                dup_from = self._collect(prefix, part, storage, to_store, store_names,
                                         referenced, to_dup, names)
                if dup_from is not None and to_dup:
                    duplicates.append((dup_from, to_dup))
            stored = location.put_files(to_store)
            duplicated = [location.duplicate_files(source, files) for source, files in duplicates]
        finally:
            # Step 3. The hard links go; the DBs keep their own.
            shutil.rmtree(self.local_dir, ignore_errors=True)
        shared = dict(referenced)
        private: dict[str, StreamHandle] = {}
        for (_, files), handles in zip(duplicates, duplicated):
            for (name, _), handle in zip(files, handles):
                shared[name] = handle
        for f, name, handle in zip(to_store, store_names, stored):
            (shared if f.shared else private)[name] = handle
        written = sum(h.length for h in stored) + sum(h.length for hs in duplicated for h in hs)
        for (prefix, part), names in zip(self._parts, part_names):
            part.strategy._materialized(
                self.checkpoint_id,
                SharedBase(self.checkpoint_id, storage.url,
                           {n[len(prefix):]: shared[n] for n in names}, storage))
        kg = self._key_group_range
        self.stats.extra.update(location.stats.as_dict())
        return KeyedStateHandle(
            backend=self._backend_name,
            subtask_index=self._subtask_index,
            key_group_start=kg.start,
            key_group_end=kg.end,
            checkpoint_id=self.checkpoint_id,
            states=self._states,
            shared=dict(sorted(shared.items())),
            private=dict(sorted(private.items())),
            full_size=sum(h.length for h in [*shared.values(), *private.values()]),
            incremental_size=written,
            properties={**self._properties, **location.stats.to_properties()},
        )

    @staticmethod
    def _collect(prefix: str, part: InstanceSnapshot, storage: CheckpointStorage,
                 to_store: list[StateFile], store_names: list[str],
                 referenced: dict[str, StreamHandle], to_duplicate: list[tuple[str, StreamHandle]],
                 shared_names: list[str]) -> CheckpointStorage | None:
        """Sort one instance's files into referenced, to duplicate and to store (steps 1 and
        2); returns the storage to duplicate from, if any. Handle names get ``prefix``; stored
        names get it with ``/`` turned into ``-`` (no subdirectory per file in ``shared/``)."""
        # Which SSTs of the base may be reused, and how: referenced in place (the job's own
        # files in this root), duplicated by the store (a restored snapshot the job does not
        # own, or another root of the same store), or not at all (another store: upload).
        reuse: Mapping[str, StreamHandle] = {}
        duplicate_from: CheckpointStorage | None = None
        base = part.base
        if base is not None:
            if base.owned and base.storage_url == storage.url:
                reuse = base.sst_files
            elif base.storage is not None and same_store(base.storage, storage):
                reuse, duplicate_from = base.sst_files, base.storage
        by_content = {(h.digest, h.length): h for n, h in reuse.items()
                      if n.startswith(OPTIONS_PREFIX)}
        stored_prefix = prefix.replace("/", "-")
        try:
            local_names = sorted(os.listdir(part.local_dir))
        except FileNotFoundError as exc:
            raise BackendError(
                f"the local snapshot directory {part.local_dir} is gone (was the keyed "
                f"backend closed before materialize?); take a new snapshot"
            ) from exc
        for local in local_names:
            path = os.path.join(part.local_dir, local)
            name = prefix + local
            if os.path.isdir(path):
                continue  # the instance directories of a multi-instance snapshot
            if local.endswith(WAL_SUFFIX) and os.path.getsize(path) == 0:
                # The WAL is off and every column family was flushed: an empty log holds
                # nothing and RocksDB opens without it.
                continue
            if local.endswith(SST_SUFFIX) or local.startswith(OPTIONS_PREFIX):
                # Step 1. Reuse SST files of the base, store new ones. An OPTIONS file is
                # immutable too (a new number when the options change) and the same in
                # every snapshot of one DB: shared like an SST, stored once.
                shared_names.append(name)
                known = reuse.get(local)
                if known is not None and known.length != os.path.getsize(path):
                    known = None
                if known is None and local.startswith(OPTIONS_PREFIX):
                    # Reopening a DB writes its OPTIONS again under a new number: the
                    # same bytes, found by content (the file is a few KB).
                    known = by_content.get((file_checksum(path), os.path.getsize(path)))
                if known is not None:
                    if duplicate_from is None:
                        referenced[name] = known
                    else:
                        to_duplicate.append((name, known))
                else:
                    to_store.append(StateFile(stored_prefix + local, True, local_path=path,
                                              immutable=True))
                    store_names.append(name)
            else:
                # Step 2. Everything else is private to this checkpoint.
                to_store.append(StateFile(stored_prefix + local, False, local_path=path))
                store_names.append(name)
        return duplicate_from

    def discard(self) -> None:
        self._done = True
        shutil.rmtree(self.local_dir, ignore_errors=True)
