"""The throughput benchmark's interleaved mode (``run(..., interleave=True)``,
``keyedstate bench throughput --interleave``): the floors and the systems compared run batch
by batch in turns, in one Spark session, so that the machine's load drifts under all of them
alike.

Each system starts its own streaming query once (a ``processingTime`` trigger,
:data:`POLL`) over its own empty input folder and keeps it, with its job and its state, until
the last round. Round ``r`` hands each system batch ``r`` in turn: the batch's file is linked
into the system's folder and the turn waits until the system's query has run it, then the next
system's turn starts; the order rotates from round to round (:func:`round_order`) so no system
always goes first or always follows the same one. Each batch's time is Spark's
``triggerExecution``, as in the sequential mode, and every system's output is checked against
the generated data's counts at the end, as there.

Per path (:data:`~benchmarks.throughput.STATE_PATHS`) and round after the first, each
system's overhead is its batch's time minus its floor's batch of the same round; the
RocksDB/heap ratio is reported as the median of the per-round ratios and as the ratio of the
median per-round overheads, with the spread of the per-round ratios (:func:`round_overheads`).

Against Spark's built-in aggregation (``spark-builtin-agg``, run beside the others by
:data:`FLOOR_SYSTEMS`; ``keyedstate bench throughput --interleave --systems floor``), per round
after the first, each system of :data:`BUILTIN_TARGETS` gets its events/s over the built-in's
of the same round, the built-in's seconds over its own (:func:`round_ratios_to_builtin`, the
JSON's ``round_ratios_to_builtin``: per system ``reference``, ``target``, ``rounds`` (each
round's ``builtin_s``, ``system_s`` and ``ratio``), ``judged_rounds``, ``median_ratio``,
``ratio_of_medians`` (the built-in's median seconds over the system's), ``min_ratio`` and
``max_ratio``). Two goals judge them (:func:`builtin_round_goals`): "keyedstate-rocksdb >= 1x
spark-builtin-agg, round by round" and "keyedstate-rocksdb-two-phase >= 1.3x
spark-builtin-agg, round by round", met when both the median ratio and the ratio of medians
reach the target. The same targets applied to keyedstate's stateless systems
(:mod:`.throughput_stateless`: the job and its checkpoints with no state) are not goals but
``floor_checks`` (:func:`floor_checks`): per stateless system, the goal it bounds
(``goal``, ``bounds``: the systems of its path), the ``target``, its ``median_ratio`` and
``ratio_of_medians``, ``reaches_target`` (both at least the target) and ``verdict``:
``"reaches"``, ``"below"`` (both under it: no backend on that path can meet the goal, which
lies beyond the protocol's own floor) or ``"split"`` (one measure each side: the run does not
tell).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

from .throughput import (
    ARROW_HANDOFF,
    BUILTIN_AGG,
    KEYEDSTATE_HEAP,
    KEYEDSTATE_HEAP_TWO_PHASE,
    KEYEDSTATE_HEAP_VECTORIZED,
    KEYEDSTATE_ROCKSDB,
    KEYEDSTATE_ROCKSDB_TWO_PHASE,
    KEYEDSTATE_ROCKSDB_VECTORIZED,
    KEYEDSTATE_STATELESS,
    KEYEDSTATE_STATELESS_TWO_PHASE,
    PER_KEY_BUILTIN_TARGET,
    PYTHON_BASELINES,
    ROCKSDB_OVERHEAD_TARGET,
    STATE_PATHS,
    TWO_PHASE_BUILTIN_TARGET,
    TWO_PHASE_HANDOFF,
    SystemRun,
)

#: the systems the interleaved mode runs unless told otherwise: the two floors and the six
#: keyedstate systems whose state overheads the goal compares
OVERHEAD_SYSTEMS = (ARROW_HANDOFF, TWO_PHASE_HANDOFF, KEYEDSTATE_ROCKSDB, KEYEDSTATE_HEAP,
                    KEYEDSTATE_ROCKSDB_VECTORIZED, KEYEDSTATE_HEAP_VECTORIZED,
                    KEYEDSTATE_ROCKSDB_TWO_PHASE, KEYEDSTATE_HEAP_TWO_PHASE)
#: the run that judges the goals against the built-in aggregation: the systems above, the
#: built-in aggregation itself and keyedstate's two stateless systems (the protocol's floors)
FLOOR_SYSTEMS = (*OVERHEAD_SYSTEMS, BUILTIN_AGG, KEYEDSTATE_STATELESS,
                 KEYEDSTATE_STATELESS_TWO_PHASE)
#: the systems compared with the built-in aggregation round by round, and the events/s ratio
#: each must reach: the per-key and two-phase RocksDB goals, and the same targets for the
#: stateless systems on the same paths (their floor checks)
BUILTIN_TARGETS: dict[str, float] = {
    KEYEDSTATE_ROCKSDB: PER_KEY_BUILTIN_TARGET, KEYEDSTATE_STATELESS: PER_KEY_BUILTIN_TARGET,
    KEYEDSTATE_ROCKSDB_TWO_PHASE: TWO_PHASE_BUILTIN_TARGET,
    KEYEDSTATE_STATELESS_TWO_PHASE: TWO_PHASE_BUILTIN_TARGET}
#: each stateless system and the systems of its path it bounds: the same plan and protocol,
#: with a state (the goal's system first)
FLOOR_BOUNDS: dict[str, tuple[str, ...]] = {
    KEYEDSTATE_STATELESS: (KEYEDSTATE_ROCKSDB, KEYEDSTATE_HEAP),
    KEYEDSTATE_STATELESS_TWO_PHASE: (KEYEDSTATE_ROCKSDB_TWO_PHASE, KEYEDSTATE_HEAP_TWO_PHASE)}
#: the trigger of every query in this mode: a query waiting for its turn looks for a new file
#: twice a second (a directory listing, no batch), light next to a batch of the one whose turn
#: it is; the wait for a file to be picked up is not in any batch's time
POLL: dict[str, Any] = {"processingTime": "500 milliseconds"}
#: how often a turn checks whether its system's batch is done, in seconds
CHECK_S = 0.1
#: the longest a turn waits for its batch, in seconds
TURN_TIMEOUT_S = 900.0


def round_order(systems: Sequence[str], r: int) -> list[str]:
    """The order of round ``r``'s turns: ``systems`` rotated by ``r // 2``, reversed in odd
    rounds, so that every system goes first as often as the others and is followed by a
    different system from round to round (for three systems, the six orders in six rounds)."""
    k = (r // 2) % len(systems)
    rotated = [*systems[k:], *systems[:k]]
    return rotated[::-1] if r % 2 else rotated


class Turns:
    """The systems of one interleaved run, each a started :class:`SystemRun` whose query
    waits for its next file; :meth:`turn` runs one system's next batch."""

    def __init__(self, runners: Mapping[str, SystemRun]) -> None:
        self.runners = dict(runners)
        #: per system, Spark's progress of the batches it ran, oldest first
        self.progress: dict[str, list[Any]] = {s: [] for s in runners}

    def turn(self, system: str, path: str, timeout_s: float = TURN_TIMEOUT_S) -> float:
        """Hand ``system`` the batch in ``path`` and wait until its query has run it; the
        batch's seconds (``triggerExecution``). A query that stopped raises its error."""
        runner = self.runners[system]
        done = self.progress[system]
        last = done[-1].batchId if done else -1
        runner.add([path])
        deadline = time.monotonic() + timeout_s
        while True:
            fresh = [p for p in runner.query.recentProgress
                     if p.numInputRows > 0 and p.batchId > last]
            if fresh:
                done.append(fresh[0])
                return float(fresh[0].durationMs["triggerExecution"]) / 1000
            if not runner.query.isActive:
                runner.finish()  # raises the query's failure
                raise RuntimeError(f"{system}: the query stopped before its batch of {path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{system}: no batch of {path} within {timeout_s:g} s")
            time.sleep(CHECK_S)


def run_rounds(spark: Any, systems: Sequence[str], paths: Sequence[str],
               expected: Sequence[tuple[int, int, int]], root: str, events_per_batch: int,
               parallelism: int, baseline_batches: int, state_store: str = "rocksdb",
               job_options: Mapping[str, Any] | None = None,
               say: Callable[[str], None] = lambda msg: None
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run ``systems`` over ``paths`` round by round (one batch each per round; the Spark
    Python baselines only in the first ``baseline_batches`` rounds), then stop them and check
    their outputs. Returns each system's result (as the sequential mode's, in ``systems``'
    order) and the rounds: their order, each system's seconds, the load average at the start."""
    batches_of = {s: min(len(paths), baseline_batches) if s in PYTHON_BASELINES else len(paths)
                  for s in systems}
    runners: dict[str, SystemRun] = {}
    rounds: list[dict[str, Any]] = []
    try:
        for system in systems:
            runner = SystemRun(spark, system, expected[:batches_of[system]],
                               os.path.join(root, system), events_per_batch, parallelism,
                               state_store, job_options)
            runners[system] = runner
            runner.start(POLL)
        turns = Turns(runners)
        for r, path in enumerate(paths):
            order = [s for s in round_order(systems, r) if r < batches_of[s]]
            say(f"round {r + 1} of {len(paths)}: {', '.join(order)}")
            load = os.getloadavg()[0]
            started = time.perf_counter()
            seconds = {s: turns.turn(s, path) for s in order}
            rounds.append({"round": r, "order": order, "seconds": seconds,
                           "wall_s": time.perf_counter() - started,
                           "load_average_1m": round(load, 2)})
    except BaseException:
        _stop_all(runners)  # none keeps polling; the first failure is the one raised
        raise
    errors = _stop_all(runners)
    if errors:
        raise errors[0]
    return [runners[s].result(turns.progress[s]) for s in systems], rounds


def _stop_all(runners: Mapping[str, SystemRun]) -> list[Exception]:
    """Stop every runner's query; the errors of those that failed."""
    errors = []
    for runner in runners.values():
        if runner.query is None:
            continue
        try:
            runner.finish()
        except Exception as exc:  # noqa: BLE001 - the caller raises the first one
            errors.append(exc)
    return errors


def round_overheads(rounds: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per path whose RocksDB, heap and floor systems all ran, and per round after the first
    (which only creates state): each system's overhead, its batch's seconds minus its floor's
    of the same round, and RocksDB's over the heap's (None in a round where the heap's is not
    above zero: that round judges nothing). ``median_ratio`` is the median of the rounds'
    ratios (None unless more than half the rounds have one), ``ratio_of_medians`` the median
    RocksDB overhead over the median heap overhead (None unless the latter is above zero),
    ``min_ratio`` / ``max_ratio`` the spread."""
    out: dict[str, dict[str, Any]] = {}
    for path, (rocksdb, heap, floor) in STATE_PATHS.items():
        per_round = []
        for rnd in rounds[1:]:
            s = rnd["seconds"]
            if not all(x in s for x in (rocksdb, heap, floor)):
                continue
            ours, theirs = s[rocksdb] - s[floor], s[heap] - s[floor]
            per_round.append({"round": rnd["round"], "floor_s": s[floor],
                              "rocksdb_s": s[rocksdb], "heap_s": s[heap],
                              "rocksdb_overhead_s": ours, "heap_overhead_s": theirs,
                              "ratio": ours / theirs if theirs > 0 else None})
        if not per_round:
            continue
        ratios = [x["ratio"] for x in per_round if x["ratio"] is not None]
        median_heap = statistics.median(x["heap_overhead_s"] for x in per_round)
        median_rocksdb = statistics.median(x["rocksdb_overhead_s"] for x in per_round)
        out[path] = {
            "rocksdb": rocksdb, "heap": heap, "floor": floor, "rounds": per_round,
            "judged_rounds": len(ratios),
            "median_ratio": statistics.median(ratios) if 2 * len(ratios) > len(per_round)
            else None,
            "rocksdb_overhead_median_s": median_rocksdb, "heap_overhead_median_s": median_heap,
            "ratio_of_medians": median_rocksdb / median_heap if median_heap > 0 else None,
            "min_ratio": min(ratios, default=None), "max_ratio": max(ratios, default=None)}
    return out


def round_goals(overheads: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per path, RocksDB's state overhead against the heap's, round by round
    (:func:`round_overheads`): met when both the median of the per-round ratios and the
    ratio of the median overheads are at most :data:`ROCKSDB_OVERHEAD_TARGET`."""
    goals: dict[str, dict[str, Any]] = {}
    for o in overheads.values():
        median, of_medians = o["median_ratio"], o["ratio_of_medians"]
        goals[f"{o['rocksdb']} overhead <= {ROCKSDB_OVERHEAD_TARGET:g}x {o['heap']}'s, "
              f"round by round"] = {
            "ratio": median, "ratio_of_medians": of_medians,
            "min_ratio": o["min_ratio"], "max_ratio": o["max_ratio"],
            "target": ROCKSDB_OVERHEAD_TARGET,
            "met": median is not None and of_medians is not None
            and median <= ROCKSDB_OVERHEAD_TARGET and of_medians <= ROCKSDB_OVERHEAD_TARGET}
    return goals


def round_ratios_to_builtin(rounds: Sequence[Mapping[str, Any]]
                            ) -> dict[str, dict[str, Any]]:
    """Per system of :data:`BUILTIN_TARGETS` that ran beside the built-in aggregation, and
    per round after the first (which only creates state) where both ran: its events/s over
    the built-in's, which with the same events in every batch is the built-in's seconds over
    its own. ``median_ratio`` is the median of the rounds' ratios, ``ratio_of_medians`` the
    built-in's median seconds over the system's, ``min_ratio`` / ``max_ratio`` the spread;
    a system without a judged round is left out."""
    out: dict[str, dict[str, Any]] = {}
    for system, target in BUILTIN_TARGETS.items():
        per_round = [{"round": rnd["round"], "builtin_s": rnd["seconds"][BUILTIN_AGG],
                      "system_s": rnd["seconds"][system],
                      "ratio": rnd["seconds"][BUILTIN_AGG] / rnd["seconds"][system]}
                     for rnd in rounds[1:]
                     if BUILTIN_AGG in rnd["seconds"] and system in rnd["seconds"]]
        if not per_round:
            continue
        ratios = [x["ratio"] for x in per_round]
        out[system] = {
            "reference": BUILTIN_AGG, "target": target, "rounds": per_round,
            "judged_rounds": len(per_round), "median_ratio": statistics.median(ratios),
            "ratio_of_medians": statistics.median(x["builtin_s"] for x in per_round)
            / statistics.median(x["system_s"] for x in per_round),
            "min_ratio": min(ratios), "max_ratio": max(ratios)}
    return out


def builtin_goal_name(system: str) -> str:
    """The name, in ``goals``, of ``system``'s goal against the built-in, round by round."""
    return f"{system} >= {BUILTIN_TARGETS[system]:g}x {BUILTIN_AGG}, round by round"


def builtin_round_goals(ratios: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The goals against the built-in aggregation, round by round, of the systems in
    ``ratios`` (:func:`round_ratios_to_builtin`) that are not stateless: met when both the
    median of the per-round ratios and the ratio of the median seconds reach the target."""
    goals: dict[str, dict[str, Any]] = {}
    for system, r in ratios.items():
        if system in FLOOR_BOUNDS:
            continue  # a floor's check, not a goal: floor_checks
        goals[builtin_goal_name(system)] = {
            "ratio": r["median_ratio"], "ratio_of_medians": r["ratio_of_medians"],
            "min_ratio": r["min_ratio"], "max_ratio": r["max_ratio"], "target": r["target"],
            "met": r["median_ratio"] >= r["target"] and r["ratio_of_medians"] >= r["target"]}
    return goals


def floor_checks(ratios: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per stateless system in ``ratios`` (:func:`round_ratios_to_builtin`), whether the
    protocol with no state reaches the target of the goal it bounds: ``verdict`` "reaches"
    when both the median ratio and the ratio of medians are at least the target, "below"
    when both are under it (the goal lies beyond this floor: no backend on its path can meet
    it), "split" otherwise. Not goals: they do not count in ``goals_met``."""
    checks: dict[str, dict[str, Any]] = {}
    for floor, bounded in FLOOR_BOUNDS.items():
        if floor not in ratios:
            continue
        r = ratios[floor]
        at_least = [r["median_ratio"] >= r["target"], r["ratio_of_medians"] >= r["target"]]
        checks[floor] = {
            "goal": builtin_goal_name(bounded[0]), "bounds": list(bounded),
            "reference": r["reference"], "target": r["target"],
            "median_ratio": r["median_ratio"], "ratio_of_medians": r["ratio_of_medians"],
            "reaches_target": all(at_least),
            "verdict": "reaches" if all(at_least) else "below" if not any(at_least)
            else "split"}
    return checks
