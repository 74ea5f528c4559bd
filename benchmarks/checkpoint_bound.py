"""Bytes one incremental RocksDB checkpoint uploads, against the state's full size, with one
key-group shard and with several (rolling compaction): a byte count, not a timing, so it is
exact whatever the machine's load.

One subtask (max parallelism 128) holds ``keys`` keys, one ``ValueState`` each (a bigint
counter and a 16-character string). After a full base checkpoint, ``rounds`` times: update a
fresh random ``fraction`` of the keys, insert ``grow`` x ``keys`` new ones, checkpoint and
confirm. Each checkpoint's ``incremental_size`` (what it wrote) is divided by its
``full_size`` (what a full checkpoint of the same state would write).

Goal (bounded checkpoints, docs/rocksdb-backend.md): no checkpoint uploads much more than one shard
plus its change, so the largest checkpoint stays close to the median one.

    python -m keyedstate_benchmarks.checkpoint_bound --keys 1000000 --rounds 60
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from typing import Any

from keyedstate.backends.rocksdb import RocksDBOptions, RocksDBStateBackend
from keyedstate.keys import KeySerializer
from keyedstate.state.descriptors import ValueStateDescriptor
from keyedstate.storage.checkpoint_storage import CheckpointStorage

from .common import build_subtasks, user_keys, value_state, workdir

DESCRIPTOR = ValueStateDescriptor("profile", "count bigint, note string")
MAX_PARALLELISM = 128


def run_one(shards: int, keys: int, fraction: float, grow: float, rounds: int,
            seed: int = 7) -> dict[str, Any]:
    """One pipeline; per checkpoint: bytes written, full size, the compacted shard."""
    rng = random.Random(seed)
    ks = KeySerializer(["string"])
    backend = RocksDBStateBackend(RocksDBOptions(key_group_shards=shards))
    names = user_keys(keys + int(keys * grow) * rounds + 1)
    live = keys
    changed = max(1, int(keys * fraction))
    added = int(keys * grow)
    rows: list[dict[str, Any]] = []
    with workdir(f"bound-{shards}") as root:
        storage = CheckpointStorage(f"{root}/checkpoints")
        (sub,) = build_subtasks(backend, 1, MAX_PARALLELISM, ks, f"{root}/local")
        try:
            state = value_state(sub, DESCRIPTOR)

            def write(i: int, count: int) -> None:
                key = names[i]
                sub.set_current_key(key, ks.key_group(key, MAX_PARALLELISM))
                state.update({"count": count, "note": key[-4:] * 4})

            for i in range(keys):
                write(i, 0)
            for r in range(rounds + 1):
                if r:
                    for i in sorted(rng.sample(range(live), changed)):
                        write(i, r)
                    for i in range(live, live + added):
                        write(i, r)
                    live += added
                result = sub.snapshot(r + 1, storage.location(r + 1, 0), full=r == 0)
                handle = result.materialize()
                sub.notify_checkpoint_complete(r + 1)
                if r:
                    rows.append({"written": handle.incremental_size,
                                 "full_size": handle.full_size,
                                 "private": sum(h.length for h in handle.private.values()),
                                 "compacted": handle.properties.get(
                                     "rocksdb.compacted-instance")})
        finally:
            sub.close()
    ratios = sorted(row["written"] / row["full_size"] for row in rows)
    written = sorted(row["written"] for row in rows)
    median = statistics.median(written)
    return {
        "shards": shards, "keys": keys, "changed_fraction": fraction, "grow_fraction": grow,
        "rounds": rounds,
        "full_size_first_last": [rows[0]["full_size"], rows[-1]["full_size"]],
        "median_pct_of_full": 100 * statistics.median(ratios),
        "p90_pct_of_full": 100 * ratios[int(0.9 * (len(ratios) - 1))],
        "max_pct_of_full": 100 * ratios[-1],
        "max_over_median_bytes": written[-1] / median,
        "p90_over_median_bytes": written[int(0.9 * (len(written) - 1))] / median,
        "sum_written_over_last_full": sum(written) / rows[-1]["full_size"],
        "compactions": sum(1 for row in rows if row["compacted"] is not None),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--fraction", type=float, default=0.02)
    parser.add_argument("--grow", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for shards in args.shards:
        result = run_one(shards, args.keys, args.fraction, args.grow, args.rounds)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
