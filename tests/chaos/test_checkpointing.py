"""How the soak's jobs checkpoint (``--checkpointing``), without Spark: the mode a restarted
driver takes, and the verdict on the modes, their switches and the discards of checkpoints in
flight (``verdict._judge_checkpointing``)."""

from __future__ import annotations

import pytest

from keyedstate.testing.chaos.driver import claimed_since, restart_checkpointing
from keyedstate.testing.chaos.plan import make_plan
from keyedstate.testing.chaos.runner import ChaosReport
from keyedstate.testing.chaos.verdict import _judge_checkpointing
from keyedstate.testing.chaos.workload import claim_marker

pytestmark = pytest.mark.chaos


def test_a_restarted_driver_stays_async_while_its_job_has_async_faults_to_fire(tmp_path):
    plan = make_plan(54, 30, 1, checkpoint_root="/x", checkpointing="mixed")
    run_dir = str(tmp_path)
    job = next(j for j in plan.jobs
               if any(plan.job_of_file(f["file"]).index == j.index for f in plan.async_faults()))
    mine = [f for f in plan.async_faults() if plan.job_of_file(f["file"]).index == job.index]
    assert restart_checkpointing(plan, run_dir, job, "sync") == "async"
    for fault in mine:
        claim_marker(run_dir, fault["id"], kind="storage")
    assert restart_checkpointing(plan, run_dir, job, "sync") == "sync"
    assert restart_checkpointing(plan, run_dir, job, "async") == "async"
    quiet = next(j for j in plan.jobs if j.checkpointing == "sync")
    assert restart_checkpointing(plan, run_dir, quiet, "sync") == "sync"


def test_claimed_since_names_the_faults_fired_after_a_time(tmp_path):
    run_dir = str(tmp_path)
    assert claimed_since(run_dir, 0.0) == []
    claim_marker(run_dir, "worker-000-b3", kind="kill_worker")
    claim_marker(run_dir, "worker-000-b3-handled")  # no fault: the driver's bookkeeping
    claim_marker(run_dir, "via-001-stop")
    assert claimed_since(run_dir, 0.0) == ["worker-000-b3"]
    assert claimed_since(run_dir, 4e9) == []


def _report() -> ChaosReport:
    return ChaosReport(seed=1, command="", batches=30, run_dir="/x")


def test_the_verdict_counts_modes_switches_and_discards():
    plan = make_plan(54, 30, 1, checkpoint_root="/x", checkpointing="mixed")
    events = [{"event": "query-start", "job": 0, "checkpointing": "sync"},
              {"event": "query-start", "job": 1, "checkpointing": "async"},
              {"event": "discard", "job": 1, "explained": True, "batches": [9, 10]},
              {"event": "query-start", "job": 1, "checkpointing": "async"},
              {"event": "query-start", "job": 1, "checkpointing": "sync"},
              {"event": "query-start", "job": 2, "checkpointing": "async"}]
    markers = {"async-006-b22": {"at": "kill-before-completion", "batch": 22,
                                 "spark_committed": True}}
    report = _report()
    _judge_checkpointing(plan, markers, events, report)
    assert report.failures == []
    cp = report.checkpointing
    assert cp["mode"] == "mixed" and cp["query_starts"] == {"sync": 2, "async": 3}
    assert cp["switches"] == {"async->sync:restart": 1, "sync->async:boundary": 2}
    assert (cp["discards"], cp["discarded_batches"], cp["unexplained_discards"]) == (1, 2, [])
    assert cp["kills_before_completion"] == [{"batch": 22, "spark_committed": True}]


def test_a_discard_no_fault_explains_and_a_kill_before_sparks_commit_fail_the_run():
    plan = make_plan(54, 30, 1, checkpoint_root="/x", checkpointing="async")
    events = [{"event": "query-start", "job": 0, "checkpointing": "async"},
              {"event": "discard", "job": 0, "explained": False, "batches": [4],
               "back_at": 3, "error": "subtasks [1] did not acknowledge"}]
    markers = {"async-000-b7": {"at": "kill-before-completion", "batch": 7,
                                "spark_committed": False}}
    report = _report()
    _judge_checkpointing(plan, markers, events, report)
    assert len(report.failures) == 2
    assert "1 discards of checkpoints in flight with no fault fired" in report.failures[0]
    assert "before Spark logged its batch as done (batches [7])" in report.failures[1]


def test_a_synchronous_run_reports_nothing_of_the_kind():
    report = _report()
    _judge_checkpointing(make_plan(54, 30, 1, checkpoint_root="/x"), {}, [], report)
    assert report.checkpointing == {} and report.failures == []
