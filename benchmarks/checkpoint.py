"""Checkpoint bytes and time, incremental vs full, for both backends.

A state of N keys (one ValueState per key, a bigint counter plus a short string payload);
between checkpoints a fraction of the keys is updated. For each backend and fraction: the bytes
and duration (sync + async) of an incremental checkpoint against a full one of the same state.
Goal (issue 2): at 1% changed, an incremental checkpoint writes at most 5% of a full one's bytes.
"""

from __future__ import annotations

import random
from typing import Any

from benchmarks.common import build_subtasks, machine, route, timed, user_keys, workdir
from keyedstate.backends import load_backend
from keyedstate.checkpoint.storage import CheckpointStorage
from keyedstate.keys import KeySerializer
from keyedstate.state.descriptors import ValueStateDescriptor

DESCRIPTOR = ValueStateDescriptor("profile", "count bigint, note string")


def _checkpoint(subtasks: list[Any], storage: CheckpointStorage, checkpoint_id: int,
                full: bool) -> dict[str, float]:
    sync = async_ = 0.0
    written = total = 0
    for sub in subtasks:
        with timed() as t_sync:
            result = sub.snapshot(checkpoint_id, storage.location(checkpoint_id, sub.subtask_index),
                                  full=full)
        with timed() as t_async:
            handle = result.materialize()
        sub.notify_checkpoint_complete(checkpoint_id)
        sync += t_sync.seconds
        async_ += t_async.seconds
        written += handle.incremental_size
        total += handle.full_size
    return {"bytes_written": written, "full_size": total, "sync_s": sync, "async_s": async_}


def run_one(backend_name: str, keys: int, fraction: float, parallelism: int = 2,
            max_parallelism: int = 128, seed: int = 7) -> dict[str, Any]:
    rng = random.Random(seed)
    ks = KeySerializer(["string"])
    all_keys = user_keys(keys)
    routed = route(all_keys, ks, parallelism, max_parallelism)
    with workdir(f"ckpt-{backend_name}") as root:
        storage = CheckpointStorage(f"{root}/checkpoints")
        subtasks = build_subtasks(load_backend(backend_name), parallelism, max_parallelism, ks,
                                  f"{root}/local")
        try:
            for sub, mine in zip(subtasks, routed):
                state = sub.get_state(DESCRIPTOR)
                for key, kg in mine:
                    sub.set_current_key(key, kg)
                    state.update({"count": 1, "note": key[-4:] * 4})
            base = _checkpoint(subtasks, storage, 1, full=True)
            changed_set = set(rng.sample(range(keys), max(1, int(keys * fraction))))
            for sub, mine in zip(subtasks, routed):
                state = sub.get_state(DESCRIPTOR)
                for key, kg in mine:
                    if int(key[5:]) in changed_set:
                        sub.set_current_key(key, kg)
                        state.update({"count": 2, "note": key[-4:] * 4})
            incremental = _checkpoint(subtasks, storage, 2, full=False)
            full = _checkpoint(subtasks, storage, 3, full=True)
        finally:
            for sub in subtasks:
                sub.close()
    return {
        "backend": backend_name,
        "keys": keys,
        "changed_fraction": fraction,
        "initial_full": base,
        "incremental": incremental,
        "full": full,
        "incremental_over_full_bytes": incremental["bytes_written"] / max(1, full["bytes_written"]),
        "incremental_over_full_time": (incremental["sync_s"] + incremental["async_s"])
        / max(1e-9, full["sync_s"] + full["async_s"]),
    }


def run(keys: int = 1_000_000, fractions: tuple[float, ...] = (0.01, 0.10),
        backends: tuple[str, ...] = ("heap", "rocksdb"), progress: Any = None) -> dict[str, Any]:
    results = []
    for backend_name in backends:
        for fraction in fractions:
            if progress:
                progress(f"checkpoint {backend_name} {fraction:.0%} of {keys:,} keys")
            results.append(run_one(backend_name, keys, fraction))
    return {
        "benchmark": "checkpoint",
        "machine": machine(),
        "goal": "incremental bytes <= 5% of full bytes at 1% of keys changed",
        "results": results,
        "goal_met": all(r["incremental_over_full_bytes"] <= 0.05
                        for r in results if r["changed_fraction"] <= 0.01),
    }
