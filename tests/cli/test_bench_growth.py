"""``keyedstate bench growth``'s generated batches and its output check (no Spark): the loading
batches hold every key once, each later batch its exact number of distinct keys, and a job's
output with a key missing, doubled or miscounted is refused; the command's
``--compare-checkpointing`` and its repeats."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import benchmarks
from benchmarks import growth, growth_checkpointing, growth_workload
from keyedstate.cli import main


def test_compare_checkpointing_runs_the_three_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "keyedstate_benchmarks", benchmarks)
    monkeypatch.setitem(sys.modules, "keyedstate_benchmarks.growth", growth)
    seen: dict[str, Any] = {}

    def fake_run(keys: int = 0, latency: Any = None, checkpointing: Any = (),
                 progress: Any = None) -> dict[str, Any]:
        seen.update(keys=keys, latency=latency, checkpointing=checkpointing)
        return {"benchmark": "growth"}

    monkeypatch.setattr(growth, "run", fake_run)
    result = CliRunner().invoke(main, ["bench", "growth", "--compare-checkpointing",
                                       "--keys", "100000", "--json"])
    assert result.exit_code == 0, result.output
    assert seen == {"keys": 100_000, "latency": None,
                    "checkpointing": growth_checkpointing.MODES}
    # a comparison with local disk needs a model to compare with
    refused = CliRunner().invoke(main, ["bench", "growth", "--compare-checkpointing",
                                        "--latency", "none"])
    assert refused.exit_code == 2 and "not none" in refused.output
    # ... and only growth has one
    other = CliRunner().invoke(main, ["bench", "checkpoint", "--compare-checkpointing"])
    assert other.exit_code == 2 and "only growth" in other.output


def _output(batch: growth_workload.Batch) -> pa.Table:
    """The output a right job emits for ``batch``: one row per key with its count so far."""
    names = growth_workload.key_names(int(batch.keys.max()) + 1)
    return pa.table({"user_id": names.take(pa.array(batch.keys)),
                     "count": pa.array(batch.counts, pa.int64())})


def test_workload_loads_every_key_once_then_draws_distinct_keys(tmp_path):
    batches = growth_workload.write_workload(str(tmp_path), keys=1000, load_batch_keys=400,
                                    warm_up_batches=1, batches=3, events_per_batch=300,
                                    distinct_keys=100)
    assert [b.phase for b in batches] == ["load"] * 3 + ["warm-up"] + ["measured"] * 3
    loaded = np.concatenate([b.keys for b in batches[:3]])
    assert sorted(loaded.tolist()) == list(range(1000))
    assert all((b.counts == 1).all() for b in batches[:3])
    counts = np.ones(1000, dtype=np.int64)
    for b in batches[3:]:
        assert b.events == 300 and len(b.keys) == 100
        table = pq.read_table(b.path)
        assert table.num_rows == 300
        idx = np.array([int(u[len(growth_workload.KEY_PREFIX):]) for u in table["user_id"].to_pylist()])
        assert np.array_equal(np.unique(idx), b.keys)
        counts += np.bincount(idx, minlength=1000)
        assert np.array_equal(b.counts, counts[b.keys])


def test_check_output_refuses_missing_doubled_and_wrong_counts(tmp_path):
    batch = growth_workload.write_workload(str(tmp_path), keys=50, load_batch_keys=50,
                                  warm_up_batches=0, batches=2, events_per_batch=40,
                                  distinct_keys=10)[-1]
    right = _output(batch)
    assert growth_workload.check_output(2, right, batch) is None
    assert growth_workload.check_output(2, right.slice(0, 9), batch) is not None
    assert growth_workload.check_output(2, pa.concat_tables([right, right.slice(0, 1)]), batch) \
        is not None
    wrong = right.set_column(1, "count", pa.array(batch.counts + np.eye(10, dtype=np.int64)[3]))
    assert "1 keys with wrong counts" in (growth_workload.check_output(2, wrong, batch) or "")


def test_the_sink_fails_the_run_for_a_batch_never_committed_or_not_generated(tmp_path):
    batches = growth_workload.write_workload(str(tmp_path), keys=20, load_batch_keys=20,
                                    warm_up_batches=0, batches=2, events_per_batch=10,
                                    distinct_keys=5)
    sink = growth_workload.VerifiedCounts(batches)
    with pytest.raises(AssertionError, match=r"never committed: \[0, 1, 2\]"):
        sink.check("rocksdb-20")
    sink.commit(None, 3, None)  # a batch id the workload does not have: nothing read
    assert sink.verified == {3: False}
    with pytest.raises(AssertionError, match="batch 3 was not generated"):
        sink.check("rocksdb-20")


def _fake_run(backend: str, mode: str, seconds: list[float]) -> dict[str, Any]:
    """A run's result as :func:`growth.run_one` gives it, with only what the comparison reads."""
    per_batch = [{"phase": "measured", "trigger_s": s, "sync_s": 0.01, "async_s": 0.2,
                  "output_latency_s": 2 * s, "cpu_s": None} for s in seconds]
    return {"backend": backend, "keys": 1000, "checkpointing": mode, "per_batch": per_batch,
            "median_s": float(np.median(seconds))}


def test_repeats_run_the_modes_in_order_then_reversed_and_pool_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    ran: list[tuple[str, str]] = []
    roots: set[str] = set()
    # local disk's repeats at 1.0 s then 2.0 s (the machine got slower), async's at 1.05 s
    # then 2.0 s: each repeat alone says 1.05x and 1.0x, the pooled medians 1.525 / 1.5 s
    seconds = {("local-disk", 0): [1.0] * 3, ("local-disk", 1): [2.0] * 3,
               ("latency-sync", 0): [3.0] * 3, ("latency-sync", 1): [3.0] * 3,
               ("latency-async", 0): [1.05] * 3, ("latency-async", 1): [2.0] * 3}

    def fake_run_one(spark: Any, store: Any, backend: str, keys: int, workload: Any,
                     root: str, parallelism: int, mode: Any = None, repeat: int = 0,
                     **kwargs: Any) -> dict[str, Any]:
        ran.append((backend, mode.name))
        roots.add(root)
        return {**_fake_run(backend, mode.name, seconds[mode.name, repeat]), "repeat": repeat}

    class FakeSpark:
        class sparkContext:
            master = "local[2]"

    monkeypatch.setattr(growth, "run_one", fake_run_one)
    figures = growth.run(keys=1000, small_keys=500, batches=3, events_per_batch=100,
                         distinct_keys=10, load_batch_keys=1000, session_warm_up_batches=0,
                         spark=FakeSpark(), store="local", latency="ms=1", backends=["heap"],
                         checkpointing=growth_checkpointing.MODES, repeats=2)
    assert ran == [("heap", m) for m in ("local-disk", "latency-sync", "latency-async",
                                         "latency-async", "latency-sync", "local-disk")]
    assert [r["repeat"] for r in figures["results"]] == [0, 0, 0, 1, 1, 1]
    assert len(roots) == 6  # every run its own folder
    assert figures["workload"]["repeats"] == 2
    rows = {r["checkpointing"]: r for r in figures["comparison"]}
    assert rows["latency-async"]["repeats"] == 2 and rows["latency-async"]["batches"] == 6
    assert rows["latency-async"]["median_s"] == pytest.approx(1.525)
    assert rows["latency-async"]["median_over_local_disk"] == pytest.approx(1.525 / 1.5)
    assert rows["latency-async"]["median_over_local_disk_by_repeat"] == pytest.approx([1.05, 1.0])
    median_goal = next(g for name, g in figures["goals"].items() if "median, async" in name)
    assert median_goal["ratio"] == pytest.approx(1.525 / 1.5) and median_goal["met"]
    growth_checkpointing.plot(figures, str(tmp_path / "figure.png"))
    assert (tmp_path / "figure.png").stat().st_size > 0
    # a repeat needs modes to alternate
    with pytest.raises(ValueError, match="repeats"):
        growth.run(keys=1000, small_keys=500, batches=3, events_per_batch=100,
                   distinct_keys=10, spark=FakeSpark(), repeats=2)

