"""Smoke test of ``keyedstate bench rescale`` (keyedstate_benchmarks.rescale) on a tiny state: the
whole pipeline runs, every restored state is verified, and the result has the shape the docs
and the figure read. No timing is asserted (benchmarks are not timed tests)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from keyedstate.cli import main
from keyedstate_benchmarks import rescale


def test_cli_passes_keys_to_the_rescale_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_run(**kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        return {"benchmark": "rescale"}

    monkeypatch.setattr(rescale, "run", fake_run)
    result = CliRunner().invoke(main, ["bench", "rescale", "--keys", "2000", "--json"])
    assert result.exit_code == 0, result.output
    assert seen["keys"] == 2000 and callable(seen["progress"])


@pytest.mark.spark
def test_tiny_rescale_benchmark_verifies_every_restore(spark: Any, tmp_path: Any) -> None:
    # 2 files of 1000 keys; a zero build budget stops Spark after the first file, so the
    # same-size comparison (keyedstate restored at Spark's 1000 keys) runs too.
    result = rescale.run(keys=2000, chunk_keys=1000, repeats=1, spark_repeats=1,
                         spark_build_budget_s=0, probes=40, spark=spark)
    json.dumps(result)  # all of it is JSON
    assert result["benchmark"] == "rescale"
    assert {"cpus", "load_average", "load_average_at_start", "spark"} <= set(result["machine"])
    assert result["workload"]["keys"] == 2000
    for matrix, keys in ((result["keyedstate"]["restores"], 2000),
                         (result["keyedstate"]["same_size_as_spark"], 1000)):
        assert set(matrix["median_s"]) == {"4->4", "4->8", "8->8", "8->3"}
        for runs in matrix["runs"].values():
            assert runs[0]["verified"] == "probe output + full state read back"
            assert all(r["seconds"] > 0 and r["keys"] == keys and r["batch"]["probe_rows"] == 40
                       for r in runs)
    spark_result = result["spark"]
    assert spark_result["build"]["keys"] == 1000 and not spark_result["build"]["complete"]
    cycle = spark_result["cycles"][0]
    assert cycle["state_after_4->8"]["partitions"] == 8
    assert cycle["state_after_8->3"]["partitions"] == 3
    assert cycle["state_after_8->3"]["keys"] == 1000
    savepoints = result["savepoints"]
    assert savepoints["state_bytes"] > 0
    assert savepoints["native_link"]["seconds"] > 0 and savepoints["canonical"]["bytes"] > 0
    assert len(result["goals"]) == 4
    assert all({"ratio", "target", "met"} <= set(g) for g in result["goals"].values())
    assert result["goals_met"] == all(g["met"] for g in result["goals"].values())
    figure = tmp_path / "rescale.png"
    rescale.plot(result, str(figure))
    assert figure.stat().st_size > 0
