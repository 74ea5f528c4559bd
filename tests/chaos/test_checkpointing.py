"""How the soak's jobs checkpoint (``--checkpointing``), without Spark: the mode a restarted
driver takes, and the verdict on the modes, their switches and the discards of checkpoints in
flight (``verdict._judge_checkpointing``); on Spark: why the soak with asynchronous jobs never
compacts its input's file-source log (``driver.session_conf``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyedstate.spark.offsets import OffsetLog, rewind
from keyedstate.testing.chaos.driver import (
    SOURCE_LOG_COMPACT_INTERVAL,
    claimed_since,
    restart_checkpointing,
    session_conf,
)
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


def _batches_around_a_rewind(spark: Any, base: Path, conf: dict[str, str]) -> dict[int, list[int]]:
    """The input files (one row each, its number) of the batches a query over 11 files (one
    file per batch) reads under ``conf``'s file-source log setting, once to the end and again
    after :func:`rewind` to batch 7, as an asynchronous job's restart rewinds: what the second
    query reads, per batch id."""
    inputs, location = base / "input", str(base / "spark")
    inputs.mkdir(parents=True)
    for k in range(11):
        path = inputs / f"part-{k:05d}.parquet"
        pq.write_table(pa.table({"x": [k]}), path)
        os.utime(path, (1_600_000_000 + k, 1_600_000_000 + k))  # the source's order

    def run() -> dict[int, list[int]]:
        read: dict[int, list[int]] = {}

        def record(df: Any, batch_id: int) -> None:
            read[batch_id] = sorted(r.x for r in df.collect())

        query = (spark.readStream.schema("x long").option("maxFilesPerTrigger", 1)
                 .parquet(str(inputs)).writeStream.foreachBatch(record)
                 .option("checkpointLocation", location).trigger(availableNow=True).start())
        query.awaitTermination()
        return read

    interval = conf.get(SOURCE_LOG_COMPACT_INTERVAL)
    if interval is not None:
        spark.conf.set(SOURCE_LOG_COMPACT_INTERVAL, interval)
    try:
        assert run() == {b: [b] for b in range(11)}
        assert rewind(OffsetLog.at(location), 7) == [8, 9, 10]
        return run()
    finally:
        spark.conf.unset(SOURCE_LOG_COMPACT_INTERVAL)


@pytest.mark.spark
def test_with_async_jobs_a_rewind_replans_one_input_file_per_batch(spark, tmp_path):
    """By default Spark compacts the file source's log every 10 entries: the rewind keeps
    ``sources/0/9.compact`` (it holds the entries before it), so the re-planned batch 9 reads
    input files 9 and 10 together, each once, as docs/checkpoints.md says; the soak's oracle,
    one file per planned batch, would judge every later batch off by one file (the mixed
    soak of seed 54 reported 9,602 violations). The soak's session with asynchronous jobs
    never compacts: batches 8-10 read their files again one by one. A synchronous plan keeps
    Spark's default."""
    sync = make_plan(54, 30, 1, checkpoint_root="/x")
    assert SOURCE_LOG_COMPACT_INTERVAL not in session_conf(sync, str(tmp_path))
    merged = _batches_around_a_rewind(spark, tmp_path / "default", {})
    assert merged == {8: [8], 9: [9, 10]}
    mixed = make_plan(54, 30, 1, checkpoint_root="/x", checkpointing="mixed")
    soak = _batches_around_a_rewind(spark, tmp_path / "soak", session_conf(mixed, str(tmp_path)))
    assert soak == {8: [8], 9: [9], 10: [10]}
