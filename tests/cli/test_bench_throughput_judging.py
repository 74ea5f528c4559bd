"""How ``keyedstate bench throughput`` judges its figures, on figures made up here (no Spark
runs): a hand-off's check of what Python saw, the state overheads over each path's floor,
and the interleaved mode's round order and per-round overheads (docs/benchmarks-spark.md).
The systems themselves run, small, in ``tests/spark/test_bench_throughput.py``."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import throughput


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


def test_round_order_rotates_through_every_order_of_three() -> None:
    from benchmarks import throughput_interleave

    orders = [tuple(throughput_interleave.round_order("abc", r)) for r in range(6)]
    assert len(set(orders)) == 6


def test_round_overheads_compare_each_round_with_its_own_floor() -> None:
    from benchmarks import throughput_interleave

    floor, rocksdb, heap = (throughput.ARROW_HANDOFF, throughput.KEYEDSTATE_ROCKSDB,
                            throughput.KEYEDSTATE_HEAP)
    rounds: list[dict[str, Any]] = [
        {"round": 0, "seconds": {floor: 9.0, rocksdb: 9.0, heap: 9.0}},
        # the machine slows down: every system's batch takes longer, the overheads don't
        {"round": 1, "seconds": {floor: 1.0, rocksdb: 1.55, heap: 1.5}},
        {"round": 2, "seconds": {floor: 2.0, rocksdb: 2.5, heap: 2.4}},
        {"round": 3, "seconds": {floor: 3.0, rocksdb: 3.55, heap: 3.5}}]
    per_key = throughput_interleave.round_overheads(rounds)["per-key"]
    assert [x["ratio"] for x in per_key["rounds"]] == pytest.approx([1.1, 1.25, 1.1])
    assert per_key["median_ratio"] == pytest.approx(1.1)
    assert per_key["ratio_of_medians"] == pytest.approx(0.55 / 0.5)
    assert (per_key["min_ratio"], per_key["max_ratio"]) == pytest.approx((1.1, 1.25))
    goal = throughput_interleave.round_goals({"per-key": per_key})
    assert list(goal.values())[0]["met"]
    # A round whose heap is no slower than its floor judges nothing; most such: no ratio.
    rounds[2]["seconds"][heap] = 2.0
    rounds[3]["seconds"][heap] = 2.9
    per_key = throughput_interleave.round_overheads(rounds)["per-key"]
    assert per_key["judged_rounds"] == 1 and per_key["median_ratio"] is None
    assert not list(throughput_interleave.round_goals({"per-key": per_key}).values())[0]["met"]
