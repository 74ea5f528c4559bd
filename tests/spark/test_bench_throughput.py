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


def test_handoff_verify_refuses_a_batch_python_did_not_fully_see() -> None:
    handoff = throughput.Handoff(parallelism=2)
    handoff.seen = {0: 400, 1: 399}
    with pytest.raises(AssertionError, match="399"):
        handoff.verify(throughput.ARROW_HANDOFF, 400, 2)


def _result(system: str, seconds: list[float]) -> dict[str, Any]:
    return {"system": system, "seconds_per_batch": seconds}


def test_state_overhead_is_the_median_over_its_own_floor() -> None:
    """Overheads subtract each path's floor from the same run (the first batch left out, as
    events/s leaves it out); RocksDB is judged against the heap's overhead, lower is better,
    and a heap no slower than its floor judges nothing."""
    results = [_result(throughput.ARROW_HANDOFF, [9.0, 1.0, 1.0, 1.0]),
               _result(throughput.TWO_PHASE_HANDOFF, [9.0, 0.8, 0.9, 0.8]),
               _result(throughput.KEYEDSTATE_ROCKSDB, [9.0, 2.0, 2.2, 2.1]),
               _result(throughput.KEYEDSTATE_HEAP, [9.0, 1.5, 1.5, 1.6]),
               _result(throughput.KEYEDSTATE_ROCKSDB_TWO_PHASE, [9.0, 1.0, 1.0, 1.0]),
               _result(throughput.KEYEDSTATE_HEAP_TWO_PHASE, [9.0, 0.7, 0.8, 0.8])]
    overheads = throughput.state_overheads(results)
    assert overheads[throughput.KEYEDSTATE_ROCKSDB]["overhead_s"] == pytest.approx(1.1)
    assert overheads[throughput.KEYEDSTATE_HEAP]["overhead_s"] == pytest.approx(0.5)
    assert overheads[throughput.KEYEDSTATE_ROCKSDB_TWO_PHASE]["floor"] == \
        throughput.TWO_PHASE_HANDOFF
    goals = throughput.overhead_goals(overheads)
    per_key = goals[f"{throughput.KEYEDSTATE_ROCKSDB} overhead <= 1.2x "
                    f"{throughput.KEYEDSTATE_HEAP}'s"]
    assert per_key["ratio"] == pytest.approx(2.2) and not per_key["met"]
    two_phase = goals[f"{throughput.KEYEDSTATE_ROCKSDB_TWO_PHASE} overhead <= 1.2x "
                      f"{throughput.KEYEDSTATE_HEAP_TWO_PHASE}'s"]
    assert two_phase["ratio"] is None and not two_phase["met"]
    assert len(goals) == 2  # the vectorized systems did not run


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
