"""The ``keyedstate`` command line (smoke-level: every command runs and says something true)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from keyedstate.cli import main


def test_help_lists_the_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output and "bench" in result.output


def test_local_demo_json_matches_its_oracle(tmp_path):
    result = CliRunner().invoke(main, ["demo", "--local", "--dir", str(tmp_path / "d"),
                                       "--events", "3000", "--users", "200", "--files", "6",
                                       "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["verified"] is True and all(summary["checks"].values())
    assert summary["runtime"] == "local"
    # six files and the drain, parallelism 2, a savepoint, then 3
    assert summary["batches"] == 6 + 1 and summary["parallelism"] == [2, 3]
    assert summary["savepoint"] and all(s["full_bytes"] > 0 for s in summary["stats"])


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
