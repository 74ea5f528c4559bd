"""Backend-level rescaling: restore p subtasks' snapshots at parallelism q.

For the RocksDB backend, clip + ingest (seed 001: best-overlap base, ``delete_range`` clip, SST
ingest of the other handles) against the key-by-key copy baseline; the heap backend's restore
is shown for reference. Times are per target subtask, summed (sequential on this machine) and
the slowest one (what a parallel restore would wait for).
Goal (issue 2): clip + ingest at least 3x faster than key-by-key copy, 2 -> 4 and 4 -> 2.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import machine, route, timed, user_keys, workdir
from keyedstate.backends import load_backend
from keyedstate.checkpoint.storage import CheckpointStorage
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.state.descriptors import ValueStateDescriptor

DESCRIPTOR = ValueStateDescriptor("count", "bigint")
MAX_PARALLELISM = 128


def _write_snapshot(backend_name: str, keys: int, parallelism: int, root: str) -> list[Any]:
    ks = KeySerializer(["string"])
    storage = CheckpointStorage(f"{root}/checkpoints")
    backend = load_backend(backend_name)
    handles = []
    for i, mine in enumerate(route(user_keys(keys), ks, parallelism, MAX_PARALLELISM)):
        sub = backend.create_keyed_backend(
            subtask_index=i,
            key_group_range=KeyGroupRange.of_operator(MAX_PARALLELISM, parallelism, i),
            max_parallelism=MAX_PARALLELISM, key_serializer=ks, local_dir=f"{root}/local")
        with sub:
            state = sub.get_state(DESCRIPTOR)
            for n, (key, kg) in enumerate(mine):
                sub.set_current_key(key, kg)
                state.update(n)
            handles.append(sub.snapshot(1, storage.location(1, i), full=True).materialize())
    return handles


def _restore(backend_name: str, handles: list[Any], parallelism: int, root: str,
             **options: Any) -> dict[str, Any]:
    ks = KeySerializer(["string"])
    storage = CheckpointStorage(f"{root}/checkpoints")
    backend = load_backend(backend_name, **options)
    per_subtask, restored_keys = [], 0
    for i in range(parallelism):
        with timed() as t:
            sub = backend.create_keyed_backend(
                subtask_index=i,
                key_group_range=KeyGroupRange.of_operator(MAX_PARALLELISM, parallelism, i),
                max_parallelism=MAX_PARALLELISM, key_serializer=ks, restore_handles=handles,
                storage=storage, local_dir=f"{root}/restore")
        with sub:
            restored_keys += sum(1 for _ in sub.iter_entries(DESCRIPTOR.name))
        per_subtask.append(t.seconds)
    return {"total_s": sum(per_subtask), "slowest_subtask_s": max(per_subtask),
            "per_subtask_s": per_subtask, "restored_keys": restored_keys}


def run(keys: int = 1_000_000, pairs: tuple[tuple[int, int], ...] = ((2, 4), (4, 2)),
        progress: Any = None) -> dict[str, Any]:
    results = []
    for old_p, new_p in pairs:
        with workdir("rescale") as root:
            if progress:
                progress(f"rescale {old_p} -> {new_p}: writing {keys:,} keys (rocksdb)")
            handles = _write_snapshot("rocksdb", keys, old_p, root)
            if progress:
                progress(f"rescale {old_p} -> {new_p}: clip + ingest")
            ingest = _restore("rocksdb", handles, new_p, root, rescale_strategy="ingest")
            if progress:
                progress(f"rescale {old_p} -> {new_p}: key-by-key copy")
            copy = _restore("rocksdb", handles, new_p, root, rescale_strategy="copy")
            same = _restore("rocksdb", handles, old_p, root)
        with workdir("rescale-heap") as root:
            if progress:
                progress(f"rescale {old_p} -> {new_p}: heap")
            heap_handles = _write_snapshot("heap", keys, old_p, root)
            heap = _restore("heap", heap_handles, new_p, root)
        for r in (ingest, copy, same, heap):
            if r["restored_keys"] != keys:
                raise AssertionError(f"restore lost keys: {r['restored_keys']} != {keys}")
        results.append({
            "from": old_p, "to": new_p, "keys": keys,
            "rocksdb_clip_ingest": ingest, "rocksdb_key_by_key_copy": copy,
            "rocksdb_same_parallelism": same, "heap": heap,
            "copy_over_ingest": copy["total_s"] / max(1e-9, ingest["total_s"]),
        })
    return {
        "benchmark": "backend-rescale",
        "machine": machine(),
        "goal": "clip + ingest at least 3x faster than key-by-key copy, both directions",
        "results": results,
        "goal_met": all(r["copy_over_ingest"] >= 3 for r in results),
    }
