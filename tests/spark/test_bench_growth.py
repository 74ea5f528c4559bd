"""``keyedstate bench growth`` runs tiny (never timed here) on both backends with checkpoints on
the local S3 server: every batch's output is checked by ``run`` (it fails otherwise), every
batch has its figures, the goals are reported, and the figure is drawn.

Imported as ``benchmarks.growth``, this checkout's file, not the installed
``keyedstate_benchmarks`` (an editable install points at one checkout; Spark's Python workers
import the function's module from their working directory, this checkout)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import growth, growth_checkpointing
from keyedstate.cli.bench import BENCHMARKS

pytestmark = [pytest.mark.spark, pytest.mark.s3]

NUMBERS = ("trigger_s", "driver_s", "sink_s", "uploaded_bytes", "incremental_bytes",
           "full_bytes")


def test_bench_growth_runs_small_on_both_backends(spark: Any, tmp_path: Any) -> None:
    assert BENCHMARKS["growth"] == "keyedstate_benchmarks.growth"
    figures = growth.run(keys=2000, small_keys=500, batches=3, warm_up_batches=0,
                         events_per_batch=400, distinct_keys=100, load_batch_keys=2000,
                         session_warm_up_batches=1, spark=spark)
    assert figures["benchmark"] == "growth"
    assert {"commit", "load_average", "master", "spark"} <= set(figures["machine"])
    assert figures["session_warm_up"]["batches"] == 2  # the small state's loading batch + 1
    assert [(r["backend"], r["keys"]) for r in figures["results"]] == [
        ("rocksdb", 500), ("rocksdb", 2000), ("heap", 500), ("heap", 2000)]
    for result in figures["results"]:
        assert result["verified"] is True and result["batches"] == 3
        assert [b["phase"] for b in result["per_batch"]] == ["load"] + ["measured"] * 3
        for batch in result["per_batch"]:
            assert batch["verified"] is True
            assert all(batch[k] > 0 for k in NUMBERS), batch
            assert batch["restored_subtasks"] + batch["reused_subtasks"] == 2
        assert len(result["seconds_per_batch"]) == 3
        assert result["median_s"] <= result["p90_s"] <= result["max_s"]
        assert 0 < result["largest_upload_fraction"] <= 1
    assert len(figures["goals"]) == 6
    for goal in figures["goals"].values():
        assert set(goal) == {"ratio", "target", "met"}
    assert figures["goals_met"] == all(g["met"] for g in figures["goals"].values())
    growth.plot(figures, str(tmp_path / "growth.png"))
    assert (tmp_path / "growth.png").stat().st_size > 0


def test_bench_growth_compares_checkpointing_modes_in_one_run(spark: Any, tmp_path: Any
                                                               ) -> None:
    """``--compare-checkpointing``, tiny: per backend the three modes at ``keys`` only, each
    batch with its output latency and CPU seconds, the comparison table and the asynchronous
    phase's goals; the local S3 server at idle priority."""
    figures = growth.run(keys=1000, small_keys=500, batches=3, warm_up_batches=0,
                         events_per_batch=400, distinct_keys=100, load_batch_keys=1000,
                         session_warm_up_batches=0, spark=spark, latency="ms=1",
                         checkpointing=growth_checkpointing.MODES, store_priority="idle")
    w = figures["workload"]
    assert w["latency"]["first_byte_ms"] == 1 and w["store_priority"] == "idle"
    assert [m["name"] for m in w["checkpointing"]] == list(growth_checkpointing.MODES)
    assert [m["async_upload"] for m in w["checkpointing"]] == [False, False, True]
    assert [(r["backend"], r["keys"], r["checkpointing"]) for r in figures["results"]] == [
        (backend, 1000, mode) for backend in ("rocksdb", "heap")
        for mode in growth_checkpointing.MODES]
    for result in figures["results"]:
        assert result["verified"] is True and result["batches"] == 3
        assert [b["phase"] for b in result["per_batch"]] == ["load"] + ["measured"] * 3
        for batch in result["per_batch"]:
            assert batch["verified"] is True and batch["output_latency_s"] > 0, batch
        behind = result["checkpointing"] != growth_checkpointing.LOCAL_DISK
        # behind the model every batch's window logged requests; on local disk none
        assert all(("driver_requests" in b) == behind for b in result["per_batch"])
        assert result["output_latency_median_s"] <= result["output_latency_p90_s"]
        # each batch's CPU seconds by process: Spark's JVM always, the store only behind it
        cpu = [b["cpu_s"] for b in result["per_batch"]]
        assert all(c is not None and c["jvm"] > 0 for c in cpu), cpu
        assert result["cpu_median_s"]["total"] > 0
        if not behind:
            # No request reaches the store from a local-disk batch (the request check above);
            # the idle server's own loop, and an earlier mode's job finishing its deletions,
            # still cost it a little CPU (0.01-0.03 s a batch seen in CI), never a request's.
            assert all(c["store"] < 0.1 for c in cpu), cpu
    rows = figures["comparison"]
    assert len(rows) == 6 and all(r["median_over_local_disk"] > 0 for r in rows)
    assert {r["median_over_local_disk"] for r in rows
            if r["checkpointing"] == growth_checkpointing.LOCAL_DISK} == {1.0}
    assert len(figures["goals"]) == 8  # four per backend
    for goal in figures["goals"].values():
        assert set(goal) == {"ratio", "target", "met"}
    assert figures["goals_met"] == all(g["met"] for g in figures["goals"].values())
    path = growth_checkpointing.plot(figures, str(tmp_path / "growth-checkpointing.png"))
    assert (tmp_path / "growth-checkpointing.png").stat().st_size > 0 and path


def test_bench_growth_repeats_each_mode_with_checkpoints_of_its_own(spark: Any) -> None:
    """``--repeats 2``, tiny: every run of a mode is a new job in its own checkpoint directory
    (the second run of a mode in the first's directory would be refused as a restart with
    an empty Spark checkpoint location), and the comparison pools the repeats."""
    modes = [growth_checkpointing.LOCAL_DISK, growth_checkpointing.LATENCY_ASYNC]
    figures = growth.run(keys=1000, small_keys=500, batches=2, warm_up_batches=0,
                         events_per_batch=400, distinct_keys=100, load_batch_keys=1000,
                         session_warm_up_batches=0, spark=spark, latency="ms=1",
                         backends=["heap"], checkpointing=modes, repeats=2)
    assert [(r["checkpointing"], r["repeat"]) for r in figures["results"]] == [
        (modes[0], 0), (modes[1], 0), (modes[1], 1), (modes[0], 1)]
    assert all(r["verified"] for r in figures["results"])
    rows = figures["comparison"]
    assert [(r["checkpointing"], r["repeats"], r["batches"]) for r in rows] == [
        (modes[0], 2, 4), (modes[1], 2, 4)]
    assert len(rows[1]["median_over_local_disk_by_repeat"]) == 2


def test_bench_growth_refuses_a_large_state_not_larger_than_the_small(spark: Any) -> None:
    with pytest.raises(ValueError, match="must be more than"):
        growth.run(keys=100_000, spark=spark)
    with pytest.raises(ValueError, match="checkpointing modes"):
        growth.run(keys=2000, small_keys=500, checkpointing=["s3-async"], spark=spark)
    with pytest.raises(ValueError, match="unknown backends"):
        growth.run(keys=2000, small_keys=500, backends=["hashmap"], spark=spark)
