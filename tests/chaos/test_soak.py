"""The chaos soak, shortened for CI: ``keyedstate chaos`` on ``local-cluster[2,1,1024]`` with
one fault of every kind (a Python worker and an executor JVM killed mid-upload, the driver
killed after step 3 of the checkpoint commit, an aborted checkpoint, a stop with savepoint and
a CLAIM restore at another parallelism, a corruption drill), then the oracle's verdict.

The long run (500 batches, 50 faults of each kind) is the same command with other numbers; its
figures are in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from keyedstate.chaos.plan import KINDS, make_plan

pytestmark = [pytest.mark.chaos, pytest.mark.spark, pytest.mark.slow]

#: seed 16 of 14 batches: executor-side faults mid-upload, a driver crash after commit step 3,
#: a failed _metadata write, CLAIM at parallelism 4 -> 3 (see test_plan_covers_the_kinds)
SEED, BATCHES = 16, 14


def test_plan_is_a_function_of_the_seed():
    a = make_plan(SEED, BATCHES, 1, checkpoint_root="/x").to_json()
    assert a == make_plan(SEED, BATCHES, 1, checkpoint_root="/x").to_json()
    assert a != make_plan(SEED + 1, BATCHES, 1, checkpoint_root="/x").to_json()
    long = make_plan(1, 500, 50, checkpoint_root="/x")
    assert long.planned_counts() == {kind: 50 for kind in KINDS}
    assert len({f["batch"] for f in long.executor_faults + long.driver_faults}) == 200


def test_plan_covers_the_kinds():
    plan = make_plan(SEED, BATCHES, 1, checkpoint_root="/x")
    assert plan.planned_counts() == {kind: 1 for kind in KINDS}
    assert {f["at"] for f in plan.executor_faults} == {"upload"}
    assert [f["point"] for f in plan.driver_faults] == ["commit-step-3", "metadata-write"]
    assert plan.jobs[1].restore_mode == "CLAIM"


def test_shortened_soak_passes(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "keyedstate.chaos", "--batches", str(BATCHES), "--seed",
         str(SEED), "--faults-per-kind", "1", "--dir", str(run_dir), "--json"],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.stderr.splitlines()[0].startswith(f"chaos seed {SEED}"), result.stderr[:500]
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["passed"], (report["failures"],
                                                         result.stderr[-2000:])
    assert report["exactly_once"]["violations"] == 0
    assert report["exactly_once"]["main_output"]["expected"] > 0
    assert report["state"]["violations"] == 0 and report["state"]["expected"] > 0
    assert report["injected"] == {kind: 1 for kind in KINDS}
    assert report["drivers_started"] == 2
    assert report["drills"]["count"] == 1 and not report["drills"]["violations"]
    assert report["checkpoint_dirs"]["orphans_after_gc"] == 0
    assert report["checkpoint_dirs"]["referenced_but_missing"] == []
    assert report["processes"]["stragglers"] == []
