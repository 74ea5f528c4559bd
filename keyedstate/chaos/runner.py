"""The soak's controller: start the driver, let it be killed, start it again, then judge.

:func:`run_chaos` (what ``keyedstate chaos`` runs):

1. Draw the plan from the seed (:mod:`keyedstate.chaos.plan`) and write the input.
2. Start the driver (:mod:`keyedstate.chaos.driver`) as a subprocess. When it dies by SIGKILL
   at a planned point, start it again at the plan's next parallelism; any other failure, or
   no progress for ``stall_timeout`` seconds, ends the run as failed. Between two drivers
   (nothing runs): every process of the dead one must be gone (stragglers are killed by pid
   and counted), and the leftovers in the working directories are measured.
3. Meanwhile sample every process's RSS and the size of the checkpoint and working
   directories (:mod:`keyedstate.chaos.resources`).
4. At the end: the outputs and the final state against the oracle, the ledger of sink commits,
   the drills, the job-directory checks, the resource bounds; a report (:class:`ChaosReport`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from keyedstate.chaos import oracle as oracle_mod
from keyedstate.chaos.driver import EVENTS_FILE, FINAL_DIR
from keyedstate.chaos.plan import KINDS, Plan, make_plan
from keyedstate.chaos.resources import (
    MiB,
    ProcessSampler,
    become_subreaper,
    dir_stats,
    reap_tree,
)
from keyedstate.chaos.workload import MARKERS_DIR, PLAN_FILE, write_input

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


@dataclass
class ChaosConfig:
    batches: int = 500
    seed: int | None = None
    master: str = "local-cluster[2,1,1024]"
    faults_per_kind: int | None = None
    rows_per_batch: int = 120
    keys: int = 400
    backend: str = "rocksdb"
    s3: bool = False
    run_dir: str | None = None
    keep: bool = False
    stall_timeout: float = 900.0

    def resolved_faults(self) -> int:
        return self.faults_per_kind if self.faults_per_kind is not None \
            else max(1, self.batches // 10)


@dataclass
class ChaosReport:
    seed: int
    command: str
    batches: int
    run_dir: str
    passed: bool = False
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    drivers_started: int = 0
    planned: dict[str, int] = field(default_factory=dict)
    injected: dict[str, int] = field(default_factory=dict)
    injected_by_point: dict[str, int] = field(default_factory=dict)
    recoveries: dict[str, Any] = field(default_factory=dict)
    exactly_once: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    drills: dict[str, Any] = field(default_factory=dict)
    checkpoint_dirs: dict[str, Any] = field(default_factory=dict)
    local_dirs: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    processes: dict[str, Any] = field(default_factory=dict)
    #: which keyedstate ran (its location, and git's HEAD and changed files when a checkout)
    code: dict[str, Any] = field(default_factory=dict)

    @property
    def violations(self) -> int:
        return int(self.exactly_once.get("violations", 0))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _code_version() -> dict[str, Any]:
    import keyedstate

    package = os.path.dirname(os.path.abspath(keyedstate.__file__))
    out: dict[str, Any] = {"package": package}
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", package, *args], capture_output=True,
                                  text=True, timeout=30, check=True).stdout.strip()

        out["head"] = git("rev-parse", "HEAD")
        out["changed_files"] = len(git("status", "--porcelain").splitlines())
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_s3_server(log: Callable[[str], None]) -> tuple[subprocess.Popen[bytes], str, dict[str, Any]]:
    """A local S3 server (moto) on loopback and a fresh bucket: (process, root URL, options)."""
    import boto3

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the local S3 server (moto) did not start") from None
            time.sleep(0.2)
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(name, value)
    bucket = f"chaos-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing"
                 ).create_bucket(Bucket=bucket)
    log(f"local S3 server (moto) at {endpoint}, bucket {bucket}")
    return proc, f"s3://{bucket}/chaos", {"key": "testing", "secret": "testing",
                                          "client_kwargs": {"endpoint_url": endpoint}}


def _read_events(run_dir: str) -> list[dict[str, Any]]:
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


def _markers(run_dir: str) -> dict[str, dict[str, Any]]:
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


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _spark_work_dir() -> str | None:
    try:
        import pyspark
    except ImportError:
        return None
    return os.path.join(os.path.dirname(pyspark.__file__), "work")


def _clean_dir(path: str) -> tuple[int, int]:
    """Count (entries, bytes) under ``path``, then empty it."""
    if not os.path.isdir(path):
        return 0, 0
    entries = os.listdir(path)
    _, size = dir_stats(path)
    for entry in entries:
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.remove(full)
            except OSError:
                pass
    return len(entries), size


def run_chaos(config: ChaosConfig, log: Callable[[str], None] = print) -> ChaosReport:
    """Run the soak (module docstring) and return its report (also ``report.json``)."""
    seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(4), "big")
    faults = config.resolved_faults()
    command = (f"keyedstate chaos --batches {config.batches} --seed {seed} --master "
               f"'{config.master}' --faults-per-kind {faults}"
               + (" --s3" if config.s3 else "") + (f" --backend {config.backend}"
                                                   if config.backend != "rocksdb" else ""))
    log(f"chaos seed {seed} (replay: {command})")
    run_dir = os.path.abspath(config.run_dir or tempfile.mkdtemp(prefix="keyedstate-chaos-"))
    if os.path.exists(run_dir) and os.listdir(run_dir):
        raise FileExistsError(f"{run_dir} is not empty; the soak needs a fresh run directory")
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    report = ChaosReport(seed, command, config.batches, run_dir)
    report.code = _code_version()
    started = time.time()
    s3 = None
    try:
        if config.s3:
            s3, root, options = start_s3_server(log)
        else:
            root, options = os.path.join(run_dir, "ckpt"), {}
        plan = make_plan(seed, config.batches, faults, rows_per_batch=config.rows_per_batch,
                         keys=config.keys, master=config.master, backend=config.backend,
                         checkpoint_root=root, storage_options=options)
        with open(os.path.join(run_dir, PLAN_FILE), "w") as f:
            json.dump(plan.to_json(), f, indent=1)
        report.planned = plan.planned_counts()
        log(f"plan: {len(plan.jobs)} jobs, faults {report.planned}")
        write_input(os.path.join(run_dir, "generated"), seed, config.batches,
                    config.rows_per_batch, config.keys)
        exclude = {s3.pid} if s3 is not None else set()
        _drive(config, plan, run_dir, report, exclude, log)
        _judge(plan, run_dir, report, log)
    except Exception as exc:  # noqa: BLE001 - a failed run still reports
        report.failures.append(f"the soak itself failed: {type(exc).__name__}: {exc}")
    finally:
        if s3 is not None:
            s3.terminate()
            try:
                s3.wait(timeout=10)
            except subprocess.TimeoutExpired:
                s3.kill()
    report.seconds = round(time.time() - started, 1)
    report.passed = not report.failures
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        json.dump(report.to_json(), f, indent=2, default=str)
    if report.passed and not config.keep:
        for name in ("ckpt", "input", "local", "spark-local", "spark-offsets", "drills"):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    return report


def _drive(config: ChaosConfig, plan: Plan, run_dir: str, report: ChaosReport,
           exclude: set[int], log: Callable[[str], None]) -> None:
    """Step 2 and 3 of :func:`run_chaos`: drivers until the plan is done."""
    become_subreaper()
    me = os.getpid()
    local = os.path.join(run_dir, "local")
    spark_local = os.path.join(run_dir, "spark-local")
    os.makedirs(local, exist_ok=True)
    os.makedirs(spark_local, exist_ok=True)
    local_root = plan.checkpoint_root if "://" not in plan.checkpoint_root else None
    extra: dict[str, Callable[[], int]] = {
        "local_dir_entries": lambda: len(os.listdir(local)),
        "local_dir_bytes": lambda: dir_stats(local)[1],
    }
    if local_root is not None:
        extra["checkpoint_files"] = lambda: dir_stats(local_root)[0]
        extra["checkpoint_bytes"] = lambda: dir_stats(local_root)[1]
    sampler = ProcessSampler(me, exclude=exclude, extra=extra)
    sampler.start()
    env = {**os.environ, "SPARK_LOCAL_DIRS": spark_local,
           "PYTHONPATH": os.pathsep.join(p for p in [os.environ.get("PYTHONPATH", ""),
                                                     *sys.path] if p)}
    quiescent: list[dict[str, Any]] = []
    stragglers: list[dict[str, Any]] = []
    parallelism: int | None = None
    work_dir = _spark_work_dir()
    try:
        while True:
            n = report.drivers_started
            report.drivers_started += 1
            args = [sys.executable, "-m", "keyedstate.chaos.driver", run_dir]
            if parallelism is not None:
                args += ["--parallelism", str(parallelism)]
            log_path = os.path.join(run_dir, "logs", f"driver-{n:03d}.log")
            markers_before = set(_markers(run_dir))
            with open(log_path, "wb") as out:
                proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                        cwd=run_dir)
                rc = _wait(proc, run_dir, config.stall_timeout)
            # Between two drivers: nothing may survive the dead one.
            left = reap_tree(me, exclude | {proc.pid})
            stragglers += left
            entries, size = _clean_dir(local)
            quiescent.append({"driver": n, "rc": rc, "local_dir_entries": entries,
                              "local_dir_bytes": size, "stragglers": len(left)})
            _clean_dir(spark_local)
            if work_dir:
                for event in _read_events(run_dir):
                    if event.get("event") == "driver-start" and event.get("app_id"):
                        shutil.rmtree(os.path.join(work_dir, event["app_id"]),
                                      ignore_errors=True)
            events = _read_events(run_dir)
            batches_done = max((e["batch_id"] for e in events if e.get("event") == "batch"),
                               default=-1)
            log(f"driver {n} exited ({rc}); batches done up to {batches_done}; "
                f"{len(_markers(run_dir))} faults injected")
            if rc == 0:
                break
            new = set(_markers(run_dir)) - markers_before
            killed = [m for m in new if _markers(run_dir)[m].get("kind") == "kill_driver"]
            if rc == -signal.SIGKILL and killed:
                # Driver restarts take the plan's parallelisms from the end (aborted
                # batches take them from the start).
                choices = plan.restart_parallelism
                parallelism = choices[-(report.drivers_started % len(choices)) - 1]
                continue
            report.failures.append(
                f"driver {n} failed unexpectedly (exit {rc}); log {log_path}:\n{_tail(log_path)}")
            return
    finally:
        sampler.stop()
        report.memory = sampler.to_json()
        report.memory["timeline_mib"] = [
            {"t": round(t - sampler.timeline[0][0]), **{k: round(v / MiB) for k, v in tot.items()}}
            for t, tot in sampler.timeline] if sampler.timeline else []
        report.local_dirs = {
            "max_entries_between_drivers": max((q["local_dir_entries"] for q in quiescent),
                                               default=0),
            "total_left_by_dead_drivers": sum(q["local_dir_entries"] for q in quiescent),
            "bytes_left_by_dead_drivers": sum(q["local_dir_bytes"] for q in quiescent),
            "per_driver": quiescent,
        }
        report.processes = {"stragglers": stragglers}


def _wait(proc: subprocess.Popen[bytes], run_dir: str, stall_timeout: float) -> int:
    """Wait for the driver; kill it (and count it as a failure) when nothing happened for
    ``stall_timeout`` seconds."""
    events = os.path.join(run_dir, EVENTS_FILE)
    last = time.monotonic()
    size = -1
    while True:
        try:
            return proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        now_size = os.path.getsize(events) if os.path.exists(events) else 0
        if now_size != size:
            size, last = now_size, time.monotonic()
        elif time.monotonic() - last > stall_timeout:
            proc.kill()
            proc.wait()
            return -999


def _judge(plan: Plan, run_dir: str, report: ChaosReport, log: Callable[[str], None]) -> None:
    """Step 4 of :func:`run_chaos`."""
    if report.failures:
        return
    events = _read_events(run_dir)
    markers = _markers(run_dir)
    generated = os.path.join(run_dir, "generated")
    # Exactly once: outputs and final state against the oracle.
    log("checking outputs and state against the oracle")
    orc = oracle_mod.Oracle(generated)
    main, late = orc.run(plan.batches)
    main_cmp = oracle_mod.compare_main(main, os.path.join(run_dir, "out", "main"))
    late_cmp = oracle_mod.compare_late(late, os.path.join(run_dir, "out", "late"))
    frames = {}
    final = os.path.join(run_dir, FINAL_DIR)
    import pandas as pd

    for name in list(oracle_mod.STATES) + ["timers"]:
        path = os.path.join(final, f"{name}.parquet")
        if os.path.exists(path):
            frames[name] = pd.read_parquet(path)
    state_cmp = oracle_mod.compare_state(oracle_mod.expected_state(orc.state),
                                         oracle_mod.actual_state(frames, plan.batches - 1))
    ledger = _ledger_conflicts(run_dir)
    drills = [e for e in events if e.get("event") == "drill"]
    silent = [d for d in drills if d.get("violation")]
    violations = (main_cmp.violations + late_cmp.violations + state_cmp.violations
                  + len(ledger) + len(silent))
    report.exactly_once = {"violations": violations, "main_output": main_cmp.to_json(),
                           "late_events": late_cmp.to_json(), "ledger_conflicts": ledger,
                           "drill_violations": len(silent)}
    report.state = {**state_cmp.to_json(), "read_through": "SavepointReader (state processor API)",
                    "found": sorted(frames)}
    if not frames:
        report.failures.append("the final state was never read (no final/)")
    if violations:
        report.failures.append(f"{violations} exactly-once violations")
    # Faults injected, recoveries.
    _count_faults(plan, markers, events, report)
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


def _executor_heap_mib(master: str) -> int:
    if master.startswith("local-cluster["):
        return int(master[len("local-cluster["):-1].split(",")[2])
    return 1024


def _ledger_conflicts(run_dir: str) -> list[str]:
    """Batches committed twice with different rows (a consumer could have seen both)."""
    directory = os.path.join(run_dir, "ledger")
    seen: dict[tuple[str, int], str] = {}
    conflicts = []
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name)) as f:
                entry = json.load(f)
            k = (entry["output"], entry["batch_id"])
            if k in seen and seen[k] != entry["sha256"]:
                conflicts.append(f"{k[0]} output of batch {k[1]} committed with different rows")
            seen.setdefault(k, entry["sha256"])
    return conflicts


def _kind_of(fault_id: str) -> str:
    return fault_id.split("-", 1)[0]


def _count_faults(plan: Plan, markers: dict[str, dict[str, Any]], events: list[dict[str, Any]],
                  report: ChaosReport) -> None:
    injected = {k: 0 for k in KINDS}
    by_point: dict[str, int] = {}
    recover: dict[str, list[float]] = {k: [] for k in KINDS}
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
        next_batch = plan.jobs[sp["job"]].end_batch + 1
        started = next((t for t, j in job_starts if j == sp["job"] + 1 and t > sp["time"]),
                       sp["time"])
        done = next((t for t, b in batch_events if b == next_batch and t > started), None)
        if done is not None:
            recover["savepoint"].append(sp.get("stop_s", 0.0) + done - started)
        mode = plan.jobs[sp["job"] + 1].restore_mode
        point = f"savepoint:{sp.get('format')}->{mode}"
        by_point[point] = by_point.get(point, 0) + 1
    report.injected = injected
    report.injected_by_point = dict(sorted(by_point.items()))
    report.recoveries = {
        kind: {"count": len(times), "median_s": round(statistics.median(times), 1) if times else None,
               "max_s": round(max(times), 1) if times else None}
        for kind, times in recover.items()}
