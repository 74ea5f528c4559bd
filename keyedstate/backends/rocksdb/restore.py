"""Restoring a RocksDB instance from snapshot handles (Flink's
``RocksDBIncrementalRestoreOperation``), with and without rescaling (seed 001).

- **No rescaling** (one handle with exactly this subtask's key-group range): download its files
  into the fresh instance directory and open the DB.
- **Rescaling, ``"ingest"``** (the default): choose the handle whose key-group range overlaps
  ours by the largest fraction as the initial DB (``chooseTheBestStateHandleForInitial``),
  delete the key groups outside our range with one range delete per column family and side
  (``clipDBWithKeyGroupRange``), then for every other handle open a temporary copy, write its
  in-range key range per column family into sorted SST files with ``SstFileWriter`` and ingest
  them (``ingest_external_file``, files moved, not copied).
- **Rescaling, ``"copy"``**: an empty DB and a key-by-key copy of every handle's in-range keys
  through write batches. Kept only as the benchmark baseline the ingest path is measured
  against.

Every downloaded file is verified (size and checksum) by
:meth:`~keyedstate.checkpoint.storage.CheckpointStorage.download`: a corrupt file raises
:class:`CorruptCheckpointError` before RocksDB reads it. The files of a handle download in
parallel and through the process's file cache (an executor that wrote or read them before
finds them on its local disk). The SST files of the restored DB (the one handle, or the initial
handle of a rescale) are the next snapshot's base: referenced in place when they are the job's
own (``share_restored_files``), duplicated by the store otherwise (NO_CLAIM).
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Sequence, cast

import rocksdict

from keyedstate.backends.rocksdb.options import (
    DEFAULT_COLUMN_FAMILY,
    RocksDBOptions,
    native,
    open_db,
    scan,
)
from keyedstate.backends.rocksdb.snapshot import (
    META_FILE,
    SST_SUFFIX,
    MetaFile,
    SharedBase,
    StateMetaInfoSnapshot,
    read_meta_file,
)
from keyedstate.checkpoint.metadata import KeyedStateHandle, StreamHandle
from keyedstate.checkpoint.storage import CheckpointStorage
from keyedstate.checkpoint.transfer import TransferStats
from keyedstate.errors import (
    BackendError,
    ConfigurationError,
    CorruptCheckpointError,
    MaxParallelismMismatchError,
    StateTypeMismatchError,
)
from keyedstate.keygroups import KeyGroupRange, serialize_key_group

RESCALE_STRATEGIES = ("ingest", "copy")
_COPY_BATCH = 10_000
_SST_CHECK_EVERY = 4096


@dataclass
class RestoreResult:
    """An opened DB and what the snapshots said about it."""

    db: rocksdict.Rdict
    states: dict[str, StateMetaInfoSnapshot] = field(default_factory=dict)
    list_sequence: int = 0
    #: the restored files the next snapshot may reuse (None: upload everything).
    base: SharedBase | None = None
    #: what the restore downloaded, took from the file cache, ...
    stats: TransferStats = field(default_factory=TransferStats)


def choose_the_best_state_handle_for_initial(
    handles: Sequence[KeyedStateHandle], target: KeyGroupRange,
    overlap_fraction_threshold: float = 0.0,
) -> KeyedStateHandle | None:
    """The handle whose key-group range overlaps ``target`` by the largest fraction of its own
    range (least to clip away), ties broken by the larger overlap, then by order; None when no
    fraction reaches the threshold. Flink's ``chooseTheBestStateHandleForInitial``."""
    best: KeyedStateHandle | None = None
    best_score = (-1.0, -1)
    for handle in handles:
        overlap = len(handle.key_group_range.intersection(target))
        fraction = overlap / max(1, len(handle.key_group_range))
        if fraction >= overlap_fraction_threshold and overlap and (fraction, overlap) > best_score:
            best, best_score = handle, (fraction, overlap)
    return best


def key_group_bounds(key_groups: KeyGroupRange, prefix_bytes: int) -> tuple[bytes, bytes]:
    """``[lower, upper)`` keys of a key-group range in every column family."""
    return (serialize_key_group(key_groups.start, prefix_bytes),
            serialize_key_group(key_groups.end + 1, prefix_bytes))


def clip_db_with_key_group_range(db: rocksdict.Rdict, column_families: Sequence[str],
                                 target: KeyGroupRange, current: KeyGroupRange,
                                 prefix_bytes: int) -> None:
    """Delete the key groups of ``current`` outside ``target`` from every column family with
    one range delete per side (Flink's ``clipDBWithKeyGroupRange``). Key groups are the key
    prefix, so what goes is always a head and a tail of the key space."""
    ranges = []
    if current.start < target.start:
        ranges.append((serialize_key_group(current.start, prefix_bytes),
                       serialize_key_group(target.start, prefix_bytes)))
    if current.end > target.end:
        ranges.append((serialize_key_group(target.end + 1, prefix_bytes),
                       serialize_key_group(current.end + 1, prefix_bytes)))
    with native(f"clipping the restored DB to {target}"):
        for name in column_families:
            cf = db.get_column_family(name)
            for begin, end in ranges:
                cf.delete_range(begin, end)


def column_family_names(db_path: str, options: RocksDBOptions) -> list[str]:
    """Every column family of the DB at ``db_path``, RocksDB's ``default`` included (empty
    unless a state is called "default"), so clip, ingest and copy miss none."""
    with native(f"listing the column families of {db_path}"):
        return sorted(rocksdict.Rdict.list_cf(db_path, options.to_options()))


class RocksDBIncrementalRestoreOperation:
    """Restores one subtask's DB into ``db_dir`` from the overlapping ``handles``; temporary
    downloads go below ``work_dir`` and are removed when done."""

    def __init__(self, *, handles: Sequence[KeyedStateHandle], storage: CheckpointStorage | None,
                 key_group_range: KeyGroupRange, max_parallelism: int,
                 key_group_prefix_bytes: int, db_dir: str, work_dir: str,
                 options: RocksDBOptions, rescale_strategy: str,
                 share_restored_files: bool) -> None:
        if handles and storage is None:
            raise ConfigurationError("restoring RocksDB state needs the CheckpointStorage the "
                                     "handles were written to; pass storage=...")
        if rescale_strategy not in RESCALE_STRATEGIES:
            raise ConfigurationError(f"rescale_strategy {rescale_strategy!r} is unknown; choose "
                                     f"one of {list(RESCALE_STRATEGIES)}")
        self.handles = list(handles)
        self.storage = storage
        self.key_group_range = key_group_range
        self.max_parallelism = max_parallelism
        self.prefix_bytes = key_group_prefix_bytes
        self.db_dir = db_dir
        self.work_dir = work_dir
        self.options = options
        self.rescale_strategy = rescale_strategy
        self.share_restored_files = share_restored_files
        self._metas: list[MetaFile] = []
        self.stats = TransferStats()

    def restore(self) -> RestoreResult:
        if not self.handles:
            return RestoreResult(open_db(self.db_dir, self.options))
        if len(self.handles) == 1 and self.handles[0].key_group_range == self.key_group_range:
            result = self._restore_without_rescaling(self.handles[0])
        elif self.rescale_strategy == "copy":
            result = self._restore_by_copy()
        else:
            result = self._restore_with_rescaling()
        self._merge_metas(result)
        result.stats = self.stats
        return result

    def _base_of(self, handle: KeyedStateHandle) -> SharedBase:
        """The SSTs of ``handle``, now files of the restored DB, as the next snapshot's base:
        the job's own (referenced in place) with ``share_restored_files``, else a snapshot it
        does not own (duplicated by the next snapshot; id 0 so that any new snapshot of the
        job, whose ids start anywhere, replaces it as the base)."""
        assert self.storage is not None
        ssts = {name: s for name, s in handle.shared.items() if name != META_FILE}
        return SharedBase(handle.checkpoint_id if self.share_restored_files else 0,
                          self.storage.url, ssts, self.storage, self.share_restored_files)

    # -- downloads -----------------------------------------------------------------------------

    def _download(self, handle: KeyedStateHandle, db_dir: str) -> None:
        """All files of ``handle`` into ``db_dir``; its meta file is read and kept aside."""
        assert self.storage is not None
        os.makedirs(db_dir, exist_ok=True)
        meta_path = None
        items: list[tuple[StreamHandle, str, bool]] = []
        for name, stream in [*handle.shared.items(), *handle.private.items()]:
            if name == META_FILE:
                meta_path = os.path.join(self.work_dir, f"{uuid.uuid4().hex}-{META_FILE}")
                items.append((stream, meta_path, False))
            else:
                # SST files are immutable: the cache may hand them out as hard links.
                items.append((stream, os.path.join(db_dir, os.path.basename(name)),
                              name.endswith(SST_SUFFIX)))
        self.storage.download_all(items, stats=self.stats)
        if meta_path is None:
            raise CorruptCheckpointError(
                f"the RocksDB snapshot of subtask {handle.subtask_index} (checkpoint "
                f"{handle.checkpoint_id}) has no {META_FILE} file; it was not written by this "
                f"backend. Restore from another checkpoint or savepoint"
            )
        meta = read_meta_file(meta_path, f"{META_FILE} of checkpoint {handle.checkpoint_id} "
                                         f"subtask {handle.subtask_index}")
        os.remove(meta_path)
        if meta.max_parallelism != self.max_parallelism:
            raise MaxParallelismMismatchError(
                f"the snapshot of subtask {handle.subtask_index} (checkpoint "
                f"{handle.checkpoint_id}) was taken with max parallelism {meta.max_parallelism}, "
                f"the job restoring it has {self.max_parallelism}; keep the max parallelism or "
                f"rewrite the state with the state processor API"
            )
        self._metas.append(meta)

    def _temporary_db(self, handle: KeyedStateHandle) -> tuple[str, rocksdict.Rdict]:
        path = os.path.join(self.work_dir, f"restore-{handle.subtask_index}-{uuid.uuid4().hex}")
        self._download(handle, path)
        # Read-only: no compaction or flush of a copy that is thrown away.
        names = column_family_names(path, self.options)
        with native(f"opening the downloaded RocksDB at {path}"):
            db = rocksdict.Rdict(path, self.options.to_options(),
                                 column_families={n: self.options.to_options() for n in names
                                                  if n != DEFAULT_COLUMN_FAMILY},
                                 access_type=rocksdict.AccessType.read_only(False))
        return path, db

    # -- the three flows -----------------------------------------------------------------------

    def _restore_without_rescaling(self, handle: KeyedStateHandle) -> RestoreResult:
        self._download(handle, self.db_dir)
        result = RestoreResult(open_db(self.db_dir, self.options))
        result.base = self._base_of(handle)
        return result

    def _restore_with_rescaling(self) -> RestoreResult:
        # Step 1. The best-overlapping handle becomes the initial DB, clipped to our range.
        initial = choose_the_best_state_handle_for_initial(self.handles, self.key_group_range)
        others = [h for h in self.handles if h is not initial]
        if initial is None:
            db = open_db(self.db_dir, self.options)
        else:
            self._download(initial, self.db_dir)
            db = open_db(self.db_dir, self.options)
            clip_db_with_key_group_range(db, column_family_names(self.db_dir, self.options),
                                         self.key_group_range, initial.key_group_range,
                                         self.prefix_bytes)
        try:
            # Step 2. Every other handle: its in-range keys as SST files, ingested per CF.
            for handle in others:
                self._ingest_handle(db, handle)
        except BaseException:
            with native("closing the DB of a failed restore"):
                db.close()
            raise
        # The initial DB's own files stay (clipped by range tombstones, not rewritten): the
        # next snapshot reuses them instead of uploading them again.
        return RestoreResult(db, base=None if initial is None else self._base_of(initial))

    def _ingest_handle(self, db: rocksdict.Rdict, handle: KeyedStateHandle) -> None:
        path, source = self._temporary_db(handle)
        lower, upper = key_group_bounds(handle.key_group_range.intersection(self.key_group_range),
                                        self.prefix_bytes)
        try:
            existing = set(column_family_names(self.db_dir, self.options))
            for name in column_family_names(path, self.options):
                files = self._write_sst_files(source.get_column_family(name), name, lower, upper)
                if not files:
                    continue
                with native(f"ingesting {len(files)} SST files into column family {name!r}"):
                    if name not in existing:
                        db.create_column_family(name, self.options.to_options())
                        existing.add(name)
                    ingest = rocksdict.IngestExternalFileOptions()
                    ingest.set_move_files(True)
                    db.get_column_family(name).ingest_external_file(files, ingest)
        finally:
            with native(f"closing the downloaded RocksDB at {path}"):
                source.close()
            del source
            shutil.rmtree(path, ignore_errors=True)

    def _write_sst_files(self, cf: rocksdict.Rdict, name: str, lower: bytes,
                         upper: bytes) -> list[str]:
        """The keys of ``cf`` in ``[lower, upper)`` as sorted SST files of at most about
        ``target_file_size_base`` bytes each."""
        files: list[str] = []
        target = self.options.target_file_size_base
        what = f"writing SST files of column family {name!r} for ingestion"
        key = None
        with native(what):
            items = range_items(cf, lower, upper)
            # The outer loop takes the first key of each file, the inner one fills the file
            # until it reaches the target size; both draw from the same iterator.
            for key, value in items:
                files.append(os.path.join(self.work_dir, f"ingest-{uuid.uuid4().hex}.sst"))
                writer = rocksdict.SstFileWriter(self.options.to_options())
                writer.open(files[-1])
                writer[key] = value
                count = 0
                for key, value in items:
                    writer[key] = value
                    count += 1
                    if count == _SST_CHECK_EVERY:
                        if writer.file_size() >= target:
                            break
                        count = 0
                writer.finish()
        check_range_end(cf, key, lower, upper, what)
        return files

    def _restore_by_copy(self) -> RestoreResult:
        db = open_db(self.db_dir, self.options)
        try:
            for handle in self.handles:
                path, source = self._temporary_db(handle)
                lower, upper = key_group_bounds(
                    handle.key_group_range.intersection(self.key_group_range), self.prefix_bytes)
                try:
                    for name in column_family_names(path, self.options):
                        self._copy_column_family(source.get_column_family(name), db, name,
                                                 lower, upper)
                finally:
                    with native(f"closing the downloaded RocksDB at {path}"):
                        source.close()
                    del source
                    shutil.rmtree(path, ignore_errors=True)
        except BaseException:
            with native("closing the DB of a failed restore"):
                db.close()
            raise
        return RestoreResult(db)

    def _copy_column_family(self, source: rocksdict.Rdict, db: rocksdict.Rdict, name: str,
                            lower: bytes, upper: bytes) -> None:
        what = f"copying column family {name!r} key by key"
        key = None
        with native(what):
            if name not in column_family_names(self.db_dir, self.options):
                db.create_column_family(name, self.options.to_options())
            handle = db.get_column_family_handle(name)
            write_options = self.options.write_options()
            batch, count = _new_batch(handle), 0
            for key, value in range_items(source, lower, upper):
                batch.put(key, value)
                count += 1
                if count == _COPY_BATCH:
                    db.write(batch, write_options)
                    batch, count = _new_batch(handle), 0
            if count:
                db.write(batch, write_options)
        check_range_end(source, key, lower, upper, what)

    # -- meta ----------------------------------------------------------------------------------

    def _merge_metas(self, result: RestoreResult) -> None:
        """One meta info per state over all handles (they must agree); the largest list
        sequence, so list order survives the merge."""
        for meta in self._metas:
            result.list_sequence = max(result.list_sequence, meta.list_sequence)
            for name, info in meta.states.items():
                known = result.states.setdefault(name, info)
                if known.meta != info.meta:
                    raise StateTypeMismatchError(
                        f"state {name!r} is {known.meta} in one restored handle and {info.meta} "
                        f"in another; the snapshots don't belong to one checkpoint"
                    )


def _new_batch(handle: rocksdict.ColumnFamily) -> rocksdict.WriteBatch:
    batch = rocksdict.WriteBatch(raw_mode=True)
    batch.set_default_column_family(handle)
    return batch


def range_items(cf: rocksdict.Rdict, lower: bytes, upper: bytes) -> Iterator[tuple[bytes, bytes]]:
    """``(key, value)`` of ``cf`` with ``lower <= key < upper``, in key order, for a bulk
    read: the bound is in the read options (no per-key check in Python) and the blocks read
    bypass the block cache (the process shares it with live DBs). Like ``Rdict.items()`` it
    ends silently on an error: call :func:`check_range_end` after the loop."""
    read_options = rocksdict.ReadOptions()
    read_options.set_iterate_upper_bound(upper)
    read_options.fill_cache(False)  # type: ignore[call-arg]  # the stub lacks the flag
    # rocksdict's stub types keys as any key type; in raw mode they are bytes.
    return cast(Iterator[tuple[bytes, bytes]], cf.items(from_key=lower, read_opt=read_options))


def check_range_end(cf: rocksdict.Rdict, last: bytes | None, lower: bytes, upper: bytes,
                    what: str) -> None:
    """Raise :class:`BackendError` unless a :func:`range_items` loop that stopped at ``last``
    (None: it yielded nothing) read the whole range: seek just past ``last`` and check that
    the range is exhausted with a good status (a corrupt block fails the seek again)."""
    with native(what):
        read_options = rocksdict.ReadOptions()
        read_options.set_iterate_upper_bound(upper)
        it = cf.iter(read_options)
        it.seek(lower if last is None else last + b"\x00")
        valid = it.valid()
        it.status()
        del it
    if valid:
        raise BackendError(f"RocksDB ended a scan early while {what}; the downloaded files are "
                           f"damaged or the local disk failed, check it and restore again")


def iter_column_family_keys(db: rocksdict.Rdict, name: str) -> Iterator[bytes]:
    """Every key of one column family (tests and tools check clipping with it)."""
    for key, _ in scan(db.get_column_family(name), None, None, f"reading {name!r}"):
        yield key
