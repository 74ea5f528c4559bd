"""The soak's schedule, drawn from one seed: jobs (savepoint restarts), faults, drills.

Everything random in a run is chosen here, up front, by ``random.Random(seed)``, and written to
``plan.json``; the driver and the executors only read it. Re-running with the same seed
replays the same faults at the same batches (only wall-clock timings differ).

Fault kinds (at most one per batch; ``faults_per_kind`` of each):

``worker``    SIGKILL of the Python worker running a subtask, mid-batch or mid-upload;
``executor``  SIGKILL of that worker's executor JVM, mid-batch or mid-upload;
``driver``    SIGKILL of the driver (the Spark application), at one of :data:`DRIVER_POINTS`:
              from an executor mid-batch or mid-upload, or in the driver after each step of
              the checkpoint commit, around the sink commit, before the staging clean-up;
``abort``     an aborted checkpoint: a subtask that fails every attempt, or a ``_metadata``
              write that fails (step 3 of the commit); the query restarts in the same driver;
``savepoint`` stop with a savepoint and start a new job from it, in a restore mode, at a
              random parallelism (every job boundary is one).

After every driver restart and every aborted batch the job runs at a new random parallelism
(rescaling from its own checkpoints). A corruption drill runs at each job boundary on a copy
of the job's checkpoint directory (:mod:`keyedstate.chaos.drills`).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from keyedstate.checkpoint.storage import CheckpointStorage

MODES = ("NO_CLAIM", "CLAIM", "LEGACY")
#: where the driver dies (``driver`` faults)
DRIVER_POINTS = ("process", "upload", "commit-step-1", "commit-step-2", "commit-step-3",
                 "commit-step-4", "commit-step-5", "commit-step-6", "sink-before", "sink-mid",
                 "sink-after", "staging-cleanup")
EXECUTOR_SIDE = ("process", "upload")
ABORTS = ("task-fails", "metadata-write")
DRILL_TARGETS = ("shared", "private", "metadata")
DRILL_DAMAGE = ("truncate", "flip", "delete")
KINDS = ("worker", "executor", "driver", "abort", "savepoint")
MAX_PARALLELISM = 128


@dataclass
class Job:
    """One job of the run: batches up to ``end_batch``, started from the previous job's
    savepoint (none for job 0)."""

    index: int
    end_batch: int
    parallelism: int
    num_retained: int
    restore_mode: str | None
    #: the format of the savepoint this job stops with
    savepoint_format: str = "native"
    drill: dict[str, Any] | None = None


@dataclass
class Plan:
    seed: int
    batches: int
    rows_per_batch: int
    keys: int
    master: str
    backend: str
    checkpoint_root: str
    storage_options: dict[str, Any]
    jobs: list[Job] = field(default_factory=list)
    executor_faults: list[dict[str, Any]] = field(default_factory=list)
    driver_faults: list[dict[str, Any]] = field(default_factory=list)
    #: parallelism after the n-th restart (driver restart or aborted batch)
    restart_parallelism: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        jobs = [Job(**j) for j in data.get("jobs", [])]
        return cls(**{**data, "jobs": jobs})

    def job_dir(self, index: int) -> str:
        return f"{self.checkpoint_root}/jobs/job-{index:03d}"

    def savepoint_dir(self, index: int) -> str:
        return f"{self.checkpoint_root}/savepoints/savepoint-{index:03d}"

    def planned_counts(self) -> dict[str, int]:
        counts = {k: 0 for k in KINDS}
        for f in self.executor_faults:
            counts["abort" if f["kind"] == "abort" else f["kind"].removeprefix("kill_")] += 1
        for f in self.driver_faults:
            counts["abort" if f["kind"] == "abort" else "driver"] += 1
        counts["savepoint"] = len(self.jobs) - 1
        return counts


def make_plan(seed: int, batches: int, faults_per_kind: int, *, rows_per_batch: int = 120,
              keys: int = 400, master: str = "local-cluster[2,1,1024]",
              backend: str = "rocksdb", checkpoint_root: str = "",
              storage_options: dict[str, Any] | None = None,
              max_parallelism_choice: int = 4) -> Plan:
    """The schedule of a run. Needs ``4 * faults_per_kind`` batches for the per-batch faults
    and room for ``faults_per_kind`` job boundaries (jobs of 2 batches at least)."""
    rng = random.Random(seed)
    if batches < 4 * faults_per_kind + 1 or batches < 2 * (faults_per_kind + 1):
        raise ValueError(f"{batches} batches are too few for {faults_per_kind} faults of each "
                         f"kind (need {max(4 * faults_per_kind + 1, 2 * faults_per_kind + 2)})")
    plan = Plan(seed, batches, rows_per_batch, keys, master, backend, checkpoint_root,
                dict(storage_options or {}))
    parallelisms = list(range(1, max_parallelism_choice + 1))
    # Jobs: faults_per_kind boundaries, each job at least two batches long.
    cuts = sorted(rng.sample(range(0, batches // 2 - 1), faults_per_kind)) if faults_per_kind \
        else []
    ends = [2 * c + 1 for c in cuts]  # spread over the run, distinct, >= 2 apart
    ends = sorted(set(ends))
    ends = [e for e in ends if e < batches - 1] + [batches - 1]
    for i, end in enumerate(ends):
        mode = None if i == 0 else rng.choice(MODES)
        plan.jobs.append(Job(i, end, rng.choice(parallelisms), rng.choice((1, 2)), mode))
    for i, job in enumerate(plan.jobs[:-1]):
        following = plan.jobs[i + 1].restore_mode
        # CLAIM builds on a native snapshot; the others restore canonical ones too.
        job.savepoint_format = "native" if following == "CLAIM" or rng.random() < 0.7 \
            else "canonical"
        job.drill = {"target": rng.choice(DRILL_TARGETS), "damage": rng.choice(DRILL_DAMAGE),
                     "replay": rng.random() < 0.3, "seed": rng.randrange(1 << 30)}
    # Per-batch faults on distinct batches.
    fault_batches = rng.sample(range(batches), 4 * faults_per_kind)
    # Which variants a short run covers (a long one covers them all in turn).
    offset = rng.randrange(len(DRIVER_POINTS))
    side, first_abort = rng.randrange(2), rng.randrange(2)
    # Where the store merges a subtask's small files into one object (object stores, by
    # default) a snapshot may upload a single file, so an upload fault must fire on the first
    # (the S3 soak of seed 20261122 missed 2 of 20 executor kills planned on a second upload).
    single_upload = CheckpointStorage(checkpoint_root or ".", storage_options).merge_file_size > 0
    n = 0
    for kind in ("worker", "executor", "driver", "abort"):
        for k in range(faults_per_kind):
            batch = fault_batches[n]
            fid = f"{kind}-{k:03d}-b{batch}"
            n += 1
            if kind in ("worker", "executor"):
                at = EXECUTOR_SIDE[(k + side) % 2]
                plan.executor_faults.append(_executor_fault(fid, batch, f"kill_{kind}", at, rng,
                                                            single_upload))
            elif kind == "driver":
                point = DRIVER_POINTS[(k + offset) % len(DRIVER_POINTS)]
                if point in EXECUTOR_SIDE:
                    plan.executor_faults.append(_executor_fault(fid, batch, "kill_driver", point,
                                                                rng, single_upload))
                else:
                    plan.driver_faults.append({"id": fid, "batch": batch, "kind": "driver",
                                               "point": point})
            else:
                how = ABORTS[(k + first_abort) % 2]
                if how == "task-fails":
                    plan.executor_faults.append({"id": fid, "batch": batch, "kind": "abort",
                                                 "at": how, "subtask": rng.randrange(1 << 20)})
                else:
                    plan.driver_faults.append({"id": fid, "batch": batch, "kind": "abort",
                                               "point": how})
    plan.restart_parallelism = [rng.choice(parallelisms) for _ in range(8 * faults_per_kind + 8)]
    return plan


def _executor_fault(fid: str, batch: int, kind: str, at: str, rng: random.Random,
                    single_upload: bool = False) -> dict[str, Any]:
    subtask, upload_index = rng.randrange(1 << 20), rng.randrange(2)  # drawn either way: a
    # seed's plan stays the same on a local disk
    return {"id": fid, "batch": batch, "kind": kind, "at": at, "subtask": subtask,
            "upload_index": 0 if single_upload else upload_index}
