"""``keyedstate bench remote --cold-restore``: a restore on a worker without a copy, both
backends, split into its phases, with its requests counted by the latency model (a small run:
figures are checked for shape and counts, never for time)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from keyedstate.cli import main
from keyedstate.cli.bench import BENCHMARKS


@pytest.mark.s3
@pytest.mark.integration
def test_bench_remote_cold_restore_runs_small(monkeypatch):
    # This checkout's benchmarks (the installed ``keyedstate_benchmarks`` may be another's).
    monkeypatch.setitem(BENCHMARKS, "remote", "benchmarks.remote")
    result = CliRunner().invoke(main, ["bench", "remote", "--cold-restore", "--keys", "3000",
                                       "--latency", "ms=20", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.index("{"):])
    assert out["latency"]["first_byte_ms"] == 20.0 and out["machine"]["commit"] is not None
    assert [r["backend"] for r in out["cold_restore"]] == ["rocksdb", "heap"]
    for run in out["cold_restore"]:
        cold, warm = run["cold"], run["warm_cache"]
        assert run["batch_median_s"] > 0 and run["restore_over_batch_median"] > 0
        assert cold["download_s"] > 0 and cold["open_s"] > 0 and cold["files"] > 0
        assert cold["downloaded_bytes"] > 0 and warm["downloaded_bytes"] == 0
        # (equal files, e.g. RocksDB's OPTIONS of each shard, are one cache entry)
        assert warm["cache_hit_bytes"] == cold["downloaded_bytes"] + cold["cache_hit_bytes"]
        # One GET per object at most (merged segments share one), in one batch of 4 threads.
        reads = cold["requests"]["by_kind"]["read"]["requests"]
        assert reads <= cold["objects"] + 1  # + the _metadata GET
        assert 1 <= cold["data_round_trips"] <= math.ceil(cold["objects"] / run["threads"]) + 1
        assert warm["data_round_trips"] == 0


def test_cold_restore_is_refused_for_a_benchmark_without_it():
    result = CliRunner().invoke(main, ["bench", "checkpoint", "--cold-restore"])
    assert result.exit_code == 2 and "--cold-restore" in result.output
