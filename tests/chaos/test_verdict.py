"""The soak's verdict without Spark: how it judges the refused starts (the positions drill,
the rollback check) from the events a run logged."""

from __future__ import annotations

from typing import Any

import pytest

from keyedstate.testing.chaos.plan import Plan, make_plan, min_batches
from keyedstate.testing.chaos.runner import ChaosReport
from keyedstate.testing.chaos.verdict import _judge_boundaries

pytestmark = pytest.mark.chaos


def _plan() -> Plan:
    """Five jobs: job 1 ends with a positions drill, job 4 is a rollback."""
    plan = make_plan(11, min_batches(1), 1, rows_per_batch=10, keys=10, master="local[2]")
    assert [j.index for j in plan.jobs if j.positions_drill][0] == 1
    assert [j.index for j in plan.jobs if j.rollback] == [4]
    return plan


def _refusal_failures(plan: Plan, events: list[dict[str, Any]]) -> list[str]:
    report = ChaosReport(seed=plan.seed, command="", batches=plan.batches, run_dir="")
    _judge_boundaries(plan, "", events, report)
    return [f for f in report.failures
            if "drill" in f or ("rollback" in f and "batches" not in f)]


def test_a_refused_start_that_never_ran_or_left_something_fails_the_run():
    plan = _plan()
    assert _refusal_failures(plan, []) == [
        "the positions drill of job 1 never ran", "the positions drill of job 3 never ran",
        "the rollback check of job 4 never ran"]

    refused = {"outcome": "refused", "error": "", "left": [], "claimed": False,
               "violation": False}
    events = [{"event": "positions-drill", "job": 1, **refused},
              {"event": "positions-drill", "job": 3, "outcome": "started", "error": "",
               "left": ["a"], "claimed": True, "violation": True},
              {"event": "rollback-check", "job": 4, "outcome": "other-error",
               "error": "ValueError: " + "x" * 400, "left": [], "sinks_changed": True,
               "claimed": False, "violation": True}]
    assert _refusal_failures(plan, events) == [
        "positions drill of job 3: the savepoint without its context was started (), left "
        "['a'], claimed True",
        "rollback check of job 4 without on_rollback=branch: other-error (ValueError: "
        + "x" * 288 + "), left [], sinks changed True, claimed False"]
