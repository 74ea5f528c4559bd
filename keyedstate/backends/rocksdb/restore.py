"""Restoring the RocksDB instances of one subtask from snapshot handles (Flink's
``RocksDBIncrementalRestoreOperation``), with and without rescaling (clip + SST ingest, as in
Flink's ``DeleteRange`` rescaling).

Every instance of every overlapping handle is a sub-handle with its own key-group range
(:func:`~keyedstate.backends.rocksdb.snapshot.split_instances`; a handle written before
instances existed is one sub-handle covering the handle's range).

- **``"ingest"``** (the default): :func:`plan_instances` makes every overlapping sub-handle an
  instance of its own (a key-group shard of the target): downloaded, opened, and clipped to the
  intersection of its range with the target's by one range delete per column family and side
  (``clipDBWithKeyGroupRange``); no key is rewritten. Without rescaling (the same ranges) this
  is a download and an open per instance. When more sub-handles overlap than
  ``max_instances``, they are cut into that many contiguous, even groups
  (:func:`plan_instances`): each group's largest sub-handle is opened, and every other one's
  in-range keys are written with ``SstFileWriter`` into sorted SST files and ingested
  (``ingest_external_file``, files moved) into it, so instance ranges stay contiguous.
- A fresh backend (nothing to restore) opens ``RocksDBOptions.key_group_shards`` empty
  instances over even parts of its key groups.
- **``"copy"``**: one instance, an empty DB and a key-by-key copy of every sub-handle's in-range
  keys through write batches. Kept only as the benchmark baseline.

Why instances: rocksdict 0.3.29 exposes neither column-family export/import (Flink 1.19's
IngestDB restore) nor ingestion of DB-generated SST files (``ingest_external_file`` of a DB's
own SST fails with "External file version not found"), so data of several old subtasks can
enter one DB only through Python, key by key (~360 ns per key); several DBs need none of that.

Every downloaded file is verified (size and checksum) by
:meth:`~keyedstate.storage.checkpoint_storage.CheckpointStorage.download`: a corrupt file raises
:class:`CorruptCheckpointError` before RocksDB reads it. Every file the restore needs (each
instance's initial sub-handle, each sub-handle to be ingested or copied, each handle's meta
file) downloads in one batch through one pool before anything is opened
(:meth:`~keyedstate.storage.checkpoint_storage.CheckpointStorage.download_all`: segments of one
merged object in one ranged GET, the largest reads first), and through the process's file cache
(an executor that wrote or read them before finds them on its local disk). rocksdict opens
local files only, so nothing opens before its files are all on the local disk (the downloads
of sub-handles to be ingested lie there together until each is ingested). The SST files of
each instance's initial sub-handle are that instance's next snapshot base: referenced in place
when they are the job's own (``share_restored_files``), duplicated by the store otherwise
(NO_CLAIM).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Sequence, cast

import rocksdict

from keyedstate.backends.rocksdb.native import column_family_batch, native, open_db, scan
from keyedstate.backends.rocksdb.options import DEFAULT_COLUMN_FAMILY, RocksDBOptions
from keyedstate.backends.rocksdb.snapshot import (
    META_FILE,
    SST_SUFFIX,
    InstanceHandle,
    MetaFile,
    SharedBase,
    StateMetaInfoSnapshot,
    read_meta_file,
    split_instances,
)
from keyedstate.errors import (
    BackendError,
    ConfigurationError,
    CorruptCheckpointError,
    MaxParallelismMismatchError,
    StateTypeMismatchError,
)
from keyedstate.keygroups import KeyGroupRange, serialize_key_group
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle, StreamHandle
from keyedstate.storage.transfer import RestorePhases, TransferStats

RESCALE_STRATEGIES = ("ingest", "copy")
#: Default cap on the RocksDB instances of one keyed backend (``max_instances``).
DEFAULT_MAX_INSTANCES = 4
_COPY_BATCH = 10_000
_SST_CHECK_EVERY = 4096


def instance_db_dir(instance_dir: str, index: int) -> str:
    """Directory of instance ``index`` of a keyed backend (instance 0: ``db``, as before
    instances existed)."""
    return os.path.join(instance_dir, "db" if index == 0 else f"db-i{index}")


@dataclass
class RestoredInstance:
    """One opened RocksDB instance owning ``key_group_range`` (its DB holds no key outside
    it), and the restored files its next snapshot may reuse (None: upload everything)."""

    key_group_range: KeyGroupRange
    db: rocksdict.Rdict
    path: str
    base: SharedBase | None = None


@dataclass
class RestoreResult:
    """The opened instances, in key-group order, covering the target range exactly, and what
    the snapshots said about them."""

    instances: list[RestoredInstance]
    states: dict[str, StateMetaInfoSnapshot] = field(default_factory=dict)
    list_sequence: int = 0
    #: what the restore downloaded, took from the file cache, ...
    stats: TransferStats = field(default_factory=TransferStats)
    #: how long it downloaded, then opened (clips and ingests included)
    phases: RestorePhases = field(default_factory=RestorePhases)

    def close(self) -> None:
        """Close every instance (a restore that failed half way, or a backend that failed to
        start)."""
        for instance in self.instances:
            with native(f"closing the RocksDB in {instance.path}"):
                instance.db.close()


@dataclass(frozen=True, slots=True)
class InstancePlan:
    """One instance to build: the sub-handle opened as its DB (``initial``, None for an empty
    DB), the sub-handles whose keys are ingested into it, and the range it owns."""

    key_group_range: KeyGroupRange
    initial: InstanceHandle | None
    ingested: tuple[InstanceHandle, ...] = ()


def plan_instances(subs: Sequence[InstanceHandle], target: KeyGroupRange,
                   max_instances: int) -> list[InstancePlan]:
    """How to restore ``target`` from the overlapping sub-handles ``subs`` without rewriting
    keys where possible.

    Every sub-handle becomes an instance owning its overlap with ``target``. When there are
    more than ``max_instances``, the sub-handles (in key-group order) are cut into
    ``max_instances`` contiguous groups, as even as possible in key groups (the largest group
    as small as it can be, then the fewest key groups rewritten): each group is one instance,
    opened from its largest sub-handle, the others ingested into it. Even groups keep every
    instance a bounded slice of the state (the rolling compaction rewrites one instance at a
    time, docs/rocksdb-backend.md). Instance ranges are then widened over key groups no
    sub-handle covers, so that together they cover ``target`` exactly (an instance may own key
    groups it has no data for).
    """
    if max_instances < 1:
        raise ConfigurationError(f"max_instances must be at least 1, got {max_instances}")
    pieces = sorted((s for s in subs if s.key_group_range.intersection(target)),
                    key=lambda s: s.key_group_range.start)
    if not pieces:
        return [InstancePlan(target, None)]
    sizes = [len(s.key_group_range.intersection(target)) for s in pieces]
    groups = even_groups(sizes, min(max_instances, len(pieces)))
    out = []
    for n, (first, last) in enumerate(groups):
        start = target.start if n == 0 else \
            pieces[first].key_group_range.intersection(target).start
        end = target.end if n == len(groups) - 1 else \
            pieces[groups[n + 1][0]].key_group_range.intersection(target).start - 1
        members = range(first, last + 1)
        initial = max(members, key=lambda i: (sizes[i], -i))  # the largest, ties: the first
        out.append(InstancePlan(KeyGroupRange(start, end), pieces[initial],
                                tuple(pieces[i] for i in members if i != initial)))
    return out


def even_groups(sizes: Sequence[int], count: int) -> list[tuple[int, int]]:
    """``sizes`` cut into ``count`` contiguous non-empty groups ``(first, last)`` (inclusive
    indexes): the largest group's total as small as possible, then the least rewritten (the
    sum of every group's total minus its largest member). ``count <= len(sizes)``."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = (float("inf"), float("inf"))
    # best[g][i]: the cost (largest group, rewritten) of the first i sizes in g groups, and
    # where its last group starts.
    best: list[list[tuple[tuple[float, float], int]]] = [
        [(inf, -1)] * (n + 1) for _ in range(count + 1)]
    best[0][0] = ((0, 0), -1)
    for g in range(1, count + 1):
        for i in range(g, n - (count - g) + 1):
            largest = 0
            for j in range(i - 1, g - 2, -1):  # last group: sizes[j:i]
                largest = max(largest, sizes[j])
                (prev_max, prev_rewritten), _ = best[g - 1][j]
                if prev_max == float("inf"):
                    continue
                total = prefix[i] - prefix[j]
                cost = (max(prev_max, total), prev_rewritten + total - largest)
                if cost < best[g][i][0]:
                    best[g][i] = (cost, j)
    groups = []
    i = n
    for g in range(count, 0, -1):
        j = best[g][i][1]
        groups.append((j, i - 1))
        i = j
    return groups[::-1]


def key_group_bounds(key_groups: KeyGroupRange, prefix_bytes: int) -> tuple[bytes, bytes]:
    """``[lower, upper)`` keys of a key-group range in every column family."""
    return (serialize_key_group(key_groups.start, prefix_bytes),
            serialize_key_group(key_groups.end + 1, prefix_bytes))


def clip_db_with_key_group_range(db: rocksdict.Rdict, column_families: Sequence[str],
                                 target: KeyGroupRange, current: KeyGroupRange,
                                 prefix_bytes: int,
                                 write_options: rocksdict.WriteOptions | None = None) -> None:
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
    if not ranges:
        return
    with native(f"clipping the restored DB to {target}"):
        # One write batch through column-family handles, not ``get_column_family``: dropping
        # such a column-family ``Rdict`` makes rocksdict flush it (the WAL is off), ~10 ms each.
        batch = rocksdict.WriteBatch(raw_mode=True)
        for name in column_families:
            handle = db.get_column_family_handle(name)
            for begin, end in ranges:
                batch.delete_range(begin, end, handle)
        db.write(batch, write_options or rocksdict.WriteOptions())


def column_family_names(db_path: str, options: RocksDBOptions) -> list[str]:
    """Every column family of the DB at ``db_path``, RocksDB's ``default`` included (empty
    unless a state is called "default"), so clip, ingest and copy miss none."""
    with native(f"listing the column families of {db_path}"):
        return sorted(rocksdict.Rdict.list_cf(db_path, options.to_options()))


def open_db_read_only(db_path: str, options: RocksDBOptions, what: str
                      ) -> tuple[rocksdict.Rdict, list[str]]:
    """The DB at ``db_path`` opened read-only with every column family (no compaction or flush
    of files that are only read), and the names of its column families; errors name ``what``."""
    names = column_family_names(db_path, options)
    with native(what):
        db = rocksdict.Rdict(db_path, options.to_options(),
                             column_families={n: options.to_options() for n in names
                                              if n != DEFAULT_COLUMN_FAMILY},
                             access_type=rocksdict.AccessType.read_only(False))
    return db, names


class RocksDBIncrementalRestoreOperation:
    """Restores one subtask's RocksDB instances below ``instance_dir`` (instance ``k`` in
    :func:`instance_db_dir`) from the overlapping ``handles``; temporary downloads go below
    ``instance_dir`` too and are removed when done.

    Every instance of every handle is a sub-handle (:func:`split_instances`). With
    ``"ingest"``, :func:`plan_instances` makes every overlapping sub-handle an instance of its
    own, clipped by ``delete_range`` (no key rewritten), up to ``max_instances``; the others
    are ingested into a neighbour. A restore at the same parallelism reopens every instance as
    it was. ``"copy"`` builds one instance key by key (the benchmark baseline).
    """

    def __init__(self, *, handles: Sequence[KeyedStateHandle], storage: CheckpointStorage | None,
                 key_group_range: KeyGroupRange, max_parallelism: int,
                 key_group_prefix_bytes: int, instance_dir: str,
                 options: RocksDBOptions, rescale_strategy: str,
                 share_restored_files: bool, max_instances: int = DEFAULT_MAX_INSTANCES) -> None:
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
        self.instance_dir = instance_dir
        self.options = options
        self.rescale_strategy = rescale_strategy
        self.share_restored_files = share_restored_files
        self.max_instances = max_instances
        self._metas: list[MetaFile] = []
        self._meta_read: set[int] = set()  # id() of handles whose meta file was read
        self.stats = TransferStats()
        self.phases = RestorePhases()
        #: sub-handles rewritten key by key into SST files (tests check rescales avoid it)
        self.ingested: list[InstanceHandle] = []

    def restore(self) -> RestoreResult:
        started = time.perf_counter()
        result = self._restore()
        result.stats = self.stats
        self.phases.open_s = time.perf_counter() - started - self.phases.download_s
        result.phases = self.phases
        return result

    def _restore(self) -> RestoreResult:
        subs = [s for h in self.handles for s in split_instances(h)
                if s.key_group_range.intersection(self.key_group_range)]
        if not subs:
            # A fresh backend (or handles with nothing in range): empty DBs, one per key-group
            # shard (``RocksDBOptions.key_group_shards``).
            return self._restore_instances(
                [InstancePlan(r, None)
                 for r in self.key_group_range.split(self.options.key_group_shards)])
        if self.rescale_strategy == "copy" and not (
                len(subs) == 1 and subs[0].key_group_range == self.key_group_range):
            result = self._restore_by_copy(subs)
        else:
            result = self._restore_instances(
                plan_instances(subs, self.key_group_range, self.max_instances))
        self._merge_metas(result)
        return result

    def _base_of(self, sub: InstanceHandle) -> SharedBase:
        """The SSTs of ``sub``, now files of a restored instance, as its next snapshot's base:
        the job's own (referenced in place) with ``share_restored_files``, else a snapshot it
        does not own (duplicated by the next snapshot; id 0 so that any new snapshot of the
        job, whose ids start anywhere, replaces it as the base)."""
        assert self.storage is not None
        handle = sub.handle
        return SharedBase(handle.checkpoint_id if self.share_restored_files else 0,
                          self.storage.url, sub.sst_files, self.storage,
                          self.share_restored_files)

    # -- downloads -----------------------------------------------------------------------------

    def _download(self, subs: Sequence[tuple[InstanceHandle, str]]) -> None:
        """All files of each ``(sub-handle, directory)`` into that directory, in one parallel
        batch with the meta file of each handle not seen before, which is read and kept
        aside."""
        assert self.storage is not None
        started = time.perf_counter()
        metas: list[tuple[KeyedStateHandle, str]] = []
        items: list[tuple[StreamHandle, str, bool]] = []
        for sub, db_dir in subs:
            os.makedirs(db_dir, exist_ok=True)
            handle = sub.handle
            if id(handle) not in self._meta_read:
                self._meta_read.add(id(handle))
                stream = handle.private.get(META_FILE) or handle.shared.get(META_FILE)
                if stream is None:
                    raise CorruptCheckpointError(
                        f"the RocksDB snapshot of subtask {handle.subtask_index} (checkpoint "
                        f"{handle.checkpoint_id}) has no {META_FILE} file; it was not written "
                        f"by this backend. Restore from another checkpoint or savepoint"
                    )
                meta_path = os.path.join(self.instance_dir, f"{uuid.uuid4().hex}-{META_FILE}")
                items.append((stream, meta_path, False))
                metas.append((handle, meta_path))
            for name, stream in sub.files.items():
                # SST files are immutable: the cache may hand them out as hard links.
                items.append((stream, os.path.join(db_dir, name), name.endswith(SST_SUFFIX)))
        self.storage.download_all(items, stats=self.stats)
        self.phases.download_s += time.perf_counter() - started
        for handle, meta_path in metas:
            meta = read_meta_file(meta_path, f"{META_FILE} of checkpoint "
                                             f"{handle.checkpoint_id} subtask "
                                             f"{handle.subtask_index}")
            os.remove(meta_path)
            if meta.max_parallelism != self.max_parallelism:
                raise MaxParallelismMismatchError(
                    f"the snapshot of subtask {handle.subtask_index} (checkpoint "
                    f"{handle.checkpoint_id}) was taken with max parallelism "
                    f"{meta.max_parallelism}, the job restoring it has {self.max_parallelism}; "
                    f"keep the max parallelism or rewrite the state with the state processor "
                    f"API"
                )
            self._metas.append(meta)

    def _temporary_dir(self, sub: InstanceHandle) -> str:
        """Where ``sub`` is downloaded to be ingested or copied, then removed."""
        return os.path.join(self.instance_dir,
                            f"restore-{sub.handle.subtask_index}-{uuid.uuid4().hex}")

    def _open_temporary(self, path: str) -> rocksdict.Rdict:
        # Read-only: no compaction or flush of a copy that is thrown away.
        db, _ = open_db_read_only(path, self.options, f"opening the downloaded RocksDB at {path}")
        return db

    # -- the flows -----------------------------------------------------------------------------

    def _restore_instances(self, plans: Sequence[InstancePlan]) -> RestoreResult:
        """Open every planned instance from its initial sub-handle, clip it to its range, then
        ingest the merged sub-handles (only when the cap was hit); every file of every
        sub-handle downloads first, in one batch."""
        dirs = [instance_db_dir(self.instance_dir, k) for k in range(len(plans))]
        downloads = [(p.initial, d) for p, d in zip(plans, dirs) if p.initial is not None]
        temporary = {id(sub): self._temporary_dir(sub) for p in plans for sub in p.ingested}
        downloads += [(sub, temporary[id(sub)]) for p in plans for sub in p.ingested]
        result = RestoreResult([])
        try:
            if downloads:
                self._download(downloads)
            for plan, path in zip(plans, dirs):
                db = open_db(path, self.options)
                instance = RestoredInstance(plan.key_group_range, db, path)
                result.instances.append(instance)
                if plan.initial is None:
                    continue
                # Step 1. Clip the initial DB to the instance's range (nothing when the
                # sub-handle lies inside it, as at the same parallelism).
                if not plan.key_group_range.contains_range(plan.initial.key_group_range):
                    clip_db_with_key_group_range(db, column_family_names(path, self.options),
                                                 plan.key_group_range,
                                                 plan.initial.key_group_range,
                                                 self.prefix_bytes, self.options.write_options())
                # Its own files stay (clipped by range tombstones, not rewritten): the next
                # snapshot reuses them instead of uploading them again.
                instance.base = self._base_of(plan.initial)
                # Step 2. Sub-handles over the cap: their in-range keys as SST files, ingested.
                for sub in plan.ingested:
                    self._ingest_handle(db, path, sub, plan.key_group_range, temporary[id(sub)])
        except BaseException:
            result.close()
            raise
        finally:
            for tmp in temporary.values():  # each ingested one is gone already
                shutil.rmtree(tmp, ignore_errors=True)
        return result

    def _ingest_handle(self, db: rocksdict.Rdict, db_dir: str, sub: InstanceHandle,
                       key_groups: KeyGroupRange, path: str) -> None:
        """Ingest the in-range keys of ``sub``, downloaded to ``path`` (removed after)."""
        self.ingested.append(sub)
        lower, upper = key_group_bounds(sub.key_group_range.intersection(key_groups),
                                        self.prefix_bytes)
        try:
            source = self._open_temporary(path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        try:
            existing = set(column_family_names(db_dir, self.options))
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
                files.append(os.path.join(self.instance_dir, f"ingest-{uuid.uuid4().hex}.sst"))
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

    def _restore_by_copy(self, subs: Sequence[InstanceHandle]) -> RestoreResult:
        path = instance_db_dir(self.instance_dir, 0)
        temporary = [self._temporary_dir(sub) for sub in subs]
        try:
            self._download(list(zip(subs, temporary)))
        except BaseException:
            for tmp in temporary:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        db = open_db(path, self.options)
        try:
            for sub, tmp in zip(subs, temporary):
                source = self._open_temporary(tmp)
                lower, upper = key_group_bounds(
                    sub.key_group_range.intersection(self.key_group_range), self.prefix_bytes)
                try:
                    for name in column_family_names(tmp, self.options):
                        self._copy_column_family(source.get_column_family(name), db, path,
                                                 name, lower, upper)
                finally:
                    with native(f"closing the downloaded RocksDB at {tmp}"):
                        source.close()
                    del source
                    shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            with native("closing the DB of a failed restore"):
                db.close()
            for tmp in temporary:  # those not copied yet
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return RestoreResult([RestoredInstance(self.key_group_range, db, path)])

    def _copy_column_family(self, source: rocksdict.Rdict, db: rocksdict.Rdict, db_dir: str,
                            name: str, lower: bytes, upper: bytes) -> None:
        what = f"copying column family {name!r} key by key"
        key = None
        with native(what):
            if name not in column_family_names(db_dir, self.options):
                db.create_column_family(name, self.options.to_options())
            handle = db.get_column_family_handle(name)
            write_options = self.options.write_options()
            batch, count = column_family_batch(handle), 0
            for key, value in range_items(source, lower, upper):
                batch.put(key, value)
                count += 1
                if count == _COPY_BATCH:
                    db.write(batch, write_options)
                    batch, count = column_family_batch(handle), 0
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
