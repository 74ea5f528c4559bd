"""RocksDB tuning: :class:`RocksDBOptions` and the memory every DB of a process shares.

:class:`RocksDBOptions` is a frozen dataclass (it pickles and travels to executors with the
backend config); :meth:`RocksDBOptions.to_options` adapts it to ``rocksdict.Options``. The
rocksdict call layer (opening a DB, scans, translating errors) is :mod:`.native`.

Memory is bounded per process, as Flink bounds it per slot: every keyed backend of one executor
process shares one block cache, and memtables are charged to that cache through one
``WriteBufferManager`` (see :func:`shared_resources`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import rocksdict

from keyedstate.errors import ConfigurationError

MiB = 1 << 20
KiB = 1 << 10

_COMPRESSIONS = ("none", "snappy", "lz4", "zstd")
_COMPACTION_STYLES = ("level", "universal")

#: RocksDB's own size-amplification trigger over the rolling compaction's, with several
#: key-group shards (:attr:`RocksDBOptions.automatic_size_amplification_percent`).
AUTOMATIC_AMPLIFICATION_FACTOR = 4

#: RocksDB's own column family; it always exists and keyedstate never writes to it.
DEFAULT_COLUMN_FAMILY = "default"


@dataclass(frozen=True, slots=True)
class RocksDBOptions:
    """Tuning of the RocksDB backend, with bounded-memory defaults.

    Memory one executor process can use for RocksDB is about ``block_cache_size`` (memtables
    are charged to the cache when ``charge_write_buffers_to_block_cache``), plus index and
    filter blocks, which live in the cache too (``cache_index_and_filter_blocks``).

    Flink's names for the same knobs: ``state.backend.rocksdb.block.cache-size``,
    ``...writebuffer.size``, ``...writebuffer.count``, ``...block.blocksize``,
    ``...thread.num``, ``...files.open``, ``...compaction.level.target-file-size-base``.
    """

    #: the block cache shared by every DB of the process (data, index and filter blocks).
    block_cache_size: int = 64 * MiB
    #: size of one memtable of one column family.
    write_buffer_size: int = 16 * MiB
    #: memtables per column family (one active, the others being flushed).
    max_write_buffer_number: int = 2
    #: total memtable memory of the process (every DB and column family); 0 = unbounded.
    write_buffer_manager_size: int = 32 * MiB
    #: count memtable memory against ``block_cache_size`` (Flink's managed-memory model).
    charge_write_buffers_to_block_cache: bool = True
    block_size: int = 4 * KiB
    #: bloom filter bits per key for point lookups; 0 disables the filter.
    bloom_filter_bits_per_key: int = 10
    cache_index_and_filter_blocks: bool = True
    #: partitioned index and filter blocks behind a small top-level index (Flink's
    #: ``state.backend.rocksdb.memory.partitioned-index-filters``): the cache then holds
    #: 4 KiB partitions instead of one filter block per SST, which for an SST of about
    #: 800,000 keys or more outgrows a shard of the cache and is evicted on every read (a
    #: get then took 65 µs instead of 2-3 µs; docs/benchmarks.md, access at 1 M keys).
    partitioned_index_filters: bool = True
    max_background_jobs: int = 2
    #: -1 keeps every SST open (their index blocks are in the block cache anyway).
    max_open_files: int = -1
    #: threads RocksDB starts, at every open and for each column family, to open the SST files
    #: (``max_open_files`` -1 opens them all at open). 1 opens them in the caller's thread: a
    #: key-group shard holds a handful of small files, and starting RocksDB's default 16
    #: threads per column family cost more than they saved (a restore and close of a
    #: subtask's 8 shards of 50,000 keys: 0.175 s, 0.138 s with 1; ``keyedstate bench
    #: shards``, docs/rocksdb-backend.md "What a shard costs").
    max_file_opening_threads: int = 1
    target_file_size_base: int = 64 * MiB
    compression: str = "lz4"
    #: Flink disables the WAL: a snapshot flushes memtables, and a failed task restores from
    #: the last checkpoint, never from the local files.
    disable_wal: bool = True
    #: ``"universal"`` (tiered, keyedstate's default) or ``"level"`` (RocksDB's and Flink's
    #: default); Flink's ``state.backend.rocksdb.compaction.style``. keyedstate checkpoints
    #: every micro-batch, and with random keys every leveled compaction rewrites the whole
    #: level below L0, which the next incremental checkpoint uploads again (20% of a full
    #: checkpoint per checkpoint at 1% of keys changed); universal compaction rarely rewrites
    #: old data (docs/rocksdb-backend.md and docs/benchmarks.md measure both).
    compaction_style: str = "universal"
    #: L0 files (level) or sorted runs (universal) that trigger a compaction; None: 8 for
    #: universal (reads check up to about 8 runs, each behind a bloom filter), RocksDB's 4
    #: for level.
    level0_file_num_compaction_trigger: int | None = None
    #: universal compaction: merge runs whose sizes differ by at most this percent.
    universal_size_ratio: int = 1
    #: universal compaction: rewrite everything once the newer runs hold this percent of the
    #: oldest run's size. With rolling compaction (several key-group shards) RocksDB's own
    #: trigger is raised to :attr:`automatic_size_amplification_percent`.
    universal_max_size_amplification_percent: int = 200
    #: RocksDB instances (key-group shards) a fresh keyed backend splits its key groups into,
    #: at most one per key group; 1: one instance per subtask (keyedstate's layout before).
    #: With several and universal compaction, each incremental snapshot fully compacts at
    #: most one shard ("rolling compaction"), so no checkpoint uploads more than about one
    #: shard plus its change (docs/rocksdb-backend.md, "Rolling compaction": 8 bounds a
    #: checkpoint to about 1/8 of the state, for 8 small SST files per flush instead of 1).
    key_group_shards: int = 8
    #: rolling compaction: a shard is fully compacted at a snapshot once its SST files
    #: outgrew their size after its last full compaction by this percent (the most amplified
    #: shard first, one per snapshot). Below 100 because universal compaction's size-ratio
    #: rule (``universal_size_ratio``) merges the oldest run too, so rewrites a whole DB by
    #: itself, once the newer runs add up to about its size.
    rolling_compaction_amplification_percent: int = 75

    def __post_init__(self) -> None:
        for name in ("block_cache_size", "write_buffer_size", "block_size",
                     "target_file_size_base"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"RocksDBOptions.{name} must be positive, got "
                                         f"{getattr(self, name)}")
        if self.max_write_buffer_number < 1:
            raise ConfigurationError("RocksDBOptions.max_write_buffer_number must be >= 1")
        if self.write_buffer_manager_size < 0 or self.bloom_filter_bits_per_key < 0:
            raise ConfigurationError(
                "RocksDBOptions.write_buffer_manager_size and bloom_filter_bits_per_key must be "
                ">= 0 (0 disables them)"
            )
        if self.max_background_jobs < 1 or self.max_file_opening_threads < 1:
            raise ConfigurationError("RocksDBOptions.max_background_jobs and "
                                     "max_file_opening_threads must be >= 1")
        if self.compaction_style not in _COMPACTION_STYLES:
            raise ConfigurationError(
                f"RocksDBOptions.compaction_style {self.compaction_style!r} is unknown; choose "
                f"one of {list(_COMPACTION_STYLES)}"
            )
        trigger = self.level0_file_num_compaction_trigger
        if (trigger is not None and trigger < 1) or self.universal_size_ratio < 0 \
                or self.universal_max_size_amplification_percent < 1 \
                or self.rolling_compaction_amplification_percent < 1:
            raise ConfigurationError(
                "RocksDBOptions.level0_file_num_compaction_trigger, "
                "universal_max_size_amplification_percent and "
                "rolling_compaction_amplification_percent must be >= 1, universal_size_ratio "
                ">= 0"
            )
        if not isinstance(self.key_group_shards, int) or isinstance(self.key_group_shards, bool) \
                or self.key_group_shards < 1:
            raise ConfigurationError(f"RocksDBOptions.key_group_shards must be an int of at "
                                     f"least 1, got {self.key_group_shards!r}")
        if self.compression not in _COMPRESSIONS:
            raise ConfigurationError(
                f"RocksDBOptions.compression {self.compression!r} is unknown; choose one of "
                f"{list(_COMPRESSIONS)}"
            )

    @property
    def compaction_trigger(self) -> int:
        """The effective ``level0_file_num_compaction_trigger``."""
        if self.level0_file_num_compaction_trigger is not None:
            return self.level0_file_num_compaction_trigger
        return 8 if self.compaction_style == "universal" else 4

    @property
    def rolling_compaction(self) -> bool:
        """Whether snapshots compact one shard at a time (several shards, universal style)."""
        return self.key_group_shards > 1 and self.compaction_style == "universal"

    @property
    def automatic_size_amplification_percent(self) -> int:
        """RocksDB's own size-amplification trigger: the configured one, or with rolling
        compaction :data:`AUTOMATIC_AMPLIFICATION_FACTOR` times it, a safety net that fires
        only if the rolling compaction falls behind (with random keys every shard crosses
        the configured trigger at about the same batch; RocksDB would rewrite them all in
        that batch's checkpoint)."""
        percent = self.universal_max_size_amplification_percent
        return percent * AUTOMATIC_AMPLIFICATION_FACTOR if self.rolling_compaction else percent

    def to_options(self) -> rocksdict.Options:
        """``rocksdict.Options`` in raw mode (bytes keys and values, no pickling) for the DB and
        for each of its column families, using the process's shared cache and buffer manager."""
        cache, manager = shared_resources(self)
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(cache)
        table.set_block_size(self.block_size)
        if self.bloom_filter_bits_per_key:
            table.set_bloom_filter(self.bloom_filter_bits_per_key, False)
        table.set_cache_index_and_filter_blocks(self.cache_index_and_filter_blocks)
        if self.partitioned_index_filters:
            table.set_index_type(rocksdict.BlockBasedIndexType.two_level_index_search())
            table.set_partition_filters(True)
            # The top level is small and read on every lookup: keep it in the cache.
            table.set_pin_top_level_index_and_filter(True)
        # Keep L0 index/filter blocks pinned: they are read on every lookup.
        table.set_pin_l0_filter_and_index_blocks_in_cache(self.cache_index_and_filter_blocks)
        opts.set_block_based_table_factory(table)
        if manager is not None:
            opts.set_write_buffer_manager(manager)
        opts.set_write_buffer_size(self.write_buffer_size)
        opts.set_max_write_buffer_number(self.max_write_buffer_number)
        opts.set_max_background_jobs(self.max_background_jobs)
        opts.set_max_open_files(self.max_open_files)
        opts.set_max_file_opening_threads(self.max_file_opening_threads)
        opts.set_target_file_size_base(self.target_file_size_base)
        opts.set_compression_type(getattr(rocksdict.DBCompressionType, self.compression)())
        # Keep RocksDB's info LOG small: it is a private file of every snapshot otherwise.
        opts.set_keep_log_file_num(1)
        trigger = self.compaction_trigger
        if self.compaction_style == "universal":
            opts.set_compaction_style(rocksdict.DBCompactionStyle.universal())
            universal = rocksdict.UniversalCompactOptions()
            universal.size_ratio = self.universal_size_ratio
            universal.max_size_amplification_percent = \
                self.automatic_size_amplification_percent
            opts.set_universal_compaction_options(universal)
        if self.compaction_style == "universal" or trigger != 4:
            # RocksDB's stall thresholds (20, 36) must stay above the trigger.
            opts.set_level_zero_file_num_compaction_trigger(trigger)
            opts.set_level_zero_slowdown_writes_trigger(max(20, trigger * 5 // 2))
            opts.set_level_zero_stop_writes_trigger(max(36, trigger * 9 // 2))
        return opts

    def write_options(self) -> rocksdict.WriteOptions:
        """rocksdict write options of these settings (the WAL as ``disable_wal`` says)."""
        opts = rocksdict.WriteOptions()
        # A property at runtime, though rocksdict's stub declares a method.
        setattr(opts, "disable_wal", self.disable_wal)  # noqa: B010
        return opts


# --------------------------------------------------------------------------------------------
# process-wide shared memory
# --------------------------------------------------------------------------------------------

_SharedKey = tuple[int, int, bool]
_shared: dict[_SharedKey, tuple[rocksdict.Cache, rocksdict.WriteBufferManager | None]] = {}
_shared_lock = threading.Lock()


def shared_resources(
    options: RocksDBOptions,
) -> tuple[rocksdict.Cache, rocksdict.WriteBufferManager | None]:
    """The block cache and write buffer manager every DB of this process with the same memory
    settings shares, so memory stays bounded however many subtasks an executor runs."""
    key = (options.block_cache_size, options.write_buffer_manager_size,
           options.charge_write_buffers_to_block_cache)
    with _shared_lock:
        found = _shared.get(key)
        if found is None:
            cache = rocksdict.Cache(options.block_cache_size)
            manager: rocksdict.WriteBufferManager | None = None
            if options.write_buffer_manager_size:
                if options.charge_write_buffers_to_block_cache:
                    manager = rocksdict.WriteBufferManager.new_write_buffer_manager_with_cache(
                        options.write_buffer_manager_size, False, cache)
                else:
                    manager = rocksdict.WriteBufferManager(
                        options.write_buffer_manager_size, False)
            found = _shared[key] = (cache, manager)
        return found
