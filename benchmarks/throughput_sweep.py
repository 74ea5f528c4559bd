"""How the keyed count's cost grows with the work: ``keyedstate bench throughput --sweep``.

The keyed count of :mod:`.throughput` (same data generator, same systems, same checks, same
clock: Spark's ``triggerExecution`` per micro-batch, events/s from the median batch after the
first), run over a grid of batch sizes instead of one:

- **events per batch** 100 K, 500 K, 1 M, 2 M and 5 M over 100 K distinct keys (every key
  seen in nearly every batch: the work grows with the rows, the state stays);
- **distinct keys per batch** 10 K, 100 K and 1 M at 1 M events (the rows stay, the state and
  the output grow: 1 M keys at 1 M events is about 630,000 distinct keys seen per batch,
  ``1 - 1/e`` of them).

Seven points, not the 15 of the full cross product: on the 2 cores of the shared machine the
grid of two lines through the default point (100 K keys, 1 M events) answers both questions
(rows and keys) in about a quarter of the time, and a 5 M-event batch over 1 M keys would
only repeat the 1 M-key point's finding at five times its cost.

Systems (:data:`SWEEP_SYSTEMS`): Spark's built-in aggregation (the reference), the raw floor
``spark-arrow-handoff`` (the rows routed and handed to Python, no state), the floor under the
two-phase systems ``spark-two-phase-handoff``, and the fastest keyedstate system of each
backend in the single-size run (docs/benchmarks-spark.md): the two-phase counts
(``keyedstate-rocksdb-two-phase``, ``keyedstate-heap-two-phase``), whose events/s beat the
vectorized ones' there (704,722 against 644,745 for RocksDB, 878,735 against 753,580 for heap).

Every point runs every system over the same generated files, ``batches`` batches each, in one
SparkSession warmed up once; the systems' order is reversed at every other point, so a load
that drifts during the run does not always fall on the same system. Each point's data is
removed when the point is done. The result records the commit at the start and the load
average at the start and the end (``machine``), per point and system every batch's seconds
(and for keyedstate each batch's driver, sink, slowest subtask and per-subtask phases, as
:mod:`.throughput` records them), the floors, and per keyedstate system and point its ratio
to the built-in aggregation and to its floor and the median of each phase
(``phases_median_s``): what says where a curve bends.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from . import throughput as t
from .common import machine, workdir

#: the events sweep: events per batch, at :data:`BASE_KEYS` distinct keys
EVENTS_GRID = (100_000, 500_000, 1_000_000, 2_000_000, 5_000_000)
#: the keys sweep: distinct keys, at :data:`BASE_EVENTS` events per batch
KEYS_GRID = (10_000, 100_000, 1_000_000)
BASE_KEYS = 100_000
BASE_EVENTS = 1_000_000
SWEEP_SYSTEMS = (t.BUILTIN_AGG, t.ARROW_HANDOFF, t.TWO_PHASE_HANDOFF,
                 t.KEYEDSTATE_ROCKSDB_TWO_PHASE, t.KEYEDSTATE_HEAP_TWO_PHASE)
#: the floor each keyedstate system is compared with (what a batch costs with no state)
FLOOR_OF = {t.KEYEDSTATE_ROCKSDB_TWO_PHASE: t.TWO_PHASE_HANDOFF,
            t.KEYEDSTATE_HEAP_TWO_PHASE: t.TWO_PHASE_HANDOFF,
            t.KEYEDSTATE_ROCKSDB_VECTORIZED: t.ARROW_HANDOFF,
            t.KEYEDSTATE_HEAP_VECTORIZED: t.ARROW_HANDOFF,
            t.KEYEDSTATE_ROCKSDB: t.ARROW_HANDOFF, t.KEYEDSTATE_HEAP: t.ARROW_HANDOFF,
            t.KEYEDSTATE_STATELESS: t.ARROW_HANDOFF,
            t.KEYEDSTATE_STATELESS_TWO_PHASE: t.TWO_PHASE_HANDOFF}
#: the per-batch phases of a keyedstate system whose medians a point keeps
PHASES = ("trigger_s", "driver_s", "sink_s", "slowest_subtask_s", "other_s")
SUBTASK_PHASES = ("restore_s", "process_s", "sync_s", "async_s")


def grid(events: Sequence[int] = EVENTS_GRID, keys: Sequence[int] = KEYS_GRID,
         base_keys: int = BASE_KEYS, base_events: int = BASE_EVENTS) -> list[tuple[int, int]]:
    """The sweep's points ``(keys, events per batch)``: ``events`` at ``base_keys``, then
    ``keys`` at ``base_events``, the point both lines share once, in that order."""
    points: list[tuple[int, int]] = [(base_keys, e) for e in events]
    points += [(k, base_events) for k in keys if (k, base_events) not in points]
    return points


def _phases_median(result: dict[str, Any]) -> dict[str, float]:
    """The medians over the batches after the first of a keyedstate system's phases: the
    batch (Spark's clock), the driver's ``foreachBatch``, the sink, the slowest subtask and
    the rest of the driver's time; and, of the slowest subtask of each batch, its restore,
    processing (receiving the rows included) and snapshot parts."""
    batches = result.get("keyedstate", [])[1:]
    if not batches:
        return {}
    out = {p: statistics.median(b[p] for b in batches) for p in PHASES}
    slowest = [max(b["subtasks"], key=lambda s: sum(s[p] for p in SUBTASK_PHASES))
               for b in batches]
    out.update({f"slowest_subtask_{p}": statistics.median(s[p] for s in slowest)
                for p in SUBTASK_PHASES})
    out["function_rows"] = statistics.median(
        sum(s["function_rows"] for s in b["subtasks"]) for b in batches)
    return out


def summarize(point: dict[str, Any]) -> None:
    """Add to each keyedstate system of ``point`` its ratios to the built-in aggregation and
    to its floor (events/s of the median batches) and its phases' medians."""
    rate = {r["system"]: r["events_per_s"] for r in point["results"]}
    for r in point["results"]:
        if r["system"] not in t.KEYEDSTATE_SYSTEMS:
            continue
        floor = FLOOR_OF[r["system"]]
        r["floor"] = floor
        r["over_builtin"] = (r["events_per_s"] / rate[t.BUILTIN_AGG]
                             if t.BUILTIN_AGG in rate else None)
        r["over_floor"] = r["events_per_s"] / rate[floor] if floor in rate else None
        r["phases_median_s"] = _phases_median(r)


def run(points: Sequence[tuple[int, int]] | None = None, systems: Sequence[str] = SWEEP_SYSTEMS,
        batches: int = 4, parallelism: int = 2, master: str = "local[2]",
        state_store: str = "rocksdb", keys: int | None = None,
        progress: Callable[[str], None] | None = None, spark: Any = None) -> dict[str, Any]:
    """Run every system of ``systems`` at every point ``(keys, events per batch)`` of
    ``points`` (default :func:`grid`; ``keys`` given: the events sweep at that many keys
    instead of :data:`BASE_KEYS`), ``batches`` batches each (at least 2: the first creates
    the state). Fails, as :func:`.throughput.run` does, if any system's output differs from
    the generated data's."""
    from keyedstate.spark.session import local_session

    points = list(points) if points is not None else grid(
        base_keys=BASE_KEYS if keys is None else keys)
    unknown = sorted(set(systems) - set(t.SYSTEMS))
    if unknown:
        raise ValueError(f"unknown systems {unknown}; known: {list(t.SYSTEMS)}")
    if batches < 2:
        raise ValueError("run at least 2 batches per point (the first one has no state)")
    if not points or any(k < 1 or e < 1 for k, e in points):
        raise ValueError(f"points must be (keys >= 1, events >= 1) pairs, got {points}")
    say = progress or (lambda msg: None)
    own_session = spark is None
    started = time.perf_counter()
    # The code that runs is the code at the start: a long run may outlive a commit.
    commit, load_at_start = machine()["commit"], [round(x, 2) for x in os.getloadavg()]
    out_points: list[dict[str, Any]] = []
    with workdir("throughput-sweep") as root:
        if own_session:
            say(f"starting Spark ({master})")
            spark = local_session(master, "keyedstate-bench-throughput-sweep",
                                  {"spark.sql.shuffle.partitions": str(parallelism)})
        try:
            for n, (keys_, events) in enumerate(points):
                here = os.path.join(root, f"point-{n}")
                say(f"point {n + 1}/{len(points)}: generating {batches} batches of "
                    f"{events:,} events over {keys_:,} keys")
                paths, expected = t.write_batches(os.path.join(here, "data"), batches, events,
                                                  keys_)
                if n == 0:
                    say("warming up the JVM and the Python workers")
                    t._warm_up(spark, paths, os.path.join(here, "warm-up"), parallelism,
                               state_store)
                order = list(systems) if n % 2 == 0 else list(systems)[::-1]
                results = []
                for system in order:
                    say(f"point {n + 1}/{len(points)} ({events:,} events, {keys_:,} keys): "
                        f"{system}")
                    results.append(t.run_system(spark, system, paths, expected,
                                                os.path.join(here, system), events,
                                                parallelism, state_store))
                point = {"keys": keys_, "events_per_batch": events, "order": order,
                         "load_average_1m": round(os.getloadavg()[0], 2),
                         "results": sorted(results, key=lambda r: systems.index(r["system"]))}
                summarize(point)
                out_points.append(point)
                shutil.rmtree(here, ignore_errors=True)  # the 5 M-event files are large
        finally:
            if own_session:
                spark.stop()
    return {
        "benchmark": "throughput-sweep",
        "machine": {**machine(), "commit": commit, "load_average_at_start": load_at_start,
                    "master": master, "spark": t.spark_version(),
                    "shuffle_partitions": parallelism},
        "workload": {"points": [list(p) for p in points], "systems": list(systems),
                     "batches": batches, "parallelism": parallelism,
                     "spark_state_store": state_store,
                     "floors": {s: FLOOR_OF[s] for s in systems if s in FLOOR_OF},
                     "timing": "seconds_per_batch: Spark's triggerExecution of each micro-batch; "
                               "events_per_s: events_per_batch / the median of the batches "
                               "after the first"},
        "total_s": time.perf_counter() - started,
        "points": out_points,
    }


def series(result: dict[str, Any], system: str, *, by: str) -> list[tuple[int, float]]:
    """One line of the sweep's figure: ``(x, events/s)`` of ``system`` along the events sweep
    (``by="events"``: x = events per batch, the points sharing the most common key count) or
    the keys sweep (``by="keys"``: x = distinct keys, at the most common event count)."""
    points = result["points"]
    if by == "events":
        fixed = statistics.mode(p["keys"] for p in points)
        chosen = [(p["events_per_batch"], p) for p in points if p["keys"] == fixed]
    elif by == "keys":
        fixed = statistics.mode(p["events_per_batch"] for p in points)
        chosen = [(p["keys"], p) for p in points if p["events_per_batch"] == fixed]
    else:
        raise ValueError(f"by must be 'events' or 'keys', got {by!r}")
    line = []
    for x, p in sorted(chosen, key=lambda c: c[0]):
        for r in p["results"]:
            if r["system"] == system:
                line.append((x, r["events_per_s"]))
    return line


if __name__ == "__main__":
    # python -m keyedstate_benchmarks.throughput_sweep OUT.json: the full sweep.
    figures = run(progress=lambda message: print(message, file=sys.stderr, flush=True))
    with open(sys.argv[1], "w") as f:
        json.dump(figures, f, indent=2)
        f.write("\n")
