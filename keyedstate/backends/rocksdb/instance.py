"""One RocksDB of a keyed backend: a key-group shard with its column families and its own
snapshot strategy (hence its own incremental base)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import rocksdict

from keyedstate.backends.rocksdb.native import CLOSED, native
from keyedstate.backends.rocksdb.options import RocksDBOptions
from keyedstate.backends.rocksdb.snapshot import RocksDBIncrementalSnapshotStrategy
from keyedstate.keygroups import KeyGroupRange


class StateBinding(NamedTuple):
    """What a state binds of one instance: the column family of the state and the bound
    methods its per-key calls make (``RocksDBState._bind``)."""

    instance: RocksDBInstance
    cf: rocksdict.Rdict
    handle: rocksdict.ColumnFamily | None
    get: Callable[[bytes], bytes | None]
    put: Callable[[bytes, bytes], None]
    delete: Callable[[bytes], None]


class RocksDBInstance:
    """One RocksDB of a keyed backend, owning the contiguous key-group range
    ``key_group_range`` (a key-group shard): its column families (one per state, timers
    included) and its own snapshot strategy, hence its own incremental base. Every key of
    its DB lies in its range."""

    def __init__(self, *, index: int, key_group_range: KeyGroupRange, db: rocksdict.Rdict,
                 path: str, options: RocksDBOptions, incremental: bool) -> None:
        self.index = index
        self.key_group_range = key_group_range
        self.db = db
        self.path = path
        self.options = options
        self.write_options = options.write_options()
        self.cfs: dict[str, rocksdict.Rdict] = {}
        self.handles: dict[str, rocksdict.ColumnFamily] = {}
        self.snapshot_strategy = RocksDBIncrementalSnapshotStrategy(incremental=incremental)

    def amplification(self) -> float:
        """Universal compaction's size amplification of this DB, in percent: the bytes of
        every sorted run but the oldest against the oldest's (summed over column families).

        Universal compaction keeps each sorted run of level 1 and below on a level of its
        own, older runs deeper, and a full compaction writes the deepest one; so the files
        on the deepest non-empty level are every column family's oldest run. With every run
        on level 0 (never compacted), the largest file stands for the oldest run. 0 for an
        empty DB."""
        with native(f"listing the SST files of the RocksDB in {self.path}"):
            files = [(int(f["level"]), int(f["size"])) for f in self.db.live_files()]
        if not files:
            return 0.0
        total = sum(size for _, size in files)
        deepest = max(level for level, _ in files)
        oldest = (sum(size for level, size in files if level == deepest) if deepest
                  else max(size for _, size in files))
        return 100.0 * (total - oldest) / max(oldest, 1)

    def compact(self) -> None:
        """Compact every column family into one sorted run on the deepest level (memtables
        flushed first), as universal compaction's size-amplification rewrite would."""
        with native(f"compacting the RocksDB in {self.path}"):
            for cf in self.cfs.values():
                cf.compact_range(None, None)

    def column_family(self, name: str) -> tuple[rocksdict.Rdict, rocksdict.ColumnFamily]:
        """The column family of a state, created when missing (raw rocksdict errors)."""
        cf = self.cfs.get(name)
        if cf is None:
            # A state may be called "default": it then uses RocksDB's own column family,
            # which keyedstate leaves empty otherwise.
            try:
                cf = self.db.get_column_family(name)
            except Exception:  # missing: create it
                cf = self.db.create_column_family(name, self.options.to_options())
            cf.set_write_options(self.write_options)
            self.cfs[name] = cf
            self.handles[name] = self.db.get_column_family_handle(name)
        return cf, self.handles[name]

    def drop_column_family(self, name: str) -> None:
        """Drop the column family of a state (its data goes with it)."""
        self.column_family(name)
        self.handles.pop(name)
        self.cfs.pop(name).close()
        self.db.drop_column_family(name)

    def cf(self, name: str) -> rocksdict.Rdict:
        """The open column family ``name``; a stand-in raising ``BackendError`` once closed."""
        return self.cfs.get(name, CLOSED)

    def binding(self, name: str) -> StateBinding:
        """The binding of state ``name`` to this instance (once closed: stand-ins that raise)."""
        cf = self.cf(name)
        return StateBinding(self, cf, self.handles.get(name), cf.get, cf.put, cf.delete)

    def close(self) -> None:
        """Close the DB (every state must have dropped its references first)."""
        self.cfs.clear()
        self.handles.clear()
        db, self.db = self.db, CLOSED
        try:
            with native(f"closing the RocksDB in {self.path}"):
                db.close()
        finally:
            del db


def rolling_compaction(instances: Sequence[RocksDBInstance], threshold: int) -> int | None:
    """Fully compact at most one of a keyed backend's ``instances`` (in index order), the most
    amplified, when it is due; returns its index (None: none was).

    With ``n`` instances and the trigger ``T``
    (``rolling_compaction_amplification_percent``), the most amplified instance is due
    when the ``k``-th most amplified one (k = 1 .. n) reached ``T * (n - k + 1) / n``:
    the first at ``T``, and earlier when more instances are close to ``T`` than an even
    spread would have. Instances that grew alike (random keys) are then compacted about
    ``1/n`` of the way to ``T`` apart instead of at ``T`` in consecutive snapshots, so
    every snapshot uploads about the same (``T`` alone keeps an initial lockstep: each
    shard compacted one snapshot after the other, then nothing for a long while).

    Why (docs/rocksdb-backend.md, "Rolling compaction"): universal compaction rewrites a
    whole DB once its newer sorted runs outgrow the oldest, and the next incremental
    checkpoint uploads all of it. With random keys every shard of a subtask grows alike
    and would cross the trigger at the same batch; one shard per snapshot, chosen here
    (RocksDB's own trigger is raised far above, see
    :attr:`RocksDBOptions.automatic_size_amplification_percent`), bounds what one
    checkpoint uploads to about one shard plus the change. It runs in the synchronous
    part, before the flush, so the compacted run is what this snapshot links."""
    n = len(instances)
    ranked = sorted(((inst.amplification(), inst.index) for inst in instances),
                    key=lambda x: (-x[0], x[1]))
    if not any(amplification > 0 and amplification >= threshold * (n - k) / n
               for k, (amplification, _) in enumerate(ranked)):
        return None
    best = instances[ranked[0][1]]
    best.compact()
    return best.index
