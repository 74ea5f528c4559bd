"""Backend-level rescaling: restore p subtasks' snapshots at parallelism q.

The state: N keys, one ``bigint`` ValueState per key, max parallelism 128, written by p
subtasks and snapshotted (full) to a local file system. Then, for the RocksDB backend, every
target subtask is restored from all p handles with:

- **clip + ingest** (``RocksDBStateBackend()``, the default, Flink's ``DeleteRange``
  rescaling): every overlapping instance of every handle (8 key-group shards per subtask: a
  fresh backend is sharded, docs/rocksdb-backend.md) is downloaded and
  opened as a RocksDB instance of its own (a key-group shard of the target), ``delete_range``
  clips it to the target key groups; no key is rewritten unless more than ``max_instances``
  (twice the shards, 16) overlap, when they are cut into even groups and all but the largest
  of each group are written to SST files and ingested into it (not the case here: 4 -> 2
  meets 16);
- **key-by-key copy** (``RocksDBStateBackend(rescale_strategy="copy")``, the baseline): an
  empty DB, every in-range key of every handle copied through WriteBatches (10,000 puts each,
  WAL off).

For reference: the RocksDB restore at the same parallelism p (no rescaling: download, open),
and the heap backend's restore at q and at p. Both strategies download every overlapping
handle into a fresh directory.

A restore is timed from ``create_keyed_backend`` to a backend ready for use (download, clip,
ingest or copy, open). Targets are restored one after the other on this machine: ``total`` is
the sum over target subtasks (the work), ``slowest`` the largest single target (what a
parallel restore would wait for). Each configuration runs ``repeats`` times, in alternating
order; figures are medians. Every restore is checked afterwards (untimed): all N keys and
the sum of their values.

Goals: clip + ingest at least 3x faster than key-by-key copy, 2 -> 4 and 4 -> 2 (set with the
keyed state core); a rescaling restore at most 1.5x a restore at the same parallelism (set with
savepoints and rescaling). docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

from keyedstate.backends import load_backend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.state.descriptors import ValueStateDescriptor
from keyedstate.storage.checkpoint_storage import CheckpointStorage

from .common import machine, route, timed, user_keys, value_state, workdir

DESCRIPTOR = ValueStateDescriptor("count", "bigint")
MAX_PARALLELISM = 128
GOAL_SPEEDUP = 3.0


def _write_snapshot(backend_name: str, keys: int, parallelism: int,
                    root: str) -> tuple[list[Any], int]:
    """Full snapshots of ``parallelism`` subtasks holding ``keys`` keys; the handles and the
    sum of all values (restores are checked against it)."""
    ks = KeySerializer(["string"])
    storage = CheckpointStorage(f"{root}/checkpoints")
    backend = load_backend(backend_name)
    handles, value_sum = [], 0
    for i, mine in enumerate(route(user_keys(keys), ks, parallelism, MAX_PARALLELISM)):
        sub = backend.create_keyed_backend(KeyedStateBackendParameters(
            subtask_index=i,
            key_group_range=KeyGroupRange.of_operator(MAX_PARALLELISM, parallelism, i),
            max_parallelism=MAX_PARALLELISM, key_serializer=ks, local_dir=f"{root}/local"))
        with sub:
            state = value_state(sub, DESCRIPTOR)
            for n, (key, kg) in enumerate(mine):
                sub.set_current_key(key, kg)
                state.update(n)
                value_sum += n
            handles.append(sub.snapshot(1, storage.location(1, i), full=True).materialize())
    return handles, value_sum


def _restore(backend_name: str, handles: list[Any], parallelism: int, root: str,
             **options: Any) -> dict[str, Any]:
    ks = KeySerializer(["string"])
    storage = CheckpointStorage(f"{root}/checkpoints")
    backend = load_backend(backend_name, **options)
    per_subtask, restored_keys, value_sum = [], 0, 0
    for i in range(parallelism):
        with timed() as t:
            sub = backend.create_keyed_backend(KeyedStateBackendParameters(
                subtask_index=i,
                key_group_range=KeyGroupRange.of_operator(MAX_PARALLELISM, parallelism, i),
                max_parallelism=MAX_PARALLELISM, key_serializer=ks, restore_handles=handles,
                storage=storage, local_dir=f"{root}/restore"))
        with sub:  # untimed check
            for entry in sub.iter_entries(DESCRIPTOR.name):
                restored_keys += 1
                value_sum += entry.value
        per_subtask.append(t.seconds)
    return {"total_s": sum(per_subtask), "slowest_subtask_s": max(per_subtask),
            "per_subtask_s": per_subtask, "restored_keys": restored_keys,
            "value_sum": value_sum}


def _summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "total_s": statistics.median(s["total_s"] for s in samples),
        "slowest_subtask_s": statistics.median(s["slowest_subtask_s"] for s in samples),
        "samples": samples,
    }


def _measure(configs: dict[str, Any], repeats: int, check: tuple[int, int],
             progress: Any, label: str) -> dict[str, dict[str, Any]]:
    """Run every config ``repeats`` times, order reversed on every other repeat."""
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    names = list(configs)
    for n in range(repeats):
        for name in (names if n % 2 == 0 else names[::-1]):
            if progress:
                progress(f"{label}: {name} ({n + 1}/{repeats})")
            result = configs[name]()
            if (result["restored_keys"], result["value_sum"]) != check:
                raise AssertionError(f"{label} {name} restored {result['restored_keys']} keys "
                                     f"(value sum {result['value_sum']}), expected {check}")
            samples[name].append(result)
    return {name: _summary(s) for name, s in samples.items()}


def run(keys: int = 1_000_000, pairs: tuple[tuple[int, int], ...] = ((2, 4), (4, 2)),
        repeats: int = 5, progress: Any = None) -> dict[str, Any]:
    results = []
    for old_p, new_p in pairs:
        label = f"rescale {old_p} -> {new_p}"
        with workdir("rescale") as root:
            if progress:
                progress(f"{label}: writing {keys:,} keys (rocksdb)")
            handles, value_sum = _write_snapshot("rocksdb", keys, old_p, root)
            rocks = _measure({
                "clip_ingest": partial(_restore, "rocksdb", handles, new_p, root,
                                       rescale_strategy="ingest"),
                "key_by_key_copy": partial(_restore, "rocksdb", handles, new_p, root,
                                           rescale_strategy="copy"),
                "same_parallelism": partial(_restore, "rocksdb", handles, old_p, root),
            }, repeats, (keys, value_sum), progress, f"{label} rocksdb")
        with workdir("rescale-heap") as root:
            if progress:
                progress(f"{label}: writing {keys:,} keys (heap)")
            heap_handles, heap_sum = _write_snapshot("heap", keys, old_p, root)
            heap = _measure({
                "rescaled": partial(_restore, "heap", heap_handles, new_p, root),
                "same_parallelism": partial(_restore, "heap", heap_handles, old_p, root),
            }, repeats, (keys, heap_sum), progress, f"{label} heap")
        ingest, copy = rocks["clip_ingest"], rocks["key_by_key_copy"]
        results.append({
            "from": old_p, "to": new_p, "keys": keys, "repeats": repeats,
            "snapshot_bytes": sum(h.full_size for h in handles),
            "rocksdb_clip_ingest": ingest,
            "rocksdb_key_by_key_copy": copy,
            "rocksdb_same_parallelism": rocks["same_parallelism"],
            "heap_rescaled": heap["rescaled"],
            "heap_same_parallelism": heap["same_parallelism"],
            "copy_over_ingest": copy["total_s"] / ingest["total_s"],
            "copy_over_ingest_slowest": copy["slowest_subtask_s"] / ingest["slowest_subtask_s"],
            "ingest_over_same_parallelism":
                ingest["total_s"] / rocks["same_parallelism"]["total_s"],
            "ingest_over_same_parallelism_slowest":
                ingest["slowest_subtask_s"] / rocks["same_parallelism"]["slowest_subtask_s"],
        })
    return {
        "benchmark": "backend-rescale",
        "machine": machine(),
        "goal": f"clip + ingest at least {GOAL_SPEEDUP:.0f}x faster than key-by-key copy "
                f"(median total restore time), both directions",
        "results": results,
        "goal_met": all(r["copy_over_ingest"] >= GOAL_SPEEDUP for r in results),
    }
