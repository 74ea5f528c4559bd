"""``keyedstate bench throughput``'s keyedstate systems run at a tiny size (never timed here):
``run`` fails unless each system's counts equal the generated data's, batch by batch.

Imported as ``benchmarks.throughput``, this checkout's file, not the installed
``keyedstate_benchmarks`` (an editable install points at one checkout; Spark's Python workers
import the function's module from their working directory, this checkout)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from benchmarks import throughput

pytestmark = pytest.mark.spark


def test_keyedstate_systems_run_small(spark: Any) -> None:
    systems = [throughput.KEYEDSTATE_ROCKSDB_VECTORIZED, throughput.KEYEDSTATE_HEAP_VECTORIZED,
               throughput.KEYEDSTATE_ROCKSDB_TWO_PHASE, throughput.KEYEDSTATE_HEAP_TWO_PHASE,
               throughput.KEYEDSTATE_ROCKSDB, throughput.ARROW_HANDOFF,
               throughput.TWO_PHASE_HANDOFF]
    figures = throughput.run(keys=50, events_per_batch=400, batches=2, parallelism=2,
                             systems=[throughput.BUILTIN_AGG, *systems], spark=spark)
    results = {r["system"]: r for r in figures["results"]}
    assert all(results[s]["verified"] and results[s]["batches"] == 2 for s in systems)
    assert f"{throughput.KEYEDSTATE_ROCKSDB_TWO_PHASE} >= 2x {throughput.BUILTIN_AGG}" \
        in figures["goals"]
    # Each system whose floor ran has its state overhead; the per-key heap count did not run.
    assert set(figures["state_overheads"]) == set(systems) - set(throughput.HANDOFFS)
    assert any(g.startswith(f"{throughput.KEYEDSTATE_ROCKSDB_TWO_PHASE} overhead")
               for g in figures["goals"])
    # The two-phase count's function received one row per key and batch, not every event.
    two_phase = results[throughput.KEYEDSTATE_ROCKSDB_TWO_PHASE]["keyedstate"]
    for batch in two_phase:
        assert sum(s["rows_in"] for s in batch["subtasks"]) == 400
        assert sum(s["function_rows"] for s in batch["subtasks"]) <= 50


def test_every_floor_runs_small(spark: Any) -> None:
    """The floors of the two-phase plans, side by side with the raw rows': Python is given
    every event of every batch, counted per key or not; the goal that the runtime's two-phase
    floor reaches the raw rows' is reported."""
    figures = throughput.run(keys=50, events_per_batch=400, batches=2, parallelism=2,
                             systems=list(throughput.HANDOFFS), spark=spark)
    assert [r["system"] for r in figures["results"]] == list(throughput.HANDOFFS)
    assert all(r["verified"] and r["batches"] == 2 for r in figures["results"])
    assert f"{throughput.TWO_PHASE_HANDOFF} >= 1x {throughput.ARROW_HANDOFF}" in figures["goals"]


def test_sweep_runs_a_tiny_grid_and_draws_its_figure(spark: Any, tmp_path: Any) -> None:
    from benchmarks import plot, throughput_sweep

    points = throughput_sweep.grid(events=(200, 400), keys=(20, 60), base_keys=40,
                                   base_events=400)
    assert points == [(40, 200), (40, 400), (20, 400), (60, 400)]
    systems = [throughput.BUILTIN_AGG, throughput.ARROW_HANDOFF, throughput.TWO_PHASE_HANDOFF,
               throughput.KEYEDSTATE_ROCKSDB_TWO_PHASE]
    figures = throughput_sweep.run(points=points, systems=systems, batches=2, spark=spark)
    json.dumps(figures)  # all of it is JSON
    assert figures["benchmark"] == "throughput-sweep"
    assert {"commit", "load_average"} <= set(figures["machine"])
    assert [(p["keys"], p["events_per_batch"]) for p in figures["points"]] == points
    for point in figures["points"]:
        assert [r["system"] for r in point["results"]] == systems
        assert all(r["verified"] and len(r["seconds_per_batch"]) == 2 for r in point["results"])
        ours = point["results"][-1]
        assert ours["floor"] == throughput.TWO_PHASE_HANDOFF
        assert ours["over_floor"] > 0 and ours["over_builtin"] > 0
        assert ours["phases_median_s"]["function_rows"] <= point["keys"]
    # systems run in reversed order at every other point
    assert figures["points"][1]["order"] == systems[::-1]
    assert [x for x, _ in throughput_sweep.series(figures, throughput.BUILTIN_AGG,
                                                  by="events")] == [200, 400]
    assert [x for x, _ in throughput_sweep.series(figures, throughput.BUILTIN_AGG,
                                                  by="keys")] == [20, 40, 60]
    png = plot.plot_throughput_sweep(figures, str(tmp_path))
    assert os.path.getsize(png) > 0


def test_interleaved_run_takes_turns_and_checks_every_output(spark: Any) -> None:
    """The floor, both per-key systems, the built-in aggregation and both stateless systems
    run batch by batch in turns, each keeping its query and state across rounds: every output
    is checked as in the sequential mode (the stateless ones against each batch's own
    counts), each round's times are recorded in its rotating order, the overheads are
    compared round by round, and so are the events/s against the built-in's."""
    from benchmarks import throughput_interleave

    builtin, stateless, stateless_two_phase = (throughput.BUILTIN_AGG,
                                               throughput.KEYEDSTATE_STATELESS,
                                               throughput.KEYEDSTATE_STATELESS_TWO_PHASE)
    systems = [throughput.ARROW_HANDOFF, throughput.KEYEDSTATE_ROCKSDB,
               throughput.KEYEDSTATE_HEAP, builtin, stateless, stateless_two_phase]
    ours = [throughput.KEYEDSTATE_ROCKSDB, throughput.KEYEDSTATE_HEAP, stateless,
            stateless_two_phase]
    figures = throughput.run(keys=50, events_per_batch=400, batches=3, parallelism=2,
                             systems=systems, spark=spark, interleave=True)
    json.dumps(figures)  # all of it is JSON
    assert figures["mode"] == "interleaved"
    assert {"commit", "load_average"} <= set(figures["machine"])
    results = {r["system"]: r for r in figures["results"]}
    assert all(results[s]["verified"] and results[s]["batches"] == 3 for s in systems)
    # Every keyedstate system kept one job: three checkpoints each, none restored.
    assert [len(results[s]["keyedstate"]) for s in ours] == [3, 3, 3, 3]
    assert results[builtin]["state_store"] == "rocksdb"
    # The stateless two-phase function received one row per key and batch, not every event.
    for batch in results[stateless_two_phase]["keyedstate"]:
        assert sum(s["rows_in"] for s in batch["subtasks"]) == 400
        assert sum(s["function_rows"] for s in batch["subtasks"]) <= 50
    rounds = figures["rounds"]
    assert [r["order"] for r in rounds] == [throughput_interleave.round_order(systems, r)
                                            for r in range(3)]
    assert len({r["order"][0] for r in rounds}) == 3  # none always goes first
    for r, rnd in enumerate(rounds):
        assert {s: results[s]["seconds_per_batch"][r] for s in systems} == rnd["seconds"]
    per_key = figures["round_overheads"]["per-key"]
    assert [x["round"] for x in per_key["rounds"]] == [1, 2]
    assert per_key["floor"] == throughput.ARROW_HANDOFF
    assert f"{throughput.KEYEDSTATE_ROCKSDB} overhead <= 1.2x {throughput.KEYEDSTATE_HEAP}'s, " \
        "round by round" in figures["goals"]
    assert set(figures["state_overheads"]) == set(ours[:2])  # the medians' too
    # Against the built-in, round by round: the per-key goal; the floors' checks, not goals.
    against = figures["round_ratios_to_builtin"]
    assert set(against) == {throughput.KEYEDSTATE_ROCKSDB, stateless, stateless_two_phase}
    assert [x["round"] for x in against[stateless]["rounds"]] == [1, 2]
    assert [x["builtin_s"] for x in against[stateless]["rounds"]] == \
        results[builtin]["seconds_per_batch"][1:]
    assert f"{throughput.KEYEDSTATE_ROCKSDB} >= 1x {builtin}, round by round" in figures["goals"]
    assert not any(g.startswith(f"{stateless}") for g in figures["goals"])
    checks = figures["floor_checks"]
    assert set(checks) == {stateless, stateless_two_phase}
    assert checks[stateless_two_phase]["target"] == 1.3
    assert all(c["verdict"] in ("reaches", "below", "split") for c in checks.values())


def test_interleaved_run_fails_on_an_output_that_differs(spark: Any, tmp_path: Any) -> None:
    from benchmarks import throughput_interleave

    paths, expected = throughput.write_batches(str(tmp_path / "data"), 2, 400, 50)
    wrong = [expected[0], (expected[1][0], expected[1][1] + 1, expected[1][2])]
    with pytest.raises(AssertionError, match=f"{throughput.KEYEDSTATE_HEAP}: per-batch"):
        throughput_interleave.run_rounds(
            spark, [throughput.ARROW_HANDOFF, throughput.KEYEDSTATE_HEAP], paths, wrong,
            str(tmp_path / "run"), 400, 2, baseline_batches=2)
