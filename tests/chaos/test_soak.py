"""The chaos soak, shortened for CI: ``keyedstate chaos`` on ``local-cluster[2,1,1024]`` with
one fault of every kind and every edge of the commit protocol, then the oracle's verdict.

Seed 54 of 14 files (``tests/chaos/test_plan.py`` checks what any seed draws): a Python worker
and an executor JVM killed mid-upload, the driver killed after step 6 of the checkpoint commit,
a subtask failing every attempt; transient storage errors after the checkpoint commit at the
sink-commit marker (outlasting the commit retries: the query restarts), the staging delete and
a listener; five jobs, ended by a crash between checkpoint and sink commit (savepoint taken
offline by the CLI, then CLAIM in the same Spark location), a stop, a savepoint from inside the
main sink's commit, a drain (then a fresh Spark location: positions seeded from the savepoint);
positions drills, three corruption drills (none after the drain); a second job writing
into the soak's output path after the first job. The edges drawn after those: three
same-session restarts with a changed definition (after files 6, 10 and 12: the stats type
evolved, TTL of last_seen switched off, buckets dropped), and a rollback: the job after the
sink end restores the savepoint the sink's job started from (batch 3) into a fresh Spark
location, first refused without ``on_rollback="branch"``, then a branch beside the parent's
batches 4-5; three lineage branches, each judged on its own.

Run on the heap backend (about 3 minutes on 2 shared cores; ``--backend rocksdb`` runs the
same plan on RocksDB). The long run (500 batches, 50 faults of each kind) is the same command
with other numbers; its figures are in docs/reliability.md.

With the asynchronous phase (``--checkpointing mixed``, seed 54 of 30 files, RocksDB: CI's
soak of that backend): the same kinds and edges, and every point of the asynchronous phase
once: storage errors on an upload, an acknowledgement, a ``_metadata`` and the registry, the
driver killed before and after a completed checkpoint's sink commit and between Spark's commit
log entry and the completion, a worker killed while it uploads; jobs in both modes (a sync
job, then async ones, one with two checkpoints in flight and ended by a crash, one ended from
inside its sink commit, then a sync rollback), and a driver killed at a commit step of an
async job restarted synchronously.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from keyedstate.testing.chaos.plan import ASYNC_POINTS, make_plan

pytestmark = [pytest.mark.chaos, pytest.mark.spark, pytest.mark.slow]

SEED, BATCHES = 54, 14
#: the shortened soak with the asynchronous phase
ASYNC_BATCHES = 30


def test_the_ci_plan_draws_the_sharpest_edges():
    plan = make_plan(SEED, BATCHES, 1, checkpoint_root="/x")
    crash = next(j for j in plan.jobs if j.stop == "crash")
    after_crash = plan.jobs[crash.index + 1]
    assert after_crash.restore_mode == "CLAIM"
    assert after_crash.spark_location == crash.spark_location, "Spark replays the batch"
    assert next(j for j in plan.jobs if j.stop == "sink").sink_at == "main-before"
    drain = next(j for j in plan.jobs if j.stop == "drain")
    assert plan.jobs[drain.index + 1].spark_location != drain.spark_location
    marker = next(f for f in plan.storage_faults if f["point"] == "marker-write")
    assert marker["times"] == 4, "outlasts the commit retries"
    assert [f["point"] for f in plan.driver_faults] == ["commit-step-6"]
    # The new operations: every definition change, a rollback, restores into new locations.
    points = plan.planned_points()
    assert {"redefine:evolve-stats", "redefine:switch-ttl", "redefine:toggle-buckets",
            "rollback", "fresh-location"} <= set(points)
    rollback = next(j for j in plan.jobs if j.rollback)
    assert plan.jobs[rollback.index - 1].stop == "sink"
    assert plan.fork_batch(rollback) == 3 and plan.first_file(rollback) == 4
    assert [(b.parent, b.fork) for b in plan.branches()] == [(None, -1), (0, 3), (1, 10)]


def test_shortened_soak_passes(tmp_path):
    """On the heap backend (whose workers also catch their stale live copies up in the
    background between tasks, ``runtime.live_copies``); RocksDB's soak is the one with the
    asynchronous phase below, whose plan has synchronous jobs too."""
    backend = "heap"
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "keyedstate.cli", "chaos", "--batches", str(BATCHES), "--seed",
         str(SEED), "--faults-per-kind", "1", "--backend", backend, "--dir", str(run_dir),
         "--json"],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.stderr.splitlines()[0].startswith(f"chaos seed {SEED}"), result.stderr[:500]
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["passed"], (report["failures"],
                                                         result.stderr[-2000:])
    eo = report["exactly_once"]
    assert eo["violations"] == 0 and eo["main_output"]["expected"] > 0
    assert eo["drain_batches"] and eo["drain_rows"] > 0, "the drain's output, row by row"
    assert report["state"]["violations"] == 0 and report["state"]["expected"] > 0
    assert report["injected"] == report["planned"] == {
        "worker": 1, "executor": 1, "driver": 1, "abort": 1, "storage": 3, "savepoint": 4}
    assert report["drivers_started"] == 3, "the planned driver kill and the crash job end"
    assert [(b["planned"], b["via"]) for b in report["boundaries"]] == [
        ("crash", "cli"), ("stop", "stop"), ("sink:main-before", "sink"), ("drain", "drain")]
    assert report["boundaries"][0]["carries_output"] is True
    assert report["drills"]["positions"] == {"count": 2, "refused": 2}
    # Rollback: refused without the option, nothing left; a branch forking at batch 3.
    assert report["boundaries"][2]["rollback"] == {"check": "refused", "fork_batches": [3]}
    branches = eo["branches"]
    assert [(b["parent"], b["fork_batch"]) for b in branches] == [(None, -1), (0, 3), (1, 10)]
    assert all(b["lineage"] and b["rows"] > 0 and b["violations"] == 0 for b in branches)
    assert len({b["lineage"] for b in branches}) == 3 and not eo["lineage_problems"]
    assert report["definitions"]["done_after_files"] == [6, 10, 12]
    assert report["state"]["definition"] == 3
    assert report["drills"]["count"] == 3 and not report["drills"]["violations"]
    # Two jobs, one output path: exactly its own rows for each (ParquetSink names a batch by
    # its Spark query id since 2d83c89; before, each job replaced the other's batches 0-1).
    shared = report["shared_output"]
    assert shared["second_job"]["violations"] == 0 and shared["second_job"]["expected"] > 0
    assert shared["soak_rows_lost_in_those_batches"] == {}
    assert report["checkpoint_dirs"]["orphans_after_gc"] == 0
    assert report["checkpoint_dirs"]["referenced_but_missing"] == []
    assert report["processes"]["stragglers"] == []


def test_the_async_ci_plan_draws_every_point_and_both_modes():
    plan = make_plan(SEED, ASYNC_BATCHES, 1, checkpoint_root="/x", checkpointing="mixed")
    assert plan.notes == []
    points = plan.planned_points()
    assert {p: points.get(f"async:{p}") for p in ASYNC_POINTS} == {p: 1 for p in ASYNC_POINTS}
    modes = [(j.checkpointing, j.max_concurrent if j.checkpointing == "async" else None, j.stop)
             for j in plan.jobs]
    assert modes == [("sync", None, "stop"), ("async", 1, "drain"), ("async", 2, "crash"),
                     ("async", 1, "sink"), ("sync", None, "stop")]
    assert plan.jobs[-1].rollback
    # The driver killed at a commit step of the first async job, whose files hold no async
    # fault: the restarted driver draws its mode, synchronous.
    kill = next(f for f in plan.driver_faults if f["kind"] == "driver")
    assert (kill["point"], plan.job_of_file(kill["file"]).index) == ("commit-step-2", 1)
    assert not [f for f in plan.async_faults() if plan.job_of_file(f["file"]).index == 1]
    assert plan.restart_checkpointing[-2] == "sync"  # the second driver's draw


def test_shortened_soak_with_the_asynchronous_phase_passes(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "keyedstate.cli", "chaos", "--batches", str(ASYNC_BATCHES),
         "--seed", str(SEED), "--faults-per-kind", "1", "--checkpointing", "mixed", "--dir",
         str(run_dir), "--json"],
        capture_output=True, text=True, timeout=1800,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.stderr.startswith(f"chaos seed {SEED}"), result.stderr[:500]
    report = json.loads(result.stdout)
    # The replay command (its printout wraps over lines).
    assert "--checkpointing mixed" in report["command"]
    assert result.returncode == 0 and report["passed"], (report["failures"],
                                                         result.stderr[-2000:])
    assert report["exactly_once"]["violations"] == 0
    assert report["state"]["violations"] == 0 and report["state"]["expected"] > 0
    assert report["injected"] == report["planned"] == {
        "worker": 1, "executor": 1, "driver": 1, "abort": 1, "storage": 3, "savepoint": 4,
        "async": 8}
    assert {p: report["injected_by_point"].get(f"async:{p}") for p in ASYNC_POINTS} == {
        p: 1 for p in ASYNC_POINTS}
    cp = report["checkpointing"]
    assert cp["mode"] == "mixed" and set(cp["query_starts"]) == {"sync", "async"}
    assert cp["switches"].get("async->sync:restart", 0) >= 1
    assert cp["switches"].get("sync->async:boundary", 0) >= 1
    assert cp["switches"].get("async->sync:boundary", 0) >= 1
    assert cp["discards"] >= 4 and cp["unexplained_discards"] == []
    assert cp["kills_before_completion"] == [
        {"batch": cp["kills_before_completion"][0]["batch"], "spark_committed": True}]
    assert [(b["planned"], b["via"]) for b in report["boundaries"]] == [
        ("stop", "stop"), ("drain", "drain"), ("crash", "cli"), ("sink:main-before", "sink")]
    assert report["plan_notes"] == []
    assert report["checkpoint_dirs"]["orphans_after_gc"] == 0
    assert report["checkpoint_dirs"]["referenced_but_missing"] == []
    assert report["processes"]["stragglers"] == []
