"""The soak's controller: start the driver, let it be killed, start it again, then judge.

:func:`run_chaos` (what ``keyedstate chaos`` runs):

1. Draw the plan from the seed (:mod:`keyedstate.testing.chaos.plan`) and write the input.
2. Start the driver (:mod:`keyedstate.testing.chaos.driver`) as a subprocess. When it dies by SIGKILL
   at a planned point, start it again at the plan's next parallelism; any other failure, or
   no progress for ``stall_timeout`` seconds, ends the run as failed. Between two drivers
   (nothing runs): every process of the dead one must be gone (stragglers are killed by pid
   and counted), and the leftovers in the working directories are measured.
3. Meanwhile sample every process's RSS and the size of the checkpoint and working
   directories (:mod:`keyedstate.testing.chaos.resources`).
4. At the end, the verdict (:mod:`keyedstate.testing.chaos.verdict`): the outputs and the final state
   against the oracle, the ledger of sink commits, the drills, the job-directory checks, the
   resource bounds; a report (:class:`ChaosReport`, also ``report.json``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from keyedstate.testing.chaos.boundary import SECOND_DIR
from keyedstate.testing.chaos.driver import EVENTS_FILE
from keyedstate.testing.chaos.plan import Plan, make_plan
from keyedstate.testing.chaos.resources import (
    MiB,
    ProcessSampler,
    become_subreaper,
    dir_stats,
    reap_tree,
)
from keyedstate.testing.chaos.verdict import judge, markers, read_events
from keyedstate.testing.chaos.workload import PLAN_FILE, write_input
from keyedstate.testing.s3 import start_moto_server


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
    #: how the jobs checkpoint: ``sync``, ``async`` or ``mixed`` (``plan.CHECKPOINTING``)
    checkpointing: str = "sync"

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
    #: the edges the plan draws: storage points, how jobs end, fresh Spark locations,
    #: positions drills, the second job; the asynchronous phase's points and modes
    planned_points: dict[str, int] = field(default_factory=dict)
    #: why the plan draws fewer faults than asked (``Plan.notes``)
    plan_notes: list[str] = field(default_factory=list)
    #: how the jobs checkpointed: the mode, query starts per mode, switches between modes,
    #: discards of batches in flight (asynchronous mode; ``verdict._judge_checkpointing``)
    checkpointing: dict[str, Any] = field(default_factory=dict)
    injected: dict[str, int] = field(default_factory=dict)
    injected_by_point: dict[str, int] = field(default_factory=dict)
    recoveries: dict[str, Any] = field(default_factory=dict)
    exactly_once: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    drills: dict[str, Any] = field(default_factory=dict)
    #: how each job ended, against the plan
    boundaries: list[dict[str, Any]] = field(default_factory=list)
    #: the second job's output in the soak's output path
    shared_output: dict[str, Any] = field(default_factory=dict)
    #: same-session restarts with a changed definition, planned and done, and the final one
    definitions: dict[str, Any] = field(default_factory=dict)
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


def start_s3_server(log: Callable[[str], None]) -> tuple[subprocess.Popen[bytes], str, dict[str, Any]]:
    """A local S3 server (moto) on loopback and a fresh bucket: (process, root URL, options)."""
    import boto3

    proc, endpoint = start_moto_server()
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


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _spark_work_dir() -> str | None:
    # Found, not imported: only keyedstate.spark imports pyspark.
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        return None
    return os.path.join(os.path.dirname(spec.origin), "work")


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
                                                   if config.backend != "rocksdb" else "")
               + (f" --checkpointing {config.checkpointing}"
                  if config.checkpointing != "sync" else ""))
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
                         checkpoint_root=root, storage_options=options,
                         checkpointing=config.checkpointing)
        with open(os.path.join(run_dir, PLAN_FILE), "w") as f:
            json.dump(plan.to_json(), f, indent=1)
        report.planned = plan.planned_counts()
        report.planned_points = plan.planned_points()
        report.plan_notes = list(plan.notes)
        log(f"plan: {len(plan.jobs)} jobs, faults {report.planned}, edges "
            f"{report.planned_points}")
        for note in plan.notes:
            log(f"plan note: {note}")
        write_input(os.path.join(run_dir, "generated"), seed, config.batches,
                    config.rows_per_batch, config.keys)
        exclude = {s3.pid} if s3 is not None else set()
        _drive(config, plan, run_dir, report, exclude, log)
        judge(plan, run_dir, report, log)
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
        locations = {job.spark_location for job in plan.jobs}
        for name in ("ckpt", "input", "local", "spark-local", "drills", SECOND_DIR,
                     *locations):
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
    checkpointing: str | None = None
    work_dir = _spark_work_dir()
    try:
        while True:
            n = report.drivers_started
            report.drivers_started += 1
            args = [sys.executable, "-m", "keyedstate.testing.chaos.driver", run_dir]
            if parallelism is not None:
                args += ["--parallelism", str(parallelism)]
            if checkpointing is not None:
                args += ["--checkpointing", checkpointing]
            log_path = os.path.join(run_dir, "logs", f"driver-{n:03d}.log")
            markers_before = set(markers(run_dir))
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
                for event in read_events(run_dir):
                    if event.get("event") == "driver-start" and event.get("app_id"):
                        shutil.rmtree(os.path.join(work_dir, event["app_id"]),
                                      ignore_errors=True)
            events = read_events(run_dir)
            batches_done = max((e["batch_id"] for e in events if e.get("event") == "batch"),
                               default=-1)
            log(f"driver {n} exited ({rc}); batches done up to {batches_done}; "
                f"{len(markers(run_dir))} faults injected")
            if rc == 0:
                break
            new = set(markers(run_dir)) - markers_before
            killed = [m for m in new if markers(run_dir)[m].get("kind") == "kill_driver"]
            if rc == -signal.SIGKILL and killed:
                # Driver restarts take the plan's parallelisms from the end (aborted
                # batches take them from the start).
                choices = plan.restart_parallelism
                parallelism = choices[-(report.drivers_started % len(choices)) - 1]
                modes = plan.restart_checkpointing  # mixed: drawn per restarted driver
                if modes:
                    checkpointing = modes[-(report.drivers_started % len(modes)) - 1]
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
