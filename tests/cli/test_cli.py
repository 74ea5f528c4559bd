"""The ``keyedstate`` command line (smoke-level: every command runs and says something true)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from keyedstate.cli import main
from keyedstate_examples.click_sessions import PHASES

pytestmark = pytest.mark.integration


def test_help_lists_the_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output and "bench" in result.output


def test_local_demo_json_matches_its_oracle(tmp_path):
    result = CliRunner().invoke(main, ["demo", "--local", "--dir", str(tmp_path / "d"),
                                       "--events", "3000", "--users", "200", "--files", "6",
                                       "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # the progress bars go to stderr
    assert summary["verified"] is True
    # Checks by stable identifier, each with its verdict and the sentence a person reads.
    assert summary["checks"] == {
        "totals_match_oracle": {"passed": True, "description": "totals match the oracle"},
        "one_count_row_per_user_and_batch": {"passed": True,
                                             "description": "one count row per user and batch"},
        "sessions_match_oracle": {"passed": True, "description": "sessions match the oracle"}}
    assert list(summary["phase_seconds"]) == list(PHASES)
    assert summary["runtime"] == "local"
    # six files and the drain, parallelism 2, a savepoint, then 3
    assert summary["batches"] == 6 + 1 and summary["parallelism"] == [2, 3]
    assert summary["savepoint"] and all(s["full_bytes"] > 0 for s in summary["stats"])


def test_demo_phases_come_in_order_with_the_batches_they_planned(tmp_path):
    from examples.click_sessions import PHASES, run_local

    class Recorder:
        def __init__(self) -> None:
            self.planned: dict[str, int] = {}
            self.done: dict[str, int] = {}
            self.current = ""

        def phase(self, name: str, batches: int) -> None:
            self.current = name
            self.planned[name], self.done[name] = batches, 0

        def batch(self, stats: dict) -> None:
            assert stats["full_bytes"] > 0 and "rows_in" in stats
            self.done[self.current] += 1

    recorder = Recorder()
    report = run_local(str(tmp_path / "d"), 3000, 200, 5, recorder)
    assert report.verified, report.checks
    assert tuple(recorder.planned) == PHASES
    assert recorder.planned == recorder.done == {
        "generate": 0, "run p=2": 2, "savepoint": 0, "restart p=3": 3, "drain": 1, "verify": 0}


def test_demo_oracle_rejects_a_lost_a_doubled_and_a_wrong_output():
    import datetime as dt

    import pyarrow as pa

    from examples.click_sessions import generate_events, oracle, verify

    events = list(generate_events(3000, 100))
    totals, expected = oracle(events)
    counts = pa.table({"user_id": list(totals.index), "count": list(totals["count"]),
                       "total": list(totals["total"]), "batch_id": [0] * len(totals)})

    def at(ms: list[int]) -> pa.Array:
        return pa.array([dt.datetime.fromtimestamp(m / 1000, dt.timezone.utc) for m in ms])

    sessions = pa.table({"user_id": list(expected["user_id"]),
                         "session_start": at(list(expected["start"])),
                         "session_end": at(list(expected["end"])),
                         "events": list(expected["events"]), "amount": list(expected["amount"])})
    assert all(verify(events, counts, sessions).values())
    assert not verify(events, counts, sessions.slice(1))["sessions_match_oracle"].passed
    doubled = pa.concat_tables([counts, counts.slice(0, 1)])
    assert not verify(events, doubled, sessions)["one_count_row_per_user_and_batch"].passed
    wrong = counts.set_column(1, "count", pa.array([c + 1 for c in counts["count"].to_pylist()]))
    assert not verify(events, wrong, sessions)["totals_match_oracle"].passed
    assert not verify(events, counts.slice(1), sessions)["totals_match_oracle"].passed


SMALL_DEMO = ["--events", "2000", "--users", "100", "--files", "4", "--json"]


def test_demo_refuses_a_directory_it_did_not_make_and_deletes_nothing(tmp_path):
    mine = tmp_path / "d" / "mine.txt"
    mine.parent.mkdir()
    mine.write_text("keep me")
    result = CliRunner().invoke(main, ["demo", "--local", "--dir", str(tmp_path / "d"),
                                       *SMALL_DEMO])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "TargetNotEmptyError" in text, text
    assert "mine.txt" in text and ".keyedstate-demo" in text
    assert mine.read_text() == "keep me" and os.listdir(tmp_path / "d") == ["mine.txt"]


def test_demo_dir_dot_in_a_non_empty_working_directory_is_refused(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["demo", "--local", "--dir", ".", *SMALL_DEMO])
    assert result.exit_code == 1 and "TargetNotEmptyError" in result.output
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_demo_reruns_in_its_own_directory_and_uses_an_empty_one(tmp_path):
    (tmp_path / "empty").mkdir()
    for _ in range(2):  # the second run replaces the first run's content
        result = CliRunner().invoke(main, ["demo", "--local", "--dir", str(tmp_path / "empty"),
                                           *SMALL_DEMO])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["verified"] is True
    assert os.path.isfile(tmp_path / "empty" / ".keyedstate-demo")
    assert sorted(os.listdir(tmp_path / "empty" / "savepoints")) == ["savepoint-1"]


def test_example_command_line_refuses_a_directory_it_did_not_make(tmp_path, capsys):
    from examples.click_sessions import main as example

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_:
        example(["--runtime", "local", "--dir", str(tmp_path / "d")])
    assert exit_.value.code == 2 and "not empty" in capsys.readouterr().err
    assert os.listdir(tmp_path / "d") == ["mine.txt"]


def test_demo_refuses_fewer_than_two_files(tmp_path):
    result = CliRunner().invoke(main, ["demo", "--local", "--dir", str(tmp_path / "d"),
                                       "--files", "1"])
    assert result.exit_code == 2 and "--files" in result.output


def test_example_runs_locally_from_its_own_command_line(tmp_path):
    from examples.click_sessions import main as example

    assert example(["--runtime", "local", "--dir", str(tmp_path / "d"), "--events", "2000",
                    "--users", "50", "--files", "4"]) == 0


def test_bench_access_runs_small(tmp_path):
    out = tmp_path / "access.json"
    result = CliRunner().invoke(main, ["bench", "access", "--keys", "2000", "--json",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["benchmark"] == "access" and figures["raw_rocksdict_us_per_op"] > 0


def test_bench_checkpoint_runs_small():
    result = CliRunner().invoke(main, ["bench", "checkpoint", "--keys", "3000", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output[result.output.index("{"):])
    assert {r["backend"] for r in figures["results"]} == {"heap", "rocksdb", "rocksdb-level"}


def test_bench_shards_runs_small(tmp_path):
    out = tmp_path / "shards.json"
    result = CliRunner().invoke(main, ["bench", "shards", "--keys", "2000", "--batches", "4",
                                       "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    rows = figures["results"]
    assert [(r["key_group_shards"], r["max_file_opening_threads"], r["value_cache_size"],
             r["local_dir_on_tmpfs"]) for r in rows] == [
        (8, 1, 0, False), (8, 16, 0, False), (4, 1, 0, False), (2, 1, 0, False),
        (1, 1, 0, False), (8, 1, 64 << 20, False), (1, 1, 64 << 20, False),
        (8, 1, 64 << 20, True), (1, 1, 64 << 20, True), (None, None, None, False)]
    assert rows[0]["batch_over_default"] == 1.0 and figures["workload"]["warmup"] == 1
    assert all(len(r["batches"]["restore_s"]) == 4 and r["restore_s"] > 0 for r in rows)
    assert rows[-1]["configuration"] == "heap, for reference"
