"""Helpers of the chaos tests: a reference Spark job of the soak's workload, without faults."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from keyedstate.testing.chaos.driver import DriverFaults, run_job
from keyedstate.testing.chaos.plan import Job, Plan, make_plan
from keyedstate.testing.chaos.workload import PLAN_FILE, write_input


def reference_run(spark: Any, run_dir: str, batches: int, *, num_retained: int,
                  parallelism: int = 2, drill: dict[str, Any] | None = None
                  ) -> tuple[Plan, Job]:
    """The soak's job over ``batches`` batches, no faults, one job; returns its plan."""
    plan = make_plan(11, batches, 0, rows_per_batch=60, keys=80, master="local[2,4]",
                     checkpoint_root=os.path.join(run_dir, "ckpt"))
    job = plan.jobs[0]
    job.num_retained, job.parallelism, job.drill = num_retained, parallelism, drill
    with open(os.path.join(run_dir, PLAN_FILE), "w") as f:
        json.dump(plan.to_json(), f)
    write_input(os.path.join(run_dir, "generated"), plan.seed, batches, plan.rows_per_batch,
                plan.keys)
    progress = {"job": 0, "restarts": 0, "parallelism": None}
    query = run_job(spark, plan, run_dir, job, progress, DriverFaults(run_dir, plan))
    query.stop()
    return plan, job


@pytest.fixture
def run_dir(tmp_path: Any) -> str:
    return str(tmp_path)
