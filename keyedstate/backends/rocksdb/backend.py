"""The RocksDB state backend: keyed state of one subtask in local RocksDB instances (via
rocksdict), incremental snapshots of their SST files, restore by reopening and clipping the old
instances on rescale.

A keyed backend holds several RocksDB instances (``RocksDBOptions.key_group_shards`` when
fresh, what the restored handles had otherwise): each instance (a key-group shard,
:class:`RocksDBInstance`) owns a disjoint contiguous sub-range of the subtask's key groups, and
keys go to the instance of their key group. rocksdict has no column-family import/export and
can't ingest a DB's own SST files, so instances are how the data of several old subtasks
enters one new subtask without passing through Python key by key; and since each instance
compacts on its own, the rolling compaction (:meth:`RocksDBKeyedStateBackend.snapshot`) keeps
any one checkpoint from uploading more than about one instance plus the change.

One column family per state, named as the state; ``_timers_event`` and ``_timers_proc`` hold
the timers. The key layout is :mod:`.key_layout`, the snapshot flow in
:mod:`.snapshot`, the restore flow in :mod:`.restore`, tuning in :mod:`.options`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

from keyedstate.backends.base.backend import StateBackend, check_restore_handles
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.base.working_dirs import worker_dir
from keyedstate.backends.rocksdb import sizes
from keyedstate.backends.rocksdb.keyed_backend import BACKEND_NAME, RocksDBKeyedStateBackend
from keyedstate.backends.rocksdb.options import RocksDBOptions
from keyedstate.backends.rocksdb.restore import (
    DEFAULT_MAX_INSTANCES,
    RESCALE_STRATEGIES,
    RocksDBIncrementalRestoreOperation,
)
from keyedstate.backends.rocksdb.value_cache import (
    DEFAULT_VALUE_CACHE_SIZE,
    parse_value_cache_size,
)
from keyedstate.errors import ConfigurationError
from keyedstate.keygroups import key_group_prefix_bytes
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle

#: How a restored state whose type evolved is migrated (``RocksDBStateBackend.state_migration``).
STATE_MIGRATIONS = ("lazy", "eager")


class RocksDBStateBackend(StateBackend):
    """Configuration of the RocksDB backend; pickles (sent to executors as is).

    ``incremental``: snapshots upload only SST files the last confirmed snapshot doesn't have
    (Flink's incremental checkpoints); False uploads every file each time.
    ``rescale_strategy``: ``"ingest"`` (each overlapping old instance reopened and clipped,
    Flink's ``DeleteRange`` rescaling) or ``"copy"`` (one instance, key by key, only the
    benchmark baseline). ``max_instances``: the most RocksDB instances
    (key-group shards) one keyed backend opens on a restore; sub-handles over the cap are
    rewritten into a neighbouring instance (SST ingestion). None (the default):
    :attr:`instance_cap`, twice ``options.key_group_shards`` (at least
    :data:`DEFAULT_MAX_INSTANCES`), so a restore at the same parallelism keeps every shard and
    scaling in by 2x rewrites none. ``state_migration``: how a
    restored state whose descriptor's type evolved is migrated (:mod:`..base.migration`):
    ``"lazy"`` (the default: values convert when read and are rewritten when written) or
    ``"eager"`` (every value rewritten when the state is first asked for).
    ``value_cache_size``: the bound, in estimated bytes, of each keyed backend's value cache
    (bytes, or a size string such as ``"32 mb"``; 0, the default, switches it off; the
    configuration key
    ``keyedstate.backend.rocksdb.value-cache-size``): a write-back cache of the value,
    reducing and aggregating states' decoded values in front of RocksDB, written out at every
    snapshot (docs/rocksdb-backend.md, "The value cache").
    """

    name = BACKEND_NAME

    def __init__(self, options: RocksDBOptions | None = None, incremental: bool = True,
                 rescale_strategy: str = "ingest",
                 max_instances: int | None = None,
                 state_migration: str = "lazy",
                 value_cache_size: int | str = DEFAULT_VALUE_CACHE_SIZE) -> None:
        if rescale_strategy not in RESCALE_STRATEGIES:
            raise ConfigurationError(f"rescale_strategy {rescale_strategy!r} is unknown; choose "
                                     f"one of {list(RESCALE_STRATEGIES)}")
        if state_migration not in STATE_MIGRATIONS:
            raise ConfigurationError(f"state_migration {state_migration!r} is unknown; choose "
                                     f"one of {list(STATE_MIGRATIONS)}")
        if max_instances is not None and (not isinstance(max_instances, int)
                                          or isinstance(max_instances, bool)
                                          or max_instances < 1):
            raise ConfigurationError(f"max_instances must be an int of at least 1 or None, "
                                     f"got {max_instances!r}")
        if isinstance(options, dict):  # from a configuration file: field -> value
            try:
                options = RocksDBOptions(**options)
            except TypeError as exc:
                raise ConfigurationError(f"RocksDB options {options!r}: {exc}") from exc
        if options is not None and not isinstance(options, RocksDBOptions):
            raise ConfigurationError(f"options must be RocksDBOptions, got {options!r}")
        self.options = options or RocksDBOptions()
        self.incremental = incremental
        self.rescale_strategy = rescale_strategy
        self.max_instances = max_instances
        self.state_migration = state_migration
        self.value_cache_size = parse_value_cache_size(value_cache_size)

    def __repr__(self) -> str:
        return (f"RocksDBStateBackend(options={self.options!r}, incremental={self.incremental}, "
                f"rescale_strategy={self.rescale_strategy!r}, "
                f"max_instances={self.max_instances}, state_migration={self.state_migration!r}, "
                f"value_cache_size={self.value_cache_size})")

    def _key(self) -> tuple[Any, ...]:
        return (self.options, self.incremental, self.rescale_strategy, self.max_instances,
                self.state_migration, self.value_cache_size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RocksDBStateBackend) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def instance_cap(self) -> int:
        """The effective ``max_instances``."""
        if self.max_instances is not None:
            return self.max_instances
        return max(DEFAULT_MAX_INSTANCES, 2 * self.options.key_group_shards)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A configuration pickled before max_instances existed gets the default.
        state.setdefault("max_instances", None)
        state.setdefault("state_migration", "lazy")
        state.setdefault("value_cache_size", DEFAULT_VALUE_CACHE_SIZE)
        self.__dict__.update(state)

    state_sizes_method = "rocksdb.total-sst-files-size of each state's column family"

    def state_sizes(self, storage: CheckpointStorage, handle: KeyedStateHandle
                    ) -> dict[str, int]:
        return sizes.state_sizes(storage, handle)

    def create_keyed_backend(self, parameters: KeyedStateBackendParameters
                             ) -> RocksDBKeyedStateBackend:
        p = parameters
        handles = check_restore_handles(BACKEND_NAME, p.key_group_range, p.max_parallelism,
                                        p.restore_handles)
        # Every instance gets a fresh directory: one directory is never opened twice. It lies
        # in this process's own directory (worker-<pid>-<start time>), so what a process that
        # dies without close() leaves is removed by the next one that starts (working_dirs).
        instance_dir = os.path.join(worker_dir(p.local_dir),
                                    f"rocksdb-{p.subtask_index}-{uuid.uuid4().hex}")
        os.makedirs(instance_dir)
        result = None
        try:
            restore = RocksDBIncrementalRestoreOperation(
                handles=handles, storage=p.storage, key_group_range=p.key_group_range,
                max_parallelism=p.max_parallelism,
                key_group_prefix_bytes=key_group_prefix_bytes(p.max_parallelism),
                instance_dir=instance_dir, options=self.options,
                rescale_strategy=self.rescale_strategy,
                share_restored_files=p.share_restored_files, max_instances=self.instance_cap)
            result = restore.restore()
            backend = RocksDBKeyedStateBackend(
                subtask_index=p.subtask_index, key_group_range=p.key_group_range,
                max_parallelism=p.max_parallelism, key_serializer=p.key_serializer,
                time_provider=p.time_provider, instances=result.instances,
                instance_dir=instance_dir, options=self.options, incremental=self.incremental,
                restored_states=result.states, list_sequence=result.list_sequence,
                state_migration=self.state_migration, value_cache_size=self.value_cache_size)
        except BaseException:
            if result is not None:  # restored, but the backend failed to start
                result.close()
            shutil.rmtree(instance_dir, ignore_errors=True)
            raise
        backend.ingested_on_restore = len(restore.ingested)
        if handles:
            backend.restore_stats = result.stats
            backend.restore_phases = result.phases
        return backend
