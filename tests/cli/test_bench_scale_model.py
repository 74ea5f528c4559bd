"""``keyedstate bench scale-model`` at a tiny size (never timed here): every phase of every
target subtask measured, every restore checked, the fit recovers known costs, the projection's
arithmetic, and the command's options.

Imported as ``benchmarks.scale_model``, this checkout's file, not the installed
``keyedstate_benchmarks`` (an editable install points at one checkout)."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from click.testing import CliRunner

import benchmarks
from benchmarks import plot, scale_fit, scale_model
from keyedstate.backends.rocksdb import restore as rocks_restore
from keyedstate.cli import main


def test_fit_recovers_known_costs_and_never_goes_negative() -> None:
    rows = [(k, b, r, 0.05 + 2e-7 * k + 3e-9 * b + 0.1 * r)
            for k in (1_000, 50_000, 200_000) for b in (k * 10, k * 120) for r in (2, 3)]
    got = scale_fit.fit_phase(rows)
    assert got.fixed == pytest.approx(0.05) and got.per_key == pytest.approx(2e-7)
    assert got.per_byte == pytest.approx(3e-9) and got.rms_s < 1e-9
    assert got.per_round_trip == pytest.approx(0.1)
    assert scale_fit.PhaseFit.from_dict(got.as_dict()) == got
    # Falling with size is noise: no negative coefficient, the best fit without it.
    falling = scale_fit.fit_phase([(k, 10 * k, 0, 1.0 - k * 1e-6) for k in (1, 10, 100)])
    assert falling.per_key == 0 and falling.per_byte == 0 and falling.per_round_trip == 0
    assert falling.fixed == pytest.approx((1.0 - 1e-6 + 1.0 - 1e-5 + 1.0 - 1e-4) / 3)


def test_a_target_with_one_more_round_trip_is_predicted_as_slower() -> None:
    # the shape of a 3 -> 6 rescale behind 100 ms per request: the first target reads 10
    # files on 4 threads (3 round trips), the others 8 (2); the bytes shared by the streams,
    # one file merged (1 stream) or several objects (4 streams)
    subtasks = [{"keys": k, "downloaded_bytes": 12 * k, "restore_round_trips": trips,
                 "restore_streams": streams, "upload_round_trips": 0,
                 "download_s": 0.01 + 0.1 * trips + 1e-8 * 12 * k / streams,
                 **{p: 0.0 for p in scale_fit.PHASES if p != "download_s"}}
                for k in (40_000, 80_000, 160_000) for trips in (3, 2, 2) for streams in (1, 4)]
    model = scale_fit.fit(subtasks)
    assert model["download_s"].per_round_trip == pytest.approx(0.1)
    assert model["download_s"].per_byte == pytest.approx(1e-8)
    held_out = [{**s, "keys": 4 * s["keys"], "downloaded_bytes": 4 * s["downloaded_bytes"],
                 "download_s": s["download_s"] + 1e-8 * 36 * s["keys"] / s["restore_streams"]}
                for s in subtasks[-6:]]
    error = scale_fit.held_out_error(model, held_out)
    assert abs(error["slowest_subtask"]["error"]) < 1e-6 and error["within_goal"]


def test_the_seed_subtasks_requests_follow_the_stores_rules() -> None:
    mib = 1 << 20
    # small key groups: every file merged, one ranged GET per old subtask
    assert scale_fit.seed_download_requests("rocksdb", 2, 1 * mib) == 2
    # 22 MB per key group: one SST each, above the merge size, plus the merged objects
    assert scale_fit.seed_download_requests("rocksdb", 2, 22 * mib) == 4
    # 2.2 GB per key group: 35 SST files of 64 MiB each
    assert scale_fit.seed_download_requests("rocksdb", 2, 2200 * mib) == 2 + 2 * 35
    assert scale_fit.seed_download_requests("heap", 2, 2200 * mib) == 2


def test_projection_of_the_seed_job() -> None:
    # 512 key groups over 480 subtasks: the largest subtask holds 2 of them.
    assert scale_fit.largest_subtask_key_groups(512, 480) == 2
    one_second = {p: scale_fit.PhaseFit(0.0, 0.0, 0.0, 0.0) for p in scale_fit.PHASES}
    one_second["download_s"] = scale_fit.PhaseFit(1.0, 0.0, 1e-8, 0.0)
    rows = scale_fit.project(one_second, bytes_per_key=10.0, backend="heap",
                             upload_round_trips=1, clusters=((60, 8), (15, 8)))
    keys = 2 * 1_000_000_000 / 512
    assert rows[0]["largest_subtask_keys"] == keys
    # the heap reads one file of each of its 2 old subtasks: 2 GETs in 1 round trip, 2 streams
    assert rows[0]["largest_subtask_round_trips"] == {"download_s": 1.0, "upload_s": 1.0}
    assert rows[0]["largest_subtask_streams"] == 2
    download = 1 + keys * 10 * 1e-8 / 2
    assert rows[0]["largest_subtask_phases_s"]["total_s"] == pytest.approx(download)
    assert rows[0]["subtasks_per_slot"] == 1 and rows[1]["subtasks_per_slot"] == 4
    assert rows[1]["time_s"] == pytest.approx(4 * download)
    assert rows[0]["dominant_term"] == "download_s" and rows[0]["meets_goal"]
    # the largest value that still meets the goal: 1 s fixed + bytes at 1e-8 s each on each
    # of 2 streams, in 120 s
    assert rows[0]["max_bytes_per_key_under_goal"] == pytest.approx(119 / (1e-8 * keys / 2))
    assert rows[1]["max_bytes_per_key_under_goal"] == pytest.approx(29 / (1e-8 * keys / 2))


def test_phase_clock_puts_the_backends_functions_back() -> None:
    original = rocks_restore.open_db
    with scale_model.PhaseClock().active():
        assert rocks_restore.open_db is not original
    assert rocks_restore.open_db is original


@pytest.mark.integration
def test_tiny_scale_model_measures_fits_and_projects(tmp_path: Any) -> None:
    figures = scale_model.run(keys=1200, repeats=1, latency="ms=1,mb_per_s=1000")
    json.loads(json.dumps(figures, allow_nan=False))  # all of it is plain JSON
    assert figures["benchmark"] == "scale-model"
    assert {"commit", "load_average", "load_average_at_start"} <= set(figures["machine"])
    assert figures["latency"]["first_byte_ms"] == 1
    assert figures["workload"]["training_sizes"] == [150, 300, 600]
    for backend in scale_model.BACKENDS:
        result = figures["results"][backend]
        assert len(result["sizes"]) == 4 * len(scale_model.VALUES)
        for size in result["sizes"]:
            assert sum(s["keys"] for s in size["subtasks"]) == size["keys"]
            assert all(s["downloaded_bytes"] > 0 and s["restore_s"] > 0
                       and s["download_s"] > 0 and s["restore_requests"]
                       and s["restore_round_trips"] >= 1 and s["restore_streams"] >= 1
                       for s in size["subtasks"])
        assert set(result["fit"]) == set(scale_fit.PHASES)
        assert set(result["held_out"]) == set(scale_model.VALUES)
        assert set(result["projection"]) == {*scale_model.VALUES, "bytes1024"}
    rocks = figures["results"]["rocksdb"]["sizes"]
    assert any(s["clip_s"] > 0 for size in rocks for s in size["subtasks"])  # 3 -> 6 clips
    png = plot.plot_scale_model(figures, str(tmp_path))
    assert (tmp_path / "scale-model.png").stat().st_size > 0 and png.endswith(".png")


@pytest.fixture
def this_checkouts_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI imports ``keyedstate_benchmarks.<name>``: this checkout's, for this test."""
    monkeypatch.setitem(sys.modules, "keyedstate_benchmarks", benchmarks)
    monkeypatch.setitem(sys.modules, "keyedstate_benchmarks.scale_model", scale_model)


def test_cli_passes_keys_and_latency(monkeypatch: pytest.MonkeyPatch,
                                     this_checkouts_benchmarks: None) -> None:
    seen: dict[str, Any] = {}

    def fake_run(keys: int = 0, latency: Any = None, progress: Any = None) -> dict[str, Any]:
        seen.update(keys=keys, latency=latency)
        return {"benchmark": "scale-model"}

    monkeypatch.setattr(scale_model, "run", fake_run)
    result = CliRunner().invoke(main, ["bench", "scale-model", "--keys", "4000", "--latency",
                                       "ms=30,mb_per_s=90", "--json"])
    assert result.exit_code == 0, result.output
    assert seen["keys"] == 4000 and seen["latency"].first_byte_ms == 30


def test_cli_refuses_a_sweep_of_a_benchmark_without_one() -> None:
    result = CliRunner().invoke(main, ["bench", "scale-model", "--sweep"])
    assert result.exit_code == 2 and "--sweep" in result.output and "throughput" in result.output
