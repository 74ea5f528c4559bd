"""``keyedstate bench throughput``'s floor of keyedstate's protocol, without Spark: the
stateless systems' per-batch output check, their functions on the local runtime, the
interleaved mode's ratios to the built-in aggregation with their goals and floor checks, and
``--systems`` (the Spark runs are in tests/spark/test_bench_throughput.py)."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any, cast

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import benchmarks
from benchmarks import throughput, throughput_interleave, throughput_stateless
from keyedstate.cli import main
from keyedstate.config import JobConfig
from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.runtime.local import LocalJob

STATELESS = throughput.KEYEDSTATE_STATELESS
STATELESS_TWO_PHASE = throughput.KEYEDSTATE_STATELESS_TWO_PHASE
BUILTIN, ROCKSDB, TWO_PHASE = (throughput.BUILTIN_AGG, throughput.KEYEDSTATE_ROCKSDB,
                               throughput.KEYEDSTATE_ROCKSDB_TWO_PHASE)


@pytest.fixture
def files(tmp_path: Any) -> tuple[list[str], list[tuple[int, int, int]]]:
    """Three generated batches of 200 events over 30 keys, and the cumulative count's
    expected figures."""
    return throughput.write_batches(str(tmp_path / "data"), 3, 200, 30)


def _figures(counts: list[int]) -> tuple[int, int, int]:
    return len(counts), sum(counts), sum(c * c for c in counts)


def test_batch_figures_are_each_files_own_counts(files: Any) -> None:
    paths, cumulative = files
    own = [_figures(list(Counter(pq.read_table(p)["user_id"].to_pylist()).values()))
           for p in paths]
    assert throughput_stateless.batch_figures(paths) == own
    assert [rows for rows, _, _ in own] == [rows for rows, _, _ in cumulative]
    assert all(total == 200 for _, total, _ in own)
    # From the second batch on, the counts so far are not the batch's own: the two checks
    # tell a per-batch count from a cumulative one.
    assert own[0] == cumulative[0] and own[1:] != cumulative[1:]


def test_check_batch_counts_accepts_exactly_each_batchs_own_counts(files: Any) -> None:
    paths, cumulative = files
    right = dict(enumerate(throughput_stateless.batch_figures(paths)))
    throughput_stateless.check_batch_counts(STATELESS, right, paths)
    wrong_count = {**right, 1: (right[1][0], right[1][1], right[1][2] + 2)}  # one key +-1
    missing = {b: f for b, f in right.items() if b != 2}
    extra = {**right, 3: right[0]}
    counts_so_far = dict(enumerate(cumulative))
    for seen in (wrong_count, missing, extra, counts_so_far):
        with pytest.raises(AssertionError, match=f"{STATELESS}: per-batch"):
            throughput_stateless.check_batch_counts(STATELESS, seen, paths)


@pytest.mark.integration
@pytest.mark.parametrize("system", [STATELESS, STATELESS_TWO_PHASE])
def test_stateless_functions_emit_each_keys_count_in_its_batch(files: Any, tmp_path: Any,
                                                               system: str) -> None:
    """Run on the local runtime (as on Spark: routing, local aggregation, checkpoints), a
    stateless function's output passes the per-batch check and registers no state."""
    paths, _ = files
    backend, function_class = throughput.KEYEDSTATE_SYSTEMS[system]
    function: KeyedProcessFunction = function_class()
    cfg = JobConfig(checkpoint_dir=str(tmp_path / "ckpt"), parallelism=2, backend=backend)
    seen: dict[int, tuple[int, int, int]] = {}
    with LocalJob(function, key_columns=["user_id"], input_schema=throughput.INPUT_DDL,
                  output_schema=throughput.OUTPUT_DDL, config=cfg) as job:
        for b, path in enumerate(paths):
            out = job.process_batch(pq.read_table(path))["main"]
            seen[b] = _figures(out.column("count").to_pylist())
    throughput_stateless.check_batch_counts(system, seen, paths)
    assert backend == "heap"


def test_stateless_function_counts_a_keys_rows() -> None:
    rows = pa.table({"user_id": ["k", "k", "k"]})
    no_context = cast(Context, None)  # the function reads no context
    assert throughput_stateless.StatelessCount().process_key("k", rows, no_context) == \
        [("k", 3)]


def _rounds(**seconds: list[float]) -> list[dict[str, Any]]:
    """Rounds with each system's seconds, round by round (a name's dashes as underscores)."""
    names = {n.replace("-", "_"): n for n in throughput.SYSTEMS}
    n = len(next(iter(seconds.values())))
    return [{"round": r, "seconds": {names[k]: v[r] for k, v in seconds.items()}}
            for r in range(n)]


def test_ratios_to_the_builtin_compare_each_round_with_its_own() -> None:
    """Events/s over the built-in's of the same round is the built-in's seconds over the
    system's; the first round (state created) is left out; both the median of the ratios
    and the ratio of the medians judge a goal."""
    rounds = _rounds(
        spark_builtin_agg=[9.0, 1.0, 2.0, 1.0, 1.2],
        keyedstate_rocksdb=[0.1, 1.25, 2.5, 1.0, 1.5],  # 0.8, 0.8, 1.0, 0.8
        keyedstate_rocksdb_two_phase=[0.1, 0.75, 1.5, 0.7, 0.9],  # 1.33, 1.33, 1.43, 1.33
        keyedstate_stateless=[0.1, 0.9, 1.8, 0.9, 1.0],  # 1.11, 1.11, 1.11, 1.2
        keyedstate_stateless_two_phase=[0.1, 0.8, 1.6, 0.8, 1.0])  # 1.25 ... 1.2
    ratios = throughput_interleave.round_ratios_to_builtin(rounds)
    assert set(ratios) == {ROCKSDB, TWO_PHASE, STATELESS, STATELESS_TWO_PHASE}
    per_key = ratios[ROCKSDB]
    assert [x["round"] for x in per_key["rounds"]] == [1, 2, 3, 4]
    assert [x["ratio"] for x in per_key["rounds"]] == pytest.approx([0.8, 0.8, 1.0, 0.8])
    assert per_key["median_ratio"] == pytest.approx(0.8)
    assert per_key["ratio_of_medians"] == pytest.approx(1.1 / 1.375)
    assert (per_key["min_ratio"], per_key["max_ratio"]) == pytest.approx((0.8, 1.0))
    assert per_key["target"] == 1.0 and ratios[TWO_PHASE]["target"] == 1.3
    goals = throughput_interleave.builtin_round_goals(ratios)
    assert set(goals) == {f"{ROCKSDB} >= 1x {BUILTIN}, round by round",
                          f"{TWO_PHASE} >= 1.3x {BUILTIN}, round by round"}  # floors: checks
    assert not goals[f"{ROCKSDB} >= 1x {BUILTIN}, round by round"]["met"]
    assert goals[f"{TWO_PHASE} >= 1.3x {BUILTIN}, round by round"]["met"]
    checks = throughput_interleave.floor_checks(ratios)
    assert checks[STATELESS]["verdict"] == "reaches" and checks[STATELESS]["reaches_target"]
    assert checks[STATELESS]["bounds"] == [ROCKSDB, throughput.KEYEDSTATE_HEAP]
    assert checks[STATELESS]["goal"] == f"{ROCKSDB} >= 1x {BUILTIN}, round by round"
    two_phase = checks[STATELESS_TWO_PHASE]
    assert two_phase["verdict"] == "below" and not two_phase["reaches_target"]
    assert two_phase["target"] == 1.3


def test_a_floor_check_split_between_its_measures_decides_nothing() -> None:
    # ratios 1.5, 0.9, 0.9: median 0.9 < 1; medians 1.0 / 1.0 = 1.0 >= 1
    rounds = _rounds(spark_builtin_agg=[5.0, 1.5, 1.0, 0.9],
                     keyedstate_stateless=[5.0, 1.0, 1.0 / 0.9, 1.0])
    ratios = throughput_interleave.round_ratios_to_builtin(rounds)
    assert set(ratios) == {STATELESS}  # the other systems did not run
    check = throughput_interleave.floor_checks(ratios)[STATELESS]
    assert check["median_ratio"] < 1.0 <= check["ratio_of_medians"]
    assert check["verdict"] == "split" and not check["reaches_target"]
    assert throughput_interleave.builtin_round_goals(ratios) == {}


def test_no_ratio_without_the_builtin() -> None:
    rounds = _rounds(keyedstate_rocksdb=[1.0, 1.0, 1.0], keyedstate_stateless=[1.0, 1.0, 1.0])
    assert throughput_interleave.round_ratios_to_builtin(rounds) == {}


@pytest.fixture
def fake_throughput(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The CLI imports ``keyedstate_benchmarks.throughput``: this checkout's, whose ``run``
    records its arguments instead of starting Spark."""
    seen: dict[str, Any] = {}

    def fake_run(batches: int = 8, systems: Any = None, interleave: bool = False,
                 progress: Any = None) -> dict[str, Any]:
        seen.update(batches=batches, systems=systems, interleave=interleave)
        return {"benchmark": "throughput"}

    monkeypatch.setitem(sys.modules, "keyedstate_benchmarks", benchmarks)
    monkeypatch.setitem(sys.modules, "keyedstate_benchmarks.throughput", throughput)
    monkeypatch.setattr(throughput, "run", fake_run)
    return seen


def test_cli_systems_takes_the_floor_set(fake_throughput: dict[str, Any]) -> None:
    result = CliRunner().invoke(main, ["bench", "throughput", "--interleave", "--batches", "24",
                                       "--systems", "floor", "--json"])
    assert result.exit_code == 0, result.output
    assert fake_throughput == {"batches": 24, "interleave": True,
                               "systems": list(throughput_interleave.FLOOR_SYSTEMS)}
    assert {BUILTIN, STATELESS, STATELESS_TWO_PHASE} <= set(fake_throughput["systems"])
    assert set(throughput_interleave.OVERHEAD_SYSTEMS) <= set(fake_throughput["systems"])


def test_cli_systems_takes_names_and_sets_each_system_once(
        fake_throughput: dict[str, Any]) -> None:
    result = CliRunner().invoke(main, ["bench", "throughput", "--systems",
                                       f"{BUILTIN}, {STATELESS},interleaved,{STATELESS}"])
    assert result.exit_code == 0, result.output
    assert fake_throughput["systems"] == [BUILTIN, STATELESS,
                                          *throughput_interleave.OVERHEAD_SYSTEMS]


def test_cli_systems_refuses_an_unknown_name(fake_throughput: dict[str, Any]) -> None:
    result = CliRunner().invoke(main, ["bench", "throughput", "--systems", "floor,nope"])
    assert result.exit_code == 2 and "unknown systems ['nope']" in result.output
    assert "floor" in result.output and fake_throughput == {}


def test_cli_refuses_systems_of_a_benchmark_without_them() -> None:
    result = CliRunner().invoke(main, ["bench", "checkpoint", "--systems", "floor"])
    assert result.exit_code == 2 and "'checkpoint' has no systems" in result.output
