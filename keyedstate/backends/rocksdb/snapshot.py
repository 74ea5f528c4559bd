"""Incremental snapshots of a RocksDB instance (Flink's ``RocksDBIncrementalSnapshotStrategy``).

Synchronous part (:meth:`RocksDBIncrementalSnapshotStrategy.snapshot`, processing is paused;
before it, a ``full`` snapshot deletes expired TTL entries so a restore can't revive them):

1. flush every column family, so the memtables are in SST files (the WAL is off);
2. create a RocksDB checkpoint (hard links of the live SST files, copies of MANIFEST, CURRENT,
   OPTIONS) in a fresh local snapshot directory, and write the state meta file next to them;
3. take the base: the SST files of the last *confirmed* snapshot (none when ``full``, when
   incremental snapshots are off, or when no snapshot was confirmed yet).

Asynchronous part (:meth:`RocksDBSnapshotResult.materialize`, processing goes on):

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
   :meth:`~keyedstate.checkpoint.storage.CheckpointStorageLocation.put_files`: small files are
   inlined into ``_metadata`` or merged into one object, the rest uploaded in parallel;
3. the local snapshot directory is deleted; the shared files become a base candidate that only
   :meth:`~RocksDBIncrementalSnapshotStrategy.notify_checkpoint_complete` turns into the base.

SST files are immutable and their names are never reused within one DB, so a name the confirmed
snapshot has is the same bytes (seed 003).
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import rocksdict

from keyedstate.backends.base.backend import SnapshotResult
from keyedstate.backends.rocksdb.options import native
from keyedstate.checkpoint.metadata import KeyedStateHandle, StateMetaInfo, StreamHandle
from keyedstate.checkpoint.storage import (
    CheckpointStorage,
    CheckpointStorageLocation,
    StateFile,
    file_checksum,
    same_store,
)
from keyedstate.checkpoint.transfer import RESTORE_PREFIX, TransferStats
from keyedstate.errors import (
    BackendError,
    CorruptCheckpointError,
    UnsupportedFormatVersionError,
)
from keyedstate.keygroups import KeyGroupRange
from keyedstate.serde import TypeSerializer

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
        states[name] = StateMetaInfoSnapshot(
            StateMetaInfo(n, kind, value_type, user_key_type, ttl_ms), ser, user_ser)
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


class RocksDBIncrementalSnapshotStrategy:
    """Snapshots one RocksDB instance and remembers which snapshot is the confirmed base.

    Thread-safe between the task thread (snapshot, notifications) and a thread running
    ``materialize``.
    """

    def __init__(self, *, backend_name: str, subtask_index: int,
                 key_group_range: KeyGroupRange, snapshot_root: str,
                 incremental: bool) -> None:
        self.backend_name = backend_name
        self.subtask_index = subtask_index
        self.key_group_range = key_group_range
        self.snapshot_root = snapshot_root
        self.incremental = incremental
        self._lock = threading.Lock()
        self._confirmed: SharedBase | None = None
        self._pending: dict[int, SharedBase] = {}
        self._aborted: set[int] = set()
        #: what the restore of this instance moved, reported by its first snapshot
        self.restore_stats: TransferStats | None = None

    @property
    def confirmed_base(self) -> SharedBase | None:
        with self._lock:
            return self._confirmed

    def set_restored_base(self, base: SharedBase) -> None:
        """The restored snapshot may be the base (restored alone, exact range, shared files)."""
        with self._lock:
            self._confirmed = base

    def snapshot(self, checkpoint_id: int, db: rocksdict.Rdict,
                 column_families: list[rocksdict.Rdict], location: CheckpointStorageLocation,
                 meta: MetaFile, state_infos: list[StateMetaInfo], *, full: bool
                 ) -> RocksDBSnapshotResult:
        """The synchronous part (see the module docstring)."""
        start = time.perf_counter()
        local_dir = os.path.join(self.snapshot_root, f"chk-{checkpoint_id}-{uuid.uuid4().hex}")
        os.makedirs(self.snapshot_root, exist_ok=True)
        # Step 1. Flush every column family.
        with native(f"flushing column families for checkpoint {checkpoint_id}"):
            for cf in column_families:
                cf.flush(True)
        # Step 2. Hard-link the live files into the local snapshot directory.
        with native(f"creating the local RocksDB checkpoint {local_dir}"):
            rocksdict.Checkpoint(db).create_checkpoint(local_dir)
        write_meta_file(os.path.join(local_dir, META_FILE), meta)
        # Step 3. The base: only a confirmed snapshot, never a pending or aborted one.
        base = None if full or not self.incremental else self.confirmed_base
        properties = {
            PROP_KEY_GROUP_PREFIX_BYTES: str(meta.key_group_prefix_bytes),
            PROP_LIST_SEQUENCE: str(meta.list_sequence),
            PROP_BASE_CHECKPOINT: "" if base is None else str(base.checkpoint_id),
        }
        restore_stats, self.restore_stats = self.restore_stats, None
        if restore_stats is not None:
            properties.update(restore_stats.to_properties(RESTORE_PREFIX))
        return RocksDBSnapshotResult(
            strategy=self, checkpoint_id=checkpoint_id, local_dir=local_dir,
            location=location, base=base, states=state_infos, properties=properties,
            sync_duration_s=time.perf_counter() - start)

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


class RocksDBSnapshotResult(SnapshotResult):
    """A frozen local RocksDB checkpoint waiting to be uploaded."""

    def __init__(self, *, strategy: RocksDBIncrementalSnapshotStrategy, checkpoint_id: int,
                 local_dir: str, location: CheckpointStorageLocation, base: SharedBase | None,
                 states: list[StateMetaInfo], properties: dict[str, str],
                 sync_duration_s: float) -> None:
        super().__init__(checkpoint_id, sync_duration_s)
        self.local_dir = local_dir
        self._strategy = strategy
        self._location = location
        self._base = base
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
        # Which SSTs of the base may be reused, and how: referenced in place (the job's own
        # files in this root), duplicated by the store (a restored snapshot the job does not
        # own, or another root of the same store), or not at all (another store: upload).
        reuse: Mapping[str, StreamHandle] = {}
        duplicate_from: CheckpointStorage | None = None
        base = self._base
        if base is not None:
            if base.owned and base.storage_url == storage.url:
                reuse = base.sst_files
            elif base.storage is not None and same_store(base.storage, storage):
                reuse, duplicate_from = base.sst_files, base.storage
        by_content = {(h.digest, h.length): h for n, h in reuse.items()
                      if n.startswith(OPTIONS_PREFIX)}
        referenced: dict[str, StreamHandle] = {}
        to_duplicate: list[tuple[str, StreamHandle]] = []
        to_store: list[StateFile] = []
        try:
            try:
                names = sorted(os.listdir(self.local_dir))
            except FileNotFoundError as exc:
                raise BackendError(
                    f"the local snapshot directory {self.local_dir} is gone (was the keyed "
                    f"backend closed before materialize?); take a new snapshot"
                ) from exc
            for name in names:
                path = os.path.join(self.local_dir, name)
                if name.endswith(WAL_SUFFIX) and os.path.getsize(path) == 0:
                    # The WAL is off and every column family was flushed: an empty log holds
                    # nothing and RocksDB opens without it.
                    continue
                if name.endswith(SST_SUFFIX) or name.startswith(OPTIONS_PREFIX):
                    # Step 1. Reuse SST files of the base, store new ones. An OPTIONS file is
                    # immutable too (a new number when the options change) and the same in
                    # every snapshot of one DB: shared like an SST, stored once.
                    known = reuse.get(name)
                    if known is not None and known.length != os.path.getsize(path):
                        known = None
                    if known is None and name.startswith(OPTIONS_PREFIX):
                        # Reopening a DB writes its OPTIONS again under a new number: the
                        # same bytes, found by content (the file is a few KB).
                        known = by_content.get((file_checksum(path), os.path.getsize(path)))
                    if known is not None:
                        if duplicate_from is None:
                            referenced[name] = known
                        else:
                            to_duplicate.append((name, known))
                    else:
                        to_store.append(StateFile(name, True, local_path=path, immutable=True))
                else:
                    # Step 2. Everything else is private to this checkpoint.
                    to_store.append(StateFile(name, False, local_path=path))
            stored = location.put_files(to_store)
            duplicated = (location.duplicate_files(duplicate_from, to_duplicate)
                          if duplicate_from is not None and to_duplicate else [])
        finally:
            # Step 3. The hard links go; the DB keeps its own.
            shutil.rmtree(self.local_dir, ignore_errors=True)
        shared = dict(referenced)
        private: dict[str, StreamHandle] = {}
        for (name, _), handle in zip(to_duplicate, duplicated):
            shared[name] = handle
        for f, handle in zip(to_store, stored):
            (shared if f.shared else private)[f.name] = handle
        written = sum(h.length for h in [*stored, *duplicated])
        self._strategy._materialized(
            self.checkpoint_id, SharedBase(self.checkpoint_id, storage.url, dict(shared),
                                           storage))
        kg = self._strategy.key_group_range
        self.stats.extra.update(location.stats.as_dict())
        return KeyedStateHandle(
            backend=self._strategy.backend_name,
            subtask_index=self._strategy.subtask_index,
            key_group_start=kg.start,
            key_group_end=kg.end,
            checkpoint_id=self.checkpoint_id,
            states=self._states,
            shared=dict(sorted(shared.items())),
            private=private,
            full_size=sum(h.length for h in [*shared.values(), *private.values()]),
            incremental_size=written,
            properties={**self._properties, **location.stats.to_properties()},
        )

    def discard(self) -> None:
        self._done = True
        shutil.rmtree(self.local_dir, ignore_errors=True)
