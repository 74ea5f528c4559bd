"""Checkpoint bytes and time, incremental vs full, for both backends.

A state of N keys (one ValueState per key: a bigint counter and a 16-character string) on
``parallelism`` subtasks, checkpointed to a local file system. After a full base checkpoint,
``rounds`` times: update a fresh random ``fraction`` of the keys, then checkpoint.

Incremental and full are measured on two pipelines that do exactly the same work (same keys,
same updates, same seed) and differ only in the snapshot kind, run one after the other: a full
checkpoint is taken of the same state as the incremental one it is compared with, and pays the
same RocksDB flush (a full checkpoint taken right after an incremental one would find the
memtables already flushed and look faster than it is).

A sequence of checkpoints, not one: RocksDB compacts the small L0 files each flush leaves, and
an incremental checkpoint then uploads the compaction's output; a single checkpoint after the
base would hide that. ``rounds`` = 10 for the heap backend (chosen when its chain was 10 diffs,
then a full snapshot; with rolling materialization every checkpoint is a diff plus images of
about as many entries, docs/heap-backend.md).

Goal (set with the keyed state core, docs/benchmarks.md): at 1% changed, an incremental checkpoint
writes at most 5% of the bytes of a full one. Judged on the whole sequence (bytes of all incremental
checkpoints over bytes of all full ones); the first and the worst checkpoint are reported too.
"""

from __future__ import annotations

import random
from typing import Any

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import StateBackend
from keyedstate.backends.rocksdb.options import RocksDBOptions
from keyedstate.keygroups import operator_index_for_key_group
from keyedstate.keys import KeySerializer
from keyedstate.state.descriptors import ValueStateDescriptor
from keyedstate.storage.checkpoint_storage import CheckpointStorage

from .common import build_subtasks, machine, timed, user_keys, value_state, workdir

DESCRIPTOR = ValueStateDescriptor("profile", "count bigint, note string")
GOAL_FRACTION = 0.01
GOAL_RATIO = 0.05


#: What each backend label of the results runs: the two backends with their defaults, and
#: RocksDB with leveled compaction (RocksDB's and Flink's default; keyedstate's before
#: 2026-11-21) for reference.
BACKENDS: dict[str, dict[str, Any]] = {
    "heap": {"name": "heap"},
    "rocksdb": {"name": "rocksdb"},
    "rocksdb-level": {"name": "rocksdb",
                      "options": {"options": RocksDBOptions(compaction_style="level")}},
}
#: Checkpoints after the base per backend label: 10 for the heap backend (its chain length
#: before rolling materialization); RocksDB long enough for its compactions to show (leveled
#: compacts every 4 flushes, universal when 8 sorted runs accumulate).
ROUNDS = {"heap": 10, "rocksdb": 30, "rocksdb-level": 30}


def _backend(label: str) -> StateBackend:
    spec = BACKENDS[label]
    return load_backend(spec["name"], **spec.get("options", {}))


def _checkpoint(subtasks: list[Any], storage: CheckpointStorage, checkpoint_id: int,
                full: bool) -> dict[str, float]:
    """Snapshot every subtask (sync part, then upload), confirm it; sums over subtasks."""
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
    return {"bytes_written": written, "full_size": total, "sync_s": sync, "async_s": async_,
            "total_s": sync + async_}


def _pipeline(backend_label: str, keys: int, fraction: float, rounds: int, incremental: bool,
              parallelism: int, max_parallelism: int, seed: int) -> dict[str, Any]:
    """Load the state, take a full base checkpoint, then ``rounds`` x (update, checkpoint)."""
    rng = random.Random(seed)  # same seed, same updates in both pipelines
    ks = KeySerializer(["string"])
    all_keys = user_keys(keys)
    groups = [ks.key_group(k, max_parallelism) for k in all_keys]
    owners = [operator_index_for_key_group(max_parallelism, parallelism, kg) for kg in groups]
    changed = max(1, int(keys * fraction))
    with workdir(f"ckpt-{backend_label}") as root:
        storage = CheckpointStorage(f"{root}/checkpoints")
        subtasks = build_subtasks(_backend(backend_label), parallelism, max_parallelism, ks,
                                  f"{root}/local")
        try:
            states = [value_state(sub, DESCRIPTOR) for sub in subtasks]
            with timed() as t_load:
                for i, key in enumerate(all_keys):
                    sub = subtasks[owners[i]]
                    sub.set_current_key(key, groups[i])
                    states[owners[i]].update({"count": 0, "note": key[-4:] * 4})
            base = _checkpoint(subtasks, storage, 1, full=True)
            per_round = []
            for r in range(1, rounds + 1):
                for i in sorted(rng.sample(range(keys), changed)):
                    key = all_keys[i]
                    subtasks[owners[i]].set_current_key(key, groups[i])
                    states[owners[i]].update({"count": r, "note": key[-4:] * 4})
                per_round.append(_checkpoint(subtasks, storage, r + 1, full=not incremental))
        finally:
            for sub in subtasks:
                sub.close()
    return {"load_s": t_load.seconds, "base": base, "rounds": per_round}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def run_one(backend_label: str, keys: int, fraction: float, rounds: int = 10,
            parallelism: int = 2, max_parallelism: int = 128, seed: int = 7) -> dict[str, Any]:
    """Both pipelines of one backend label (see :data:`BACKENDS`) and their ratios."""
    args = (backend_label, keys, fraction, rounds)
    inc = _pipeline(*args, incremental=True, parallelism=parallelism,
                    max_parallelism=max_parallelism, seed=seed)
    full = _pipeline(*args, incremental=False, parallelism=parallelism,
                     max_parallelism=max_parallelism, seed=seed)
    inc_r, full_r = inc["rounds"], full["rounds"]
    per_round_bytes = [_ratio(i["bytes_written"], f["bytes_written"])
                       for i, f in zip(inc_r, full_r)]
    per_round_time = [_ratio(i["total_s"], f["total_s"]) for i, f in zip(inc_r, full_r)]
    sum_inc_bytes = sum(r["bytes_written"] for r in inc_r)
    sum_full_bytes = sum(r["bytes_written"] for r in full_r)
    return {
        "backend": backend_label,
        "keys": keys,
        "parallelism": parallelism,
        "changed_fraction": fraction,
        "changed_keys_per_round": max(1, int(keys * fraction)),
        "rounds": rounds,
        "incremental": inc,
        "full": full,
        "mean_incremental_bytes": sum_inc_bytes / rounds,
        "mean_full_bytes": sum_full_bytes / rounds,
        "mean_incremental_s": sum(r["total_s"] for r in inc_r) / rounds,
        "mean_full_s": sum(r["total_s"] for r in full_r) / rounds,
        # the goal's figure: all incremental bytes of the sequence over all full bytes
        "incremental_over_full_bytes": _ratio(sum_inc_bytes, sum_full_bytes),
        "first_incremental_over_full_bytes": per_round_bytes[0],
        "max_incremental_over_full_bytes": max(per_round_bytes),
        "per_round_incremental_over_full_bytes": per_round_bytes,
        "incremental_over_full_time": _ratio(sum(r["total_s"] for r in inc_r),
                                             sum(r["total_s"] for r in full_r)),
        "per_round_incremental_over_full_time": per_round_time,
    }


def run(keys: int = 1_000_000, fractions: tuple[float, ...] = (0.01, 0.10),
        backends: tuple[str, ...] = ("heap", "rocksdb", "rocksdb-level"),
        rounds: int | None = None, progress: Any = None) -> dict[str, Any]:
    """Every backend label x fraction; ``rounds`` overrides :data:`ROUNDS`. The goal is judged
    on the backends with their defaults (``rocksdb-level`` is a reference)."""
    results = []
    for label in backends:
        for fraction in fractions:
            if progress:
                progress(f"checkpoint {label} {fraction:.0%} of {keys:,} keys")
            results.append(run_one(label, keys, fraction,
                                   rounds=rounds if rounds is not None else ROUNDS[label]))
    goal = [r for r in results if r["changed_fraction"] <= GOAL_FRACTION
            and r["backend"] in ("heap", "rocksdb")]
    return {
        "benchmark": "checkpoint",
        "machine": machine(),
        "goal": f"incremental bytes <= {GOAL_RATIO:.0%} of full bytes at {GOAL_FRACTION:.0%} of "
                f"keys changed (summed over consecutive checkpoints: heap 10, rocksdb 30)",
        "results": results,
        "goal_met_per_backend": {r["backend"]: r["incremental_over_full_bytes"] <= GOAL_RATIO
                                 for r in goal},
        "goal_met": bool(goal) and all(r["incremental_over_full_bytes"] <= GOAL_RATIO
                                       for r in goal),
    }


def run_long(keys: int = 1_000_000, fraction: float = 0.01, rounds: int = 200,
             backend_label: str = "rocksdb", seed: int = 7) -> dict[str, Any]:
    """One incremental pipeline over many checkpoints, long enough for RocksDB's rare large
    compactions (universal compaction's size-amplification rewrite) to happen: each
    checkpoint's bytes against the state's full size at that checkpoint (``full_size`` of
    its handles, what a full checkpoint would write)."""
    result = _pipeline(backend_label, keys, fraction, rounds, incremental=True, parallelism=2,
                       max_parallelism=128, seed=seed)
    written = [r["bytes_written"] for r in result["rounds"]]
    full = [r["full_size"] for r in result["rounds"]]
    return {
        "benchmark": "checkpoint-long",
        "machine": machine(),
        "backend": backend_label,
        "keys": keys,
        "changed_fraction": fraction,
        "rounds": rounds,
        "incremental_over_full_size": _ratio(sum(written), sum(full)),
        "per_round_incremental_over_full_size": [_ratio(w, f) for w, f in zip(written, full)],
        "full_size_first": full[0],
        "full_size_last": full[-1],
        "rounds_detail": result["rounds"],
    }


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="the long RocksDB checkpoint sequence")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--backend", default="rocksdb", choices=sorted(BACKENDS))
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args()
    text = json.dumps(run_long(rounds=args.rounds, backend_label=args.backend), indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text[:2000])
