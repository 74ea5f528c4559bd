"""``keyedstate bench sinks`` runs at a tiny size and reports its figures in the documented
shape (no timings are checked: the machine is shared)."""

from __future__ import annotations

from typing import Any

import pytest

from keyedstate.cli.bench import BENCHMARKS
from keyedstate_benchmarks import sinks

pytestmark = pytest.mark.spark


def test_bench_sinks_runs_small_and_reports_each_sink_against_parquet(spark: Any) -> None:
    pytest.importorskip("deltalake")
    pytest.importorskip("pyiceberg")
    assert BENCHMARKS["sinks"] == "keyedstate_benchmarks.sinks"
    # run() fails when a sink's output is not every batch exactly once.
    figures = sinks.run(keys=40, batches=2, parallelism=2, spark=spark)
    assert figures["benchmark"] == "sinks"
    assert {"commit", "load_average", "spark", "master"} <= set(figures["machine"])
    assert figures["workload"]["events_per_batch"] == 400  # 10 per key by default
    assert [r["sink"] for r in figures["results"]] == ["parquet", "delta", "iceberg"]
    for result in figures["results"]:
        assert len(result["seconds_per_batch"]) == len(result["sink_s"]) == 2
        assert result["commits"] == 2 and result["verified"] is True
        assert {"median_s", "median_sink_s", "ratio_to_parquet", "load_average_1m"} <= set(result)
    assert set(figures["goals"]) == {"delta <= 1.2x parquet", "iceberg <= 1.2x parquet"}
    for goal in figures["goals"].values():
        assert {"ratio", "target", "met", "added_sink_s"} == set(goal)
    assert figures["goals_met"] == all(g["met"] for g in figures["goals"].values())
    with pytest.raises(ValueError, match="unknown sinks"):
        sinks.run(sinks=["kafka"], spark=spark)
