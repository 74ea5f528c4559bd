"""What RocksDB's key-group shards cost a subtask whose state is small: per batch, the
per-key processing, the snapshot and a restore, by ``RocksDBOptions.key_group_shards`` and
``max_file_opening_threads``, then with a value cache that holds the state
(``value_cache_size``), then with that cache and the RocksDB working directories
(``state.backend.local-dir``) on a memory file system, with the heap backend for reference
(docs/rocksdb-backend.md, "What a shard costs" and "The value cache").

The workload is one subtask (of 2, max parallelism 128) of the throughput benchmark's job:
``keys`` keys over the two subtasks, a ``bigint`` count per key (a ``ValueState``), every key of
the subtask read and incremented in each batch, then an incremental snapshot to a local file
system (synchronous part and materialization), then a restore from that snapshot, the first
get of its state (where a value cache is on, its warm-up: docs/rocksdb-backend.md, "After a
restore") and its close (what a batch pays when Spark places it on a Python worker without
the copy: docs/benchmarks-spark.md). With a cache, the processing hits it (the subtask's
backend lives on) and the snapshot writes the batch's values out first. Every restore is
checked, untimed: the subtask's keys, each at the batch's count.

Each configuration keeps its own backend and checkpoints; they run batch by batch in turns,
the order rotating each batch, so that the machine's load drifts under all alike. Figures are
medians over the batches after the first quarter; each configuration's ``batch_s`` (the
three parts) is also given as a ratio to the default configuration's, in the same run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.heap import HeapStateBackend
from keyedstate.backends.rocksdb import RocksDBOptions, RocksDBStateBackend
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.state.descriptors import ValueStateDescriptor
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle

from .common import machine, route, timed, user_keys, value_state, workdir

DESCRIPTOR = ValueStateDescriptor("count", "bigint")
MAX_PARALLELISM = 128
PARALLELISM = 2
#: A value cache that holds a subtask's state of the default 100,000 keys (about 285
#: estimated bytes a key).
CACHE = 64 * 1024 * 1024
#: A memory file system for the RocksDB working directories (``state.backend.local-dir``):
#: its configurations run where it exists (Linux) and are left out elsewhere.
TMPFS = "/dev/shm"
#: (key_group_shards, max_file_opening_threads, value_cache_size, working directory on
#: :data:`TMPFS`): the defaults first, then RocksDB's own default of opening threads, then
#: fewer shards, then the cache on, then the cache with the working directories in memory
CONFIGURATIONS: tuple[tuple[int, int, int, bool], ...] = (
    (RocksDBOptions().key_group_shards, RocksDBOptions().max_file_opening_threads, 0, False),
    (8, 16, 0, False), (4, 1, 0, False), (2, 1, 0, False), (1, 1, 0, False),
    (8, 1, CACHE, False), (1, 1, CACHE, False), (8, 1, CACHE, True), (1, 1, CACHE, True))


@dataclass
class _Subtask:
    """One configuration's subtask 0: its state backend (what it restores with), keyed
    backend, storage, working directory and per-batch figures; ``shards``, ``threads`` and
    ``cache`` None for the heap."""

    name: str
    shards: int | None
    threads: int | None
    cache: int | None
    tmpfs: bool
    local_dir: str
    state_backend: StateBackend
    backend: KeyedStateBackend
    storage: CheckpointStorage
    process_s: list[float]
    snapshot_s: list[float]
    restore_s: list[float]


def _name(shards: int, threads: int, cache: int, tmpfs: bool) -> str:
    return (f"{shards} shard{'s' * (shards != 1)}, "
            f"{threads} opening thread{'s' * (threads != 1)}"
            + (f", {cache >> 20} MB value cache" if cache else "")
            + (f", working directory on {TMPFS}" if tmpfs else ""))


def _parameters(storage: CheckpointStorage, local_dir: str, ks: KeySerializer,
                handles: list[KeyedStateHandle]) -> KeyedStateBackendParameters:
    return KeyedStateBackendParameters(
        subtask_index=0, key_group_range=KeyGroupRange.of_operator(MAX_PARALLELISM,
                                                                   PARALLELISM, 0),
        max_parallelism=MAX_PARALLELISM, key_serializer=ks, restore_handles=handles,
        storage=storage, local_dir=local_dir)


def _batch(sub: _Subtask, batch: int, mine: list[tuple[Any, int]], ks: KeySerializer) -> None:
    """Batch ``batch`` (from 1) of one configuration: process, snapshot, restore and check."""
    state = value_state(sub.backend, DESCRIPTOR)
    with timed() as process:
        for key, kg in mine:
            sub.backend.set_current_key(key, kg)
            state.update((state.value() or 0) + 1)
    with timed() as snapshot:
        result = sub.backend.snapshot(batch, sub.storage.location(batch, 0))
        handle = result.materialize()
        sub.backend.notify_checkpoint_complete(batch)
    with timed() as restore:
        restored = sub.state_backend.create_keyed_backend(
            _parameters(sub.storage, sub.local_dir, ks, [handle]))
        value_state(restored, DESCRIPTOR)
        restored.close()
    sub.process_s.append(process.seconds)
    sub.snapshot_s.append(snapshot.seconds)
    sub.restore_s.append(restore.seconds)
    with sub.state_backend.create_keyed_backend(
            _parameters(sub.storage, sub.local_dir, ks, [handle])) as check:  # untimed
        values = [e.value for e in check.iter_entries(DESCRIPTOR.name)]
    counts = set(values)
    if counts != {batch} or len(values) != len(mine):
        raise AssertionError(f"{sub.name}: the restore of batch {batch} holds {len(values)} keys "
                             f"with counts {sorted(counts)[:5]}, expected {len(mine)} at "
                             f"{batch}")


def _summary(sub: _Subtask, warmup: int) -> dict[str, Any]:
    parts = {"process_s": sub.process_s[warmup:], "snapshot_s": sub.snapshot_s[warmup:],
             "restore_s": sub.restore_s[warmup:]}
    batch_s = [sum(p) for p in zip(*parts.values())]
    return {"configuration": sub.name, "key_group_shards": sub.shards,
            "max_file_opening_threads": sub.threads, "value_cache_size": sub.cache,
            "local_dir_on_tmpfs": sub.tmpfs,
            **{name: statistics.median(values) for name, values in parts.items()},
            "batch_s": statistics.median(batch_s),
            "batches": {"process_s": sub.process_s, "snapshot_s": sub.snapshot_s,
                        "restore_s": sub.restore_s}}


def run(keys: int = 100_000, batches: int = 16,
        configurations: tuple[tuple[int, int, int, bool], ...] = CONFIGURATIONS,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every configuration over ``batches`` batches in turns; medians of the batches after
    the first quarter (the warm-up: the shards' first compactions). The checkpoints stay on
    the disk of the temporary directory for all."""
    warmup = batches // 4
    ks = KeySerializer(["string"])
    mine = route(user_keys(keys), ks, PARALLELISM, MAX_PARALLELISM)[0]
    if not os.path.isdir(TMPFS):
        configurations = tuple(c for c in configurations if not c[3])
    with workdir("shards") as root, tempfile.TemporaryDirectory(
            prefix="keyedstate-bench-shards-", dir=TMPFS if os.path.isdir(TMPFS) else None
            ) as memory:
        subs: list[_Subtask] = []
        try:
            rows: list[tuple[str, int | None, int | None, int | None, bool, StateBackend]] = [
                (_name(shards, threads, cache, tmpfs), shards, threads, cache, tmpfs,
                 RocksDBStateBackend(RocksDBOptions(key_group_shards=shards,
                                                    max_file_opening_threads=threads),
                                     value_cache_size=cache))
                for shards, threads, cache, tmpfs in configurations]
            rows.append(("heap, for reference", None, None, None, False, HeapStateBackend()))
            for n, (name, shards, threads, cache, tmpfs, state_backend) in enumerate(rows):
                storage = CheckpointStorage(f"{root}/checkpoints-{n}")
                local_dir = f"{memory if tmpfs else root}/local"
                subs.append(_Subtask(name, shards, threads, cache, tmpfs, local_dir,
                                     state_backend, state_backend.create_keyed_backend(
                                         _parameters(storage, local_dir, ks, [])),
                                     storage, [], [], []))
            for batch in range(1, batches + 1):
                if progress:
                    progress(f"batch {batch} of {batches}")
                turn = (batch - 1) % len(subs)
                for sub in subs[turn:] + subs[:turn]:
                    _batch(sub, batch, mine, ks)
        finally:
            for sub in subs:
                sub.backend.close()
    results = [_summary(sub, warmup) for sub in subs]
    default = results[0]["batch_s"]
    for result in results:
        result["batch_over_default"] = result["batch_s"] / default
    return {"benchmark": "shards", "machine": machine(),
            "workload": {"keys": keys, "subtask_keys": len(mine), "parallelism": PARALLELISM,
                         "max_parallelism": MAX_PARALLELISM, "batches": batches,
                         "warmup": warmup,
                         "timing": "medians of the batches after warmup; batch_s: process + "
                                   "snapshot + restore of each batch",
                         "order": "configurations batch by batch in turns, the order "
                                  "rotating each batch"},
            "results": results}
