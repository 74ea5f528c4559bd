"""How a job of the soak ends (a *boundary*, :data:`keyedstate.testing.chaos.plan.STOPS`), the drills
on what it leaves, and the second job writing into the soak's output path.

:func:`end_job`, in the driver (:mod:`keyedstate.testing.chaos.driver`), for every job but the last:

1. The savepoint, as the plan says:

   - ``stop``: ``query.stop(savepoint=...)`` once every file of the job is processed;
   - ``drain``: ``query.stop(drain=True, savepoint=...)``: the drain is a batch of its own
     (every event-time timer fires), so every later file is read by the batch after its
     number (:meth:`keyedstate.testing.chaos.plan.Plan.schedule`);
   - ``sink``: taken from inside the sink commit of the job's last batch
     (:class:`~keyedstate.testing.chaos.driver.SinkSavepoint`); the query then just stops;
   - ``crash``: the driver was killed between the checkpoint commit and the sink commit of
     the job's last batch (:data:`~keyedstate.testing.chaos.driver_faults.BOUNDARY_CRASH`); the next driver
     takes the savepoint offline, with the CLI (``keyedstate savepoint create <job dir>
     <target>``), before any query runs: it carries the uncommitted output, which the next
     job commits when it starts.

   A savepoint that exists already was taken before a restart (or from the sink): it stands.
   How it was taken is recorded in a marker (:func:`~keyedstate.testing.chaos.driver.via_marker`),
   which the verdict holds against the plan.
2. The corruption drill on a copy of the job's directory (:mod:`keyedstate.testing.chaos.drills`),
   but after a drain (a drained job can't be started again: nothing to drill).
3. The positions drill, where the next job starts in a fresh Spark checkpoint location:
   the savepoint without its ``context/``, restored in yet another location, must be refused
   (:func:`keyedstate.testing.chaos.drills.positions_drill`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from typing import Any

from keyedstate.config import JobConfig, LateEvents
from keyedstate.testing.chaos import drills
from keyedstate.testing.chaos.driver import (
    build_job,
    check_job_dir,
    clear_unfinished_savepoint,
    log_event,
    run_job,
    via_marker,
)
from keyedstate.testing.chaos.driver_faults import DriverFaults, boundary_crash_id
from keyedstate.testing.chaos.plan import MAX_PARALLELISM, Job, Plan
from keyedstate.testing.chaos.workload import (
    INPUT_DDL,
    SECOND_OUTPUT_DDL,
    WATERMARK_DELAY_MS,
    SecondJobFunction,
    claim_marker,
    marker_path,
    publish_input,
    write_input,
)

#: how a job's savepoint may have been taken, as :func:`via_marker` records it
VIAS = ("stop", "drain", "sink", "cli")
#: what each job end must have used
EXPECTED_VIA = {"stop": "stop", "drain": "drain", "sink": "sink", "crash": "cli"}
#: the second job's directory in the run directory (input, Spark checkpoint location)
SECOND_DIR = "second"


def via_of(run_dir: str, job: Job) -> str | None:
    """How ``job``'s savepoint was taken (the first marker claimed), None if not yet."""
    found = [(os.path.getmtime(marker_path(run_dir, via_marker(job, v))), v) for v in VIAS
             if os.path.exists(marker_path(run_dir, via_marker(job, v)))]
    return min(found)[1] if found else None


def end_job(spark: Any, plan: Plan, run_dir: str, job: Job, progress: dict[str, Any],
            faults: DriverFaults) -> None:
    """Step 1-3 of the module docstring."""
    target = plan.savepoint_dir(job.index)

    def taken() -> bool:
        return clear_unfinished_savepoint(target, plan.storage_options)

    # Step 1.
    stopping = time.time()
    info: dict[str, Any] = {}
    if taken():
        pass
    elif job.stop == "crash" and os.path.exists(marker_path(run_dir,
                                                            boundary_crash_id(plan, job))):
        claim_marker(run_dir, via_marker(job, "cli"))
        info = offline_savepoint(plan, job, target)
    else:
        query = run_job(spark, plan, run_dir, job, progress, faults)
        stopping = time.time()
        if taken():  # from the sink
            query.stop()
        else:
            drain = job.stop == "drain"
            claim_marker(run_dir, via_marker(job, "drain" if drain else "stop"))
            query.stop(drain=drain, savepoint=target, format=job.savepoint_format)
            if drain:
                info["drain_batch"] = query.driver.last_batch_id
    following = plan.jobs[job.index + 1]
    log_event(run_dir, "savepoint", job=job.index, target=target, format=job.savepoint_format,
              planned=job.stop, via=via_of(run_dir, job), stop_s=time.time() - stopping,
              next_mode=following.restore_mode,
              fresh_location=following.spark_location != job.spark_location, **info)
    with faults.pause():
        # Step 2.
        if job.drill is not None and job.stop != "drain":
            result = drills.spark_drill(spark, plan, run_dir, job, build_job)
            log_event(run_dir, "drill", job=job.index, **result)
        # Step 3.
        if job.positions_drill:
            result = drills.positions_drill(spark, plan, run_dir, job, build_job)
            log_event(run_dir, "positions-drill", job=job.index, **result)


def offline_savepoint(plan: Plan, job: Job, target: str) -> dict[str, Any]:
    """``keyedstate savepoint create <job dir> <target>``, as an operator runs it after the
    driver died; what the savepoint covers and whether it carries output."""
    from keyedstate.checkpoint.resolve import resolve_snapshot

    args = [sys.executable, "-c", "from keyedstate.cli import main; main()", "savepoint",
            "create", plan.job_dir(job.index), target, "--format", job.savepoint_format,
            "--json"]
    if plan.storage_options:
        args += ["--storage-options", json.dumps(plan.storage_options)]
    started = time.time()
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"keyedstate savepoint create failed ({done.returncode}): "
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    props = resolve_snapshot(target, plan.storage_options).metadata.properties
    return {"cli_s": time.time() - started, "batch_id": int(props.get("batch_id", -1)),
            "carries_output": "staged" in props}


def run_second_job(spark: Any, plan: Plan, run_dir: str, faults: DriverFaults) -> None:
    """The second job (``plan.second_job``): a small keyed job, fault-free, with its own
    checkpoint directory and Spark checkpoint location (batch ids from 0), writing into the
    soak's main output path; its rows carry a column of their own
    (:class:`~keyedstate.testing.chaos.workload.SecondJobFunction`)."""
    from keyedstate.spark.api import key_by
    from keyedstate.spark.sinks import ParquetSink

    spec = plan.second_job
    assert spec is not None
    base = os.path.join(run_dir, SECOND_DIR)
    generated = os.path.join(base, "generated")
    write_input(generated, spec["seed"], spec["files"], spec["rows"], spec["keys"])
    input_dir = os.path.join(base, "input")
    publish_input(generated, input_dir, spec["files"] - 1)
    events = (spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1)
              .parquet(input_dir))
    keyed = key_by(events, "key").process(SecondJobFunction(), SECOND_OUTPUT_DDL)
    keyed.sink(ParquetSink(os.path.join(run_dir, "out", "main")))
    cfg = JobConfig(checkpoint_dir=plan.second_job_dir(), backend=plan.backend,
                    parallelism=spec["parallelism"], max_parallelism=MAX_PARALLELISM,
                    watermark_column="ts",
                    watermark_delay=dt.timedelta(milliseconds=WATERMARK_DELAY_MS),
                    late_events=LateEvents.SIDE_OUTPUT, local_dir=os.path.join(run_dir, "local"),
                    storage_options=plan.storage_options)
    started = time.time()
    with faults.pause():
        query = keyed.start(cfg, spark_checkpoint_location=os.path.join(base, "spark"),
                            trigger={"availableNow": True})
        query.await_termination()
        query.stop()
        check = check_job_dir(plan, plan.second_job_dir())
    log_event(run_dir, "second-job", query_id=query.driver.query_id(),
              batches=[s.batch_id for s in query.stats if not s.skipped_replay],
              rows_out=sum(s.rows_out for s in query.stats), seconds=time.time() - started)
    log_event(run_dir, "job-check", job="second", **check)
