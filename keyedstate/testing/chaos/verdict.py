"""The soak's verdict (step 4 of :func:`keyedstate.testing.chaos.runner.run_chaos`): the outputs and the
final state against the oracle, the ledger of sink commits, the drills, the checkpoint
directory checks, the faults injected and the time to recover from each, how each job ended,
the second job's output in the shared path, the resource bounds. Everything is read from the
run directory (``plan.json``, ``events.jsonl``, ``markers/``, ``out/``, ``second/``,
``final/``, ``ledger/``), so a kept run can be judged again.

Batch ids are Spark's: the oracle follows the plan's schedule (a drain is a batch of its own
that reads no file), so every batch's output, a drain's included, is compared row by row.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import TYPE_CHECKING, Any, Callable

from keyedstate.testing.chaos import compare
from keyedstate.testing.chaos import oracle as oracle_mod
from keyedstate.testing.chaos.boundary import EXPECTED_VIA, SECOND_DIR
from keyedstate.testing.chaos.driver import EVENTS_FILE, FINAL_DIR
from keyedstate.testing.chaos.plan import Branch, Plan
from keyedstate.testing.chaos.workload import (
    MARKERS_DIR,
    SECOND_JOB_COLUMN,
    SECOND_JOB_TAG,
    Definition,
)

if TYPE_CHECKING:
    from keyedstate.testing.chaos.runner import ChaosReport

#: Resource bounds (docs/reliability.md explains them).
#: executor JVM: its heap (local-cluster[E,C,M]: M MiB) + Spark's default memory overhead
#: (max(384 MiB, 10 %)), what a cluster manager would allow the container.
JVM_OVERHEAD_MIB = 384
#: Python worker: RocksDB's per-process budget (64 MiB block cache, memtables charged to it)
#: + the interpreter with pyarrow, pandas and the state of at most a few subtasks.
PYTHON_WORKER_BOUND_MIB = 64 + 448
#: working directories one dead driver's workers may leave (keyedstate does not remove a
#: killed or exited worker's RocksDB directories yet: docs/reliability.md, known issues); the
#: controller counts and removes them between drivers, and fails on runaway growth
LOCAL_DIRS_BOUND = 256


def read_events(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, EVENTS_FILE)
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by SIGKILL
    return out


def markers(run_dir: str) -> dict[str, dict[str, Any]]:
    directory = os.path.join(run_dir, MARKERS_DIR)
    out = {}
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.endswith(".json") and not name.endswith("-handled.json"):
                try:
                    with open(os.path.join(directory, name)) as f:
                        out[name[:-5]] = json.load(f)
                except (OSError, json.JSONDecodeError):
                    pass
    return out


def judge(plan: Plan, run_dir: str, report: ChaosReport, log: Callable[[str], None]) -> None:
    """Step 4 of :func:`run_chaos`."""
    if report.failures:
        return
    events = read_events(run_dir)
    found = markers(run_dir)
    generated = os.path.join(run_dir, "generated")
    # Exactly once: outputs and final state against the oracle.
    log("checking outputs and state against the oracle")
    branches = plan.branches()
    expected = oracle_mod.run_branches(generated, branches, plan.definitions())
    main = [r for o in expected for r in o.main]
    # The main output path is shared with the second job: its rows carry a column of their own.
    out_main, out_late = (os.path.join(run_dir, "out", name) for name in ("main", "late"))
    rows, second_rows = compare.split_jobs(compare.read_sink(out_main), SECOND_JOB_COLUMN,
                                              SECOND_JOB_TAG)
    late_rows = compare.read_sink(out_late)
    second_ids = {str(e.get("query_id")) for e in events if e.get("event") == "second-job"}
    lineages = {**compare.sink_lineages(out_late), **compare.sink_lineages(out_main)}
    if not lineages and len(rows):
        # A kept run of before the sink named batches by query id: one lineage, by batch id.
        branches = [Branch(0, None, -1, [j.index for j in plan.jobs], plan.schedule())]
        expected = oracle_mod.run_branches(generated, branches, plan.definitions())
        rows = rows.assign(_lineage="-")
        late_rows = late_rows.assign(_lineage="-") if len(late_rows) else late_rows
        lineages = {"-": ("", -1)}
    matched, problems = compare.match_branches(branches, lineages, second_ids)
    problems += compare.lineage_conflicts(out_main) + compare.lineage_conflicts(out_late)
    main_cmp, late_cmp = compare.Comparison(), compare.Comparison()
    per_branch = []
    for branch, outcome in zip(branches, expected):
        lineage = matched.get(branch.index)
        mine = rows[rows["_lineage"] == lineage] if len(rows) and lineage else rows.iloc[0:0]
        late_mine = (late_rows[late_rows["_lineage"] == lineage] if len(late_rows) and lineage
                     else late_rows.iloc[0:0])
        m = compare.compare_main(outcome.main, mine)
        lt = compare.compare_late(outcome.late, late_mine)
        main_cmp.add(m, f"branch {branch.index}: ")
        late_cmp.add(lt, f"branch {branch.index}: ")
        per_branch.append({"branch": branch.index, "lineage": lineage,
                           "parent": branch.parent, "fork_batch": branch.fork,
                           "jobs": branch.jobs,
                           "batches": [branch.batches[0][0], branch.batches[-1][0]],
                           "rows": len(mine), "late_rows": len(late_mine),
                           "violations": m.violations + lt.violations})
    # Rows of no branch of the plan (an unknown lineage) are unexpected.
    known = set(matched.values())
    for name, frame, cmp in (("main", rows, main_cmp), ("late", late_rows, late_cmp)):
        stray = frame[~frame["_lineage"].isin(known)] if len(frame) else frame
        if len(stray):
            cmp.actual += len(stray)
            cmp.unexpected += len(stray)
            cmp.note(f"{len(stray)} {name} rows of lineages no branch of the plan has: "
                     f"{sorted(set(stray['_lineage']))[:4]}")
    frames = {}
    final = os.path.join(run_dir, FINAL_DIR)
    import pandas as pd

    for name in list(compare.STATES) + ["timers"]:
        path = os.path.join(final, f"{name}.parquet")
        if os.path.exists(path):
            frames[name] = pd.read_parquet(path)
    # The final state is the last job's branch's.
    last = next(o for b, o in zip(branches, expected) if len(plan.jobs) - 1 in b.jobs)
    state_cmp = compare.compare_state(
        compare.expected_state(last.state),
        compare.actual_state(frames, plan.last_batch(), last.state.definition))
    ledger = _ledger_conflicts(run_dir)
    drills = [e for e in events if e.get("event") == "drill"]
    silent = [d for d in drills if d.get("violation")]
    violations = (main_cmp.violations + late_cmp.violations + state_cmp.violations
                  + len(ledger) + len(silent) + len(problems))
    drains = [b for b, f in plan.schedule() if f is None]
    report.exactly_once = {"violations": violations, "main_output": main_cmp.to_json(),
                           "late_events": late_cmp.to_json(), "ledger_conflicts": ledger,
                           "drill_violations": len(silent), "drain_batches": drains,
                           "drain_rows": sum(1 for r in main if r["batch_id"] in drains),
                           "branches": per_branch, "lineage_problems": problems}
    report.state = {**state_cmp.to_json(), "read_through": "SavepointReader (state processor API)",
                    "found": sorted(frames), "definition": last.state.definition}
    if not frames:
        report.failures.append("the final state was never read (no final/)")
    if violations:
        report.failures.append(f"{violations} exactly-once violations")
    _judge_second_job(plan, run_dir, events, main, rows, second_rows, report)
    # Faults injected, recoveries.
    _count_faults(plan, found, events, report)
    for kind, planned in report.planned.items():
        if report.injected.get(kind, 0) < planned:
            report.failures.append(f"{kind}: {report.injected.get(kind, 0)} of {planned} planned "
                                   f"faults were injected")
    # Drills.
    outcomes: dict[str, int] = {}
    for d in drills:
        outcomes[d["outcome"]] = outcomes.get(d["outcome"], 0) + 1
    report.drills = {"count": len(drills), "outcomes": outcomes,
                     "violations": [d for d in drills if d.get("violation")],
                     "all": [{k: d.get(k) for k in ("job", "target", "damage", "num_retained",
                                                     "batches", "outcome", "restored_checkpoint",
                                                     "checkpoint_id", "error", "names_file")}
                             for d in drills]}
    if silent:
        report.failures.append(f"{len(silent)} corruption drills restored wrong state silently "
                               f"or failed without a keyedstate error")
    _judge_boundaries(plan, run_dir, events, report)
    _judge_checkpointing(plan, found, events, report)
    # Checkpoint directories: after gc, nothing unreferenced, nothing missing.
    checks = [e for e in events if e.get("event") == "job-check"]
    orphans = sum(c.get("orphan_count", 0) for c in checks)
    missing = [m for c in checks for m in c.get("missing", [])]
    report.checkpoint_dirs = {
        "checks": len(checks), "orphans_after_gc": orphans, "referenced_but_missing": missing,
        "gc_collected_files": sum(c.get("gc_collected", 0) for c in checks),
        "max_files": max((c.get("files", 0) for c in checks), default=0),
        "max_referenced": max((c.get("referenced", 0) for c in checks), default=0),
        "max_bytes": max((c.get("bytes", 0) for c in checks), default=0),
        "max_files_sampled_all_dirs": report.memory.get("max", {}).get("checkpoint_files"),
        "max_bytes_sampled_all_dirs": report.memory.get("max", {}).get("checkpoint_bytes"),
    }
    if orphans:
        report.failures.append(f"{orphans} unreferenced files left in job directories after gc")
    if missing:
        report.failures.append(f"{len(missing)} referenced files missing or altered: {missing[:3]}")
    # Resource bounds.
    jvm_bound = _executor_heap_mib(plan.master) + JVM_OVERHEAD_MIB
    rss = report.memory.get("max_rss_mib", {})
    report.memory["bounds_mib"] = {"executor_jvm": jvm_bound,
                                   "python_worker": PYTHON_WORKER_BOUND_MIB}
    if rss.get("executor_jvm", 0) > jvm_bound:
        report.failures.append(f"an executor JVM reached {rss['executor_jvm']} MiB RSS "
                               f"(bound {jvm_bound} MiB)")
    if rss.get("python_worker", 0) > PYTHON_WORKER_BOUND_MIB:
        report.failures.append(f"a Python worker reached {rss['python_worker']} MiB RSS "
                               f"(bound {PYTHON_WORKER_BOUND_MIB} MiB)")
    if report.local_dirs.get("max_entries_between_drivers", 0) > LOCAL_DIRS_BOUND:
        report.failures.append(
            f"{report.local_dirs['max_entries_between_drivers']} working directories were left "
            f"by one dead driver (bound {LOCAL_DIRS_BOUND})")


def _judge_second_job(plan: Plan, run_dir: str, events: list[dict[str, Any]],
                      main: list[dict[str, Any]], rows: Any, second_rows: Any,
                      report: ChaosReport) -> None:
    """Two jobs, one output path: the second job's rows are exactly its own (against an
    oracle of its input), and the soak's rows were judged above; when the soak lost rows of
    the batch ids the second job used too, say so: a sink naming a batch's files by its
    batch id alone lets one job replace another's output (ParquetSink before 2d83c89)."""
    if not plan.second_job:
        return
    ran = [e for e in events if e.get("event") == "second-job"]
    if not ran:
        report.failures.append("the second job never ran")
        return
    spec = plan.second_job
    orc = oracle_mod.Oracle(os.path.join(run_dir, SECOND_DIR, "generated"))
    expected = orc.run(spec["files"])[0]
    cmp = compare.compare_main(expected, second_rows)
    batches = sorted({int(b) for b in ran[-1].get("batches", [])})
    want = {b: sum(1 for r in main if r["batch_id"] == b) for b in batches}
    got = {b: int((rows["batch_id"] == b).sum()) if len(rows) else 0 for b in batches}
    lost = {b: want[b] - got[b] for b in batches if got[b] < want[b]}
    report.shared_output = {"second_job": cmp.to_json(), "query_id": ran[-1].get("query_id"),
                            "second_job_batches": batches,
                            "soak_rows_lost_in_those_batches": lost}
    if cmp.violations:
        report.failures.append(f"the second job's output in the shared path: {cmp.violations} "
                               f"violations, {cmp.missing} rows missing (a later commit of the "
                               f"soak's batch of the same id replaces them where a sink names "
                               f"a batch's files by its id only): {cmp.examples[:2]}")
    if lost:
        report.failures.append(
            f"two jobs, one output path: the soak's batches {sorted(lost)} lost "
            f"{sum(lost.values())} rows where the second job committed its batches "
            f"{batches} (a sink naming a batch's files by its batch id alone, as ParquetSink "
            f"did before 2d83c89; counted in the exactly-once violations above)")


def _judge_boundaries(plan: Plan, run_dir: str, events: list[dict[str, Any]],
                      report: ChaosReport) -> None:
    """Every job ended as planned (its savepoint taken the planned way; a drain took the
    batch after the job's last one), and every positions drill was refused cleanly."""
    savepoints = {e["job"]: e for e in events if e.get("event") == "savepoint"}
    positions = {e["job"]: e for e in events if e.get("event") == "positions-drill"}
    boundaries = []
    for job in plan.jobs[:-1]:
        sp = savepoints.get(job.index, {})
        following = plan.jobs[job.index + 1]
        entry = {"job": job.index, "planned": job.stop + (f":{job.sink_at}" if job.sink_at
                                                          else ""),
                 "via": sp.get("via"), "format": job.savepoint_format,
                 "next_mode": following.restore_mode,
                 "fresh_location": following.spark_location != job.spark_location}
        if job.stop == "drain":
            entry["drain_batch"] = sp.get("drain_batch")
            if sp and sp.get("drain_batch") != plan.end_batch(job) + 1:
                report.failures.append(f"job {job.index}'s drain was batch "
                                       f"{sp.get('drain_batch')}, not "
                                       f"{plan.end_batch(job) + 1} (the batch after its last)")
        if job.stop == "crash":
            entry["carries_output"] = sp.get("carries_output")
        if sp and sp.get("via") != EXPECTED_VIA[job.stop]:
            report.failures.append(f"job {job.index} was to end by {job.stop}, its savepoint "
                                   f"was taken by {sp.get('via')}")
        if job.positions_drill:
            drill = positions.get(job.index)
            entry["positions_drill"] = drill.get("outcome") if drill else None
            _judge_refusal(report, drill, f"positions drill of job {job.index}",
                           ": the savepoint without its context was")
        boundaries.append(entry)
    # Rollbacks: refused without the option, nothing left; then a branch from the planned fork.
    checks = {e["job"]: e for e in events if e.get("event") == "rollback-check"}
    starts = [e for e in events if e.get("event") == "query-start"]
    for job in plan.jobs:
        if not job.rollback:
            continue
        check = checks.get(job.index)
        forks = {int(e["fork_batch_id"]) for e in starts
                 if e.get("job") == job.index and e.get("fork_batch_id") is not None}
        entry = boundaries[job.index - 1]
        entry["rollback"] = {"check": check.get("outcome") if check else None,
                             "fork_batches": sorted(forks)}
        _judge_refusal(report, check, f"rollback check of job {job.index}",
                       " without on_rollback=branch:")
        if forks != {plan.fork_batch(job)}:
            report.failures.append(f"job {job.index} rolled back to batches {sorted(forks)}, "
                                   f"planned {plan.fork_batch(job)}")
    report.boundaries = boundaries
    # Same-session restarts with a changed definition.
    redefined = sorted({int(e["after_file"]) for e in events if e.get("event") == "redefine"})
    report.definitions = {"planned_after_files": plan.redefine_after, "done_after_files": redefined,
                          "final": Definition.of(len(plan.redefine_after)).__dict__}
    if redefined != plan.redefine_after:
        report.failures.append(f"same-session restarts with a changed definition after files "
                               f"{redefined}, planned {plan.redefine_after}")
    report.drills["positions"] = {
        "count": len(positions),
        "refused": sum(1 for d in positions.values() if d.get("outcome") == "refused"
                       and not d.get("violation"))}


def _judge_refusal(report: ChaosReport, event: dict[str, Any] | None, drill: str,
                   refused: str) -> None:
    """A drill whose start must be refused, leaving nothing (``event``: what it logged, None:
    it never ran): a failure names the ``drill``, what had to be ``refused``, and what
    happened instead."""
    if event is None:
        report.failures.append(f"the {drill} never ran")
    elif event.get("violation"):
        sinks = (f", sinks changed {event['sinks_changed']}" if "sinks_changed" in event
                 else "")
        report.failures.append(
            f"{drill}{refused} {event.get('outcome')} ({event.get('error', '')[:300]}), left "
            f"{event.get('left')}{sinks}, claimed {event.get('claimed')}")


def _executor_heap_mib(master: str) -> int:
    if master.startswith("local-cluster["):
        return int(master[len("local-cluster["):-1].split(",")[2])
    return 1024


def _ledger_conflicts(run_dir: str) -> list[str]:
    """Batches committed twice with different rows (a consumer could have seen both)."""
    directory = os.path.join(run_dir, "ledger")
    seen: dict[tuple[str, str, int], str] = {}
    conflicts = []
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name)) as f:
                entry = json.load(f)
            k = (entry["output"], entry.get("lineage", ""), entry["batch_id"])
            if k in seen and seen[k] != entry["sha256"]:
                conflicts.append(f"{k[0]} output of batch {k[2]} of lineage {k[1] or '?'} "
                                 f"committed with different rows")
            seen.setdefault(k, entry["sha256"])
    return conflicts


def _kind_of(fault_id: str) -> str:
    return fault_id.split("-", 1)[0]


def _judge_checkpointing(plan: Plan, markers: dict[str, dict[str, Any]],
                         events: list[dict[str, Any]], report: ChaosReport) -> None:
    """How the jobs checkpointed (``report.checkpointing``): query starts per mode, the
    switches between consecutive starts (within a job: a restart; else a job boundary), the
    discards of batches in flight and what explains each (a fault fired during that query),
    and whether every driver kill before a checkpoint's completion came after Spark logged
    its batch as done (the rewind case). A discard no fault explains, or such a kill before
    Spark's log entry, fails the run."""
    if plan.checkpointing == "sync":
        return
    starts = [e for e in events if e.get("event") == "query-start"]
    per_mode: dict[str, int] = {}
    switches: dict[str, int] = {}
    for i, start in enumerate(starts):
        mode = str(start.get("checkpointing"))
        per_mode[mode] = per_mode.get(mode, 0) + 1
        if i and starts[i - 1].get("checkpointing") != mode:
            how = "restart" if starts[i - 1].get("job") == start.get("job") else "boundary"
            edge = f"{starts[i - 1].get('checkpointing')}->{mode}:{how}"
            switches[edge] = switches.get(edge, 0) + 1
    discards = [e for e in events if e.get("event") == "discard"]
    unexplained = [e for e in discards if not e.get("explained")]
    rewinds = [m for fid, m in markers.items()
               if fid.startswith("async-") and m.get("at") == "kill-before-completion"]
    report.checkpointing = {
        "mode": plan.checkpointing,
        "jobs": {mode: sum(1 for j in plan.jobs if j.checkpointing == mode)
                 for mode in ("sync", "async")},
        "query_starts": per_mode, "switches": dict(sorted(switches.items())),
        "discards": len(discards),
        "discarded_batches": sum(len(e.get("batches") or []) for e in discards),
        "unexplained_discards": [{k: e.get(k) for k in ("job", "batches", "back_at", "error")}
                                 for e in unexplained],
        "kills_before_completion": [{"batch": m.get("batch"),
                                     "spark_committed": m.get("spark_committed")}
                                    for m in rewinds]}
    if unexplained:
        shown = report.checkpointing["unexplained_discards"][:2]
        report.failures.append(
            f"{len(unexplained)} discards of checkpoints in flight with no fault fired in their "
            f"query (a checkpoint failed by itself): {shown}")
    early = [m for m in rewinds if m.get("spark_committed") is False]
    if early:
        report.failures.append(
            f"{len(early)} driver kills before a checkpoint's completion came before Spark "
            f"logged its batch as done (batches {[m.get('batch') for m in early]}): the rewind "
            f"case was not what ran")


def _count_faults(plan: Plan, markers: dict[str, dict[str, Any]], events: list[dict[str, Any]],
                  report: ChaosReport) -> None:
    kinds = plan.kinds()
    injected = {k: 0 for k in kinds}
    by_point: dict[str, int] = {}
    recover: dict[str, list[float]] = {k: [] for k in kinds}
    batch_events = sorted((e["time"], e["batch_id"]) for e in events if e.get("event") == "batch")
    for fid, marker in markers.items():
        kind = _kind_of(fid)
        if kind not in injected:
            continue
        injected[kind] += 1
        point = f"{kind}:{marker.get('at')}"
        by_point[point] = by_point.get(point, 0) + 1
        t0, batch = marker.get("time", 0.0), marker.get("batch")
        done = next((t for t, b in batch_events if b == batch and t > t0), None)
        if done is not None:
            recover[kind].append(done - t0)
    savepoints = [e for e in events if e.get("event") == "savepoint"]
    injected["savepoint"] = len(savepoints)
    job_starts = sorted((e["time"], e["job"]) for e in events if e.get("event") == "job-start")
    for sp in savepoints:
        # Stop with a savepoint, then from the next job's start to its first batch (the drill
        # and the directory check in between are the soak's, not the restart's).
        next_batch = plan.batch_of_file(plan.jobs[sp["job"]].end_file + 1)
        started = next((t for t, j in job_starts if j == sp["job"] + 1 and t > sp["time"]),
                       sp["time"])
        done = next((t for t, b in batch_events if b == next_batch and t > started), None)
        if done is not None:
            recover["savepoint"].append(sp.get("stop_s", 0.0) + done - started)
        mode = plan.jobs[sp["job"] + 1].restore_mode
        for point in (f"savepoint:{sp.get('format')}->{mode}", f"savepoint:via-{sp.get('via')}"):
            by_point[point] = by_point.get(point, 0) + 1
    report.injected = injected
    report.injected_by_point = dict(sorted(by_point.items()))
    report.recoveries = {
        kind: {"count": len(times), "median_s": round(statistics.median(times), 1) if times else None,
               "max_s": round(max(times), 1) if times else None}
        for kind, times in recover.items()}
