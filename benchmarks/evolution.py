"""``keyedstate bench evolution``: restoring a state whose type evolved (docs/schema-evolution.md).

One subtask holds ``keys`` keys of a value state ``struct<count: bigint, total: double>``,
snapshotted in full. It is restored twice per round, side by side: *plain* with the same
descriptor, *evolved* with one field added (``last: string``, null in old values). Each restore
is timed up to the state being usable (``create_keyed_backend`` + ``get_state``: the eager
migration runs there), then three passes over every key, as the first batches after a restore
do: *read* (``value()`` of every old value: the lazy migration's cost per access), *update*
(read and write back: the lazy path rewrites each value in the new type), *read again* (the
values now new). Sides: ``heap`` (eager), ``rocksdb-lazy`` (the RocksDB default) and
``rocksdb-eager``. Medians of ``repeats`` rounds; ratios evolved / plain.

Goals: an evolved restore at most 2x a plain one for each backend's default (heap eager,
RocksDB lazy), and lazy migration at most 10% per access (the read pass).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.backends.heap.backend import HeapStateBackend
from keyedstate.backends.rocksdb.backend import RocksDBStateBackend
from keyedstate.keys import KeySerializer
from keyedstate.state.api import ValueState
from keyedstate.state.descriptors import ValueStateDescriptor
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle
from keyedstate_benchmarks.common import (
    build_subtasks,
    machine,
    timed,
    user_keys,
    value_state,
    workdir,
)

MAX_PARALLELISM = 128
OLD = "struct<count:bigint,total:double>"
NEW = "struct<count:bigint,total:double,last:string>"
PASSES = ("read", "update", "read_again")

SIDES: dict[str, Callable[[], StateBackend]] = {
    "heap": HeapStateBackend,
    "rocksdb-lazy": lambda: RocksDBStateBackend(state_migration="lazy"),
    "rocksdb-eager": lambda: RocksDBStateBackend(state_migration="eager"),
}
#: the side each backend uses by default (the goal's subject)
DEFAULTS = {"heap": "heap", "rocksdb": "rocksdb-lazy"}


def _snapshot(backend: StateBackend, keys: list[str], ks: KeySerializer, root: str
              ) -> tuple[KeyedStateHandle, CheckpointStorage]:
    storage = CheckpointStorage(f"{root}/checkpoints")
    (b,) = build_subtasks(backend, 1, MAX_PARALLELISM, ks, f"{root}/local")
    try:
        state = value_state(b, ValueStateDescriptor("acc", OLD))
        for i, key in enumerate(keys):
            b.set_current_key(key)
            state.update({"count": i, "total": i * 0.5})
        result = b.snapshot(1, storage.location(1, 0), full=True)
        handle = result.materialize()
        b.notify_checkpoint_complete(1)
        return handle, storage
    finally:
        b.close()


def _round(backend: StateBackend, type_: str, keys: list[str], ks: KeySerializer,
           handle: KeyedStateHandle, storage: CheckpointStorage, root: str) -> dict[str, float]:
    times: dict[str, float] = {}
    b: KeyedStateBackend | None = None
    try:
        with timed() as t:
            (b,) = build_subtasks(backend, 1, MAX_PARALLELISM, ks, f"{root}/local",
                                  restore=[handle], storage=storage)
            state = value_state(b, ValueStateDescriptor("acc", type_))
        times["restore"] = t.seconds
        times["read"] = _read_every_key(b, state, keys)
        with timed() as t:
            for key in keys:
                b.set_current_key(key)
                v = state.value()
                v["count"] += 1
                state.update(v)
        times["update"] = t.seconds
        times["read_again"] = _read_every_key(b, state, keys)
        return times
    finally:
        if b is not None:
            b.close()


def _read_every_key(b: KeyedStateBackend, state: ValueState[Any], keys: list[str]) -> float:
    """Seconds to read every key's value once."""
    with timed() as t:
        for key in keys:
            b.set_current_key(key)
            state.value()
    return t.seconds


def run(keys: int = 1_000_000, repeats: int = 3, progress: Any = None) -> dict[str, Any]:
    ks = KeySerializer(["string"])
    names = user_keys(keys)
    samples: dict[str, dict[str, dict[str, list[float]]]] = {
        side: {variant: {m: [] for m in ("restore", *PASSES)} for variant in ("plain", "evolved")}
        for side in SIDES}
    with workdir("evolution") as root:
        snapshots = {}
        for kind, backend_class in (("heap", HeapStateBackend),
                                    ("rocksdb", RocksDBStateBackend)):
            if progress:
                progress(f"evolution: writing {keys:,} keys ({kind})")
            snapshots[kind] = _snapshot(backend_class(), names, ks, f"{root}/{kind}")
        for n in range(repeats):
            for side, make in SIDES.items():
                handle, storage = snapshots["heap" if side == "heap" else "rocksdb"]
                for variant, type_ in (("plain", OLD), ("evolved", NEW)):
                    if progress:
                        progress(f"evolution: {side} {variant} ({n + 1}/{repeats})")
                    times = _round(make(), type_, names, ks, handle, storage, f"{root}/{side}")
                    for metric, seconds in times.items():
                        samples[side][variant][metric].append(seconds)
    median = {side: {variant: {m: statistics.median(s) for m, s in metrics.items()}
                     for variant, metrics in variants.items()}
              for side, variants in samples.items()}
    ratios = {side: {m: median[side]["evolved"][m] / median[side]["plain"][m]
                     for m in ("restore", *PASSES)} for side in SIDES}
    goal = {backend: {"restore_ratio": ratios[side]["restore"],
                      "restore_at_most_2x": ratios[side]["restore"] <= 2.0}
            for backend, side in DEFAULTS.items()}
    goal["rocksdb"]["lazy_read_ratio"] = ratios["rocksdb-lazy"]["read"]
    goal["rocksdb"]["lazy_access_at_most_1.1x"] = ratios["rocksdb-lazy"]["read"] <= 1.1
    return {
        "benchmark": "evolution",
        "machine": machine(),
        "goal": "evolved restore <= 2x plain (each backend's default migration); lazy "
                "migration <= 10% per access",
        "keys": keys,
        "repeats": repeats,
        "old_type": OLD,
        "new_type": NEW,
        "median_s": median,
        "evolved_over_plain": ratios,
        "goals": goal,
        "goal_met": all(g["restore_at_most_2x"] for g in goal.values())
        and goal["rocksdb"]["lazy_access_at_most_1.1x"],
        "samples_s": samples,
    }
