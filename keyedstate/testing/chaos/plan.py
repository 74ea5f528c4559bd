"""The soak's schedule, drawn from one seed: jobs and how each one ends, faults, drills.

Everything random in a run is chosen here, up front, by ``random.Random(seed)``, and written to
``plan.json``; the driver and the executors only read it. Re-running with the same seed
replays the same faults at the same batches (only wall-clock timings differ).

Input file ``f`` is read by one Spark batch, but batch ids and files part after a drain: the
drain is a batch of its own that reads nothing (``query.stop(drain=True)``), so every later
file is read by the batch after its number. :meth:`Plan.schedule` maps batch ids to files
(``None``: a drain); faults are drawn on files and planned on the batch that reads them.

Fault kinds (at most one per file; ``faults_per_kind`` of each, ``storage``: of each point):

``worker``    SIGKILL of the Python worker running a subtask, mid-batch or mid-upload;
``executor``  SIGKILL of that worker's executor JVM, mid-batch or mid-upload;
``driver``    SIGKILL of the driver (the Spark application), at one of :data:`DRIVER_POINTS`:
              from an executor mid-batch or mid-upload, or in the driver after each step of
              the checkpoint commit, around the sink commit, before the staging clean-up;
``abort``     an aborted checkpoint: a subtask that fails every attempt, or a ``_metadata``
              write that fails (step 3 of the commit); the query restarts in the same driver;
``storage``   a :class:`~keyedstate.errors.TransientStorageError` in the driver after the
              checkpoint committed (an object store whose retries ran out), at one of
              :data:`STORAGE_POINTS`: the sink-commit marker write (``times`` 1-3: the commit
              retries absorb it; ``times`` 4: it outlasts them, the query fails and restarts
              in the same driver), the staging delete (tried once: the commit's retry finds
              the marker written and leaves the staged files to gc; in an asynchronous job
              it runs on the loop's cleaner, off the batch's path, which logs the error and
              leaves them to gc too), a batch listener (never
              retried: the query restarts, and with ``times`` 2 the replay's listener fails
              again);
``async``     a fault in the asynchronous checkpoint phase (jobs with
              ``keyedstate.checkpointing.async-upload``, ``--checkpointing async`` or
              ``mixed``), at one of :data:`ASYNC_POINTS`: a storage error in the uploader
              (its snapshot's files, or its acknowledgement), on the checkpoint's
              ``_metadata`` or on the registry (completion, in the driver); the driver killed
              right before or right after the sink commit of the completed checkpoint, or
              between Spark's commit log entry of the batch and its checkpoint's completion
              (the restart rewinds Spark's log); the Python worker killed while it uploads
              the checkpoint. Each discards the batches after the last completed checkpoint
              or kills the driver; the source delivers them again;
``savepoint`` a job boundary: the job ends with a savepoint and a new job starts from it in a
              new checkpoint directory, in a restore mode, at a random parallelism. How the
              job ends (:data:`STOPS`, ``faults_per_kind`` of each): ``stop`` with a savepoint;
              ``drain`` then a savepoint; ``sink``: a savepoint taken from inside the sink
              commit of its last batch (:data:`SINK_SAVEPOINT_AT`); ``crash``: the driver
              killed between the checkpoint commit and the sink commit of its last batch, the
              savepoint taken offline (``keyedstate savepoint create``) by the next driver.

Every other boundary (from a random one) gives the next job a fresh Spark checkpoint location,
seeded from the savepoint's copy of the offset log; there a *positions drill* restores the same
savepoint without its ``context/`` in yet another location and must be refused
(:class:`~keyedstate.errors.SourcePositionsError`). A second, small, fault-free job writes into
the soak's output path after one random boundary (``second_job``).

After every driver restart and every aborted batch the job runs at a new random parallelism
(rescaling from its own checkpoints). A corruption drill runs at each job boundary but a drain
(a drained job can't be started again) on a copy of the job's checkpoint directory
(:mod:`keyedstate.testing.chaos.drills`).

How jobs checkpoint (:data:`CHECKPOINTING`, ``--checkpointing``): ``sync`` (the default,
every job synchronous: a seed's plan is exactly what it was before the asynchronous mode),
``async`` (every job asynchronous) or ``mixed``: each job's mode is drawn, at least one of each
when there are two jobs or more, and a driver restarted after a kill draws its mode anew
(:attr:`Plan.restart_checkpointing`) unless its job still has ``async`` faults to fire: the
restart from an asynchronous job's checkpoints into the synchronous mode and back. An
asynchronous job leaves ``max-concurrent-checkpoints`` 2 in flight in about 2 of 5 jobs.
``async`` faults are drawn on files of asynchronous jobs that hold no other fault and are not
the last file of a ``sink`` or ``crash`` job, ``faults_per_kind`` of each point as far as such
files go (``mixed``: where the drawn async jobs have too few, more jobs are made async, one job
staying synchronous; still fewer: :attr:`Plan.notes` says why).

Stability: draws added since a seed's first plan come after the older ones, so a seed keeps
its fault files, fault points, parallelisms and its older boundaries; the boundaries added
split its jobs.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.testing.chaos.workload import definition_change

MODES = ("NO_CLAIM", "CLAIM", "LEGACY")
#: where the driver dies (``driver`` faults)
DRIVER_POINTS = ("process", "upload", "commit-step-1", "commit-step-2", "commit-step-3",
                 "commit-step-4", "commit-step-5", "commit-step-6", "sink-before", "sink-mid",
                 "sink-after", "staging-cleanup")
#: driver points in the sink commit: a ``crash`` boundary on the same batch would pre-empt them
SINK_PATH_POINTS = ("sink-before", "sink-mid", "sink-after", "staging-cleanup")
EXECUTOR_SIDE = ("process", "upload")
ABORTS = ("task-fails", "metadata-write")
#: where a transient storage error hits the driver after the checkpoint commit (``storage``)
STORAGE_POINTS = ("marker-write", "staging-delete", "listener")
#: how a job ends (``savepoint`` boundaries)
STOPS = ("stop", "drain", "sink", "crash")
#: which sink commit of the last batch takes a ``sink`` savepoint: the main sink's before it
#: copies anything, or the last sink's after it copied everything
SINK_SAVEPOINT_AT = ("main-before", "last-after")
DRILL_TARGETS = ("shared", "private", "metadata")
DRILL_DAMAGE = ("truncate", "flip", "delete")
KINDS = ("worker", "executor", "driver", "abort", "storage", "savepoint", "async")
#: how the jobs checkpoint: synchronous, asynchronous (``async-upload``), or drawn per job start
CHECKPOINTING = ("sync", "async", "mixed")
#: where the asynchronous phase fails (``async`` faults), in the order of a checkpoint's life
ASYNC_POINTS = ("upload-error", "ack-error", "kill-worker-uploading", "kill-before-completion",
                "metadata-error", "registry-error", "kill-before-sink", "kill-after-sink")
#: the ``async`` points injected in the Python worker's uploader; the others are the driver's
ASYNC_EXECUTOR_POINTS = ("upload-error", "ack-error", "kill-worker-uploading")
#: ``execution.checkpointing.timeout`` of the soak's asynchronous jobs: how long a lost
#: acknowledgement (a worker killed while uploading) holds the batch up. The soak's uploads
#: take well under a second; Flink's default of 10 minutes would stall it.
ASYNC_TIMEOUT_S = 15
MAX_PARALLELISM = 128
#: the soak's jobs' ``execution.checkpointing.tolerable-failed-checkpoints``: a completed
#: checkpoint's sink commit is tried this many times + 1
TOLERABLE_FAILED = 3
#: the Spark checkpoint location of the first job (a directory of the run directory)
FIRST_LOCATION = "spark-offsets"


@dataclass
class Job:
    """One job of the run: input files up to ``end_file``, started from the previous job's
    savepoint (none for job 0)."""

    index: int
    end_file: int
    parallelism: int
    num_retained: int
    restore_mode: str | None
    #: the format of the savepoint this job ends with
    savepoint_format: str = "native"
    drill: dict[str, Any] | None = None
    #: how the job ends (:data:`STOPS`; the last job just stops)
    stop: str = "stop"
    #: a ``sink`` stop: which sink commit takes the savepoint (:data:`SINK_SAVEPOINT_AT`)
    sink_at: str | None = None
    #: its Spark checkpoint location, a directory of the run directory
    spark_location: str = FIRST_LOCATION
    #: restore this job's savepoint without its ``context/`` in a new location (refused)
    positions_drill: bool = False
    #: ``sync`` or ``async`` (``keyedstate.checkpointing.async-upload``) at the job's start
    checkpointing: str = "sync"
    #: an asynchronous job's ``keyedstate.checkpointing.max-concurrent-checkpoints``
    max_concurrent: int = 1
    #: a rollback: this job restores the savepoint before the previous job's (the previous
    #: job went on after it in the same Spark location) into a fresh Spark checkpoint
    #: location, feeding the same sinks with ``on_rollback="branch"``, and reads the previous
    #: job's files again
    rollback: bool = False


@dataclass
class Branch:
    """A lineage branch of the run, as the plan makes them: the jobs of one Spark query (one
    Spark checkpoint location, continued by restarts and restores in place); a job in a fresh
    location (a restore into a new location, a rollback) starts a branch of the branch before
    it, forking from batch ``fork`` (-1: the first branch)."""

    index: int
    parent: int | None
    fork: int
    jobs: list[int]
    #: ``(batch id, input file or None for a drain)`` of the branch's own batches, in order
    batches: list[tuple[int, int | None]]


@dataclass
class Plan:
    seed: int
    #: input files (one per batch, but for drains)
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
    #: transient storage errors in the driver after the checkpoint commit
    storage_faults: list[dict[str, Any]] = field(default_factory=list)
    #: parallelism after the n-th restart (driver restart or aborted batch)
    restart_parallelism: list[int] = field(default_factory=list)
    #: a second job writing into the soak's output path after job ``after_job`` ended
    second_job: dict[str, Any] | None = None
    #: same-session restarts with a changed definition: the query stops after each of these
    #: input files and the same driver starts the job again (same checkpoint directory, same
    #: Spark checkpoint location) with the next definition (``workload.Definition``)
    redefine_after: list[int] = field(default_factory=list)
    #: how the jobs checkpoint (:data:`CHECKPOINTING`)
    checkpointing: str = "sync"
    #: ``mixed``: the mode of the driver started after the n-th kill, from the end (as
    #: :attr:`restart_parallelism`); a job with ``async`` faults still to fire stays async
    restart_checkpointing: list[str] = field(default_factory=list)
    #: why fewer faults than asked were drawn
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        # plan.json of runs before drains named a job's last file its end_batch
        jobs = [Job(**{("end_file" if k == "end_batch" else k): v for k, v in j.items()})
                for j in data.get("jobs", [])]
        return cls(**{**data, "jobs": jobs})

    def job_dir(self, index: int) -> str:
        return f"{self.checkpoint_root}/jobs/job-{index:03d}"

    def savepoint_dir(self, index: int) -> str:
        return f"{self.checkpoint_root}/savepoints/savepoint-{index:03d}"

    def second_job_dir(self) -> str:
        return f"{self.checkpoint_root}/second-job"

    # -- batch ids and files ---------------------------------------------------------------------

    def schedule(self) -> list[tuple[int, int | None]]:
        """``(batch id, input file)`` of every batch of the run, in order; the file is None
        for a drain (a batch of its own that reads nothing)."""
        out: list[tuple[int, int | None]] = []
        batch, first = 0, 0
        for job in self.jobs:
            for f in range(first, job.end_file + 1):
                out.append((batch, f))
                batch += 1
            first = job.end_file + 1
            if job.stop == "drain" and job.index < len(self.jobs) - 1:
                out.append((batch, None))
                batch += 1
        for f in range(first, self.batches):  # files no job reads (a test's drill reads on)
            out.append((batch, f))
            batch += 1
        return out

    def batch_of_file(self, file: int) -> int:
        """The batch that reads input file ``file``."""
        return file + sum(1 for j in self.jobs[:-1] if j.stop == "drain" and j.end_file < file)

    def file_of_batch(self, batch: int) -> int | None:
        """The input file batch ``batch`` reads; None for a drain or a batch after the run."""
        for b, f in self.schedule():
            if b == batch:
                return f
        return None

    def end_batch(self, job: Job) -> int:
        """The batch that reads the job's last file (a drain comes after it)."""
        return self.batch_of_file(job.end_file)

    def restored_from(self, job: Job) -> int | None:
        """The index of the job whose savepoint ``job`` restores (None: the first job)."""
        if job.index == 0:
            return None
        return job.index - 2 if job.rollback else job.index - 1

    def first_file(self, job: Job) -> int:
        """The first input file the job reads (a rollback reads the previous job's files
        again)."""
        source = self.restored_from(job)
        return 0 if source is None else self.jobs[source].end_file + 1

    def job_batches(self, job: Job) -> list[tuple[int, int | None]]:
        """``(batch id, file)`` of the batches the job runs: its files' and its drain."""
        first = self.batch_of_file(self.first_file(job))
        last = self.end_batch(job) + (1 if job.stop == "drain" and job.index < len(self.jobs) - 1
                                      else 0)
        if job.index == len(self.jobs) - 1:
            last = self.last_batch()
        return [(b, f) for b, f in self.schedule() if first <= b <= last]

    def fork_batch(self, job: Job) -> int:
        """The batch of the savepoint ``job`` starts from (-1: none): the last batch (a drain
        included) of the job that took it."""
        source = self.restored_from(job)
        return -1 if source is None else self.job_batches(self.jobs[source])[-1][0]

    def definition_of_file(self, file: int) -> int:
        """The definition in force when input file ``file`` is read: one more per
        same-session restart with a changed definition before it."""
        return sum(1 for f in self.redefine_after if f < file)

    def definitions(self) -> dict[int, int]:
        """Batch id -> the definition in force (a drain: that of the batch before it)."""
        out: dict[int, int] = {}
        current = 0
        for batch, file in self.schedule():
            if file is not None:
                current = self.definition_of_file(file)
            out[batch] = current
        return out

    def branches(self) -> list[Branch]:
        """The lineage branches (:class:`Branch`), parents first."""
        branches: list[Branch] = []
        of_job: dict[int, int] = {}
        for job in self.jobs:
            previous = self.jobs[job.index - 1] if job.index else None
            if previous is not None and not job.rollback \
                    and job.spark_location == previous.spark_location:
                branch = branches[of_job[previous.index]]
                branch.jobs.append(job.index)
                branch.batches += self.job_batches(job)
            else:
                branch = Branch(len(branches), None if previous is None else of_job[previous.index],
                                self.fork_batch(job), [job.index], self.job_batches(job))
                branches.append(branch)
            of_job[job.index] = branch.index
        return branches

    def last_batch(self) -> int:
        return self.batch_of_file(self.batches - 1)

    # -- counts ----------------------------------------------------------------------------------

    def kinds(self) -> tuple[str, ...]:
        """The fault kinds of this run: ``async`` only with asynchronous jobs."""
        return KINDS if self.checkpointing != "sync" else KINDS[:-1]

    def job_of_file(self, file: int) -> Job:
        """The job that reads input file ``file`` first (a rollback reads it again)."""
        return next(j for j in self.jobs if j.end_file >= file)

    def async_faults(self) -> list[dict[str, Any]]:
        """The ``async`` faults, executor and driver side."""
        return [f for f in self.executor_faults + self.driver_faults if f["kind"] == "async"]

    def planned_counts(self) -> dict[str, int]:
        counts = {k: 0 for k in self.kinds()}
        for f in self.executor_faults:
            counts[f["kind"] if f["kind"] in ("abort", "async")
                   else f["kind"].removeprefix("kill_")] += 1
        for f in self.driver_faults:
            counts[f["kind"] if f["kind"] in ("abort", "async") else "driver"] += 1
        counts["storage"] = len(self.storage_faults)
        counts["savepoint"] = len(self.jobs) - 1
        return counts

    def planned_points(self) -> dict[str, int]:
        """The new edges, counted: storage points and variants, how jobs end, fresh Spark
        locations, positions drills, the second job."""
        points: dict[str, int] = {}

        def add(name: str) -> None:
            points[name] = points.get(name, 0) + 1

        for f in self.storage_faults:
            add(f"storage:{f['point']}")
            if f["point"] == "marker-write":
                add("storage:marker-write:" + ("outlasting" if f["times"] > TOLERABLE_FAILED
                                               else "absorbed"))
        for job in self.jobs[:-1]:
            add(f"savepoint:{job.stop}" + (f":{job.sink_at}" if job.sink_at else ""))
            if job.positions_drill:
                add("positions-drill")
        for prev, job in zip(self.jobs, self.jobs[1:]):
            if job.spark_location != prev.spark_location:
                add("fresh-location")
            if job.rollback:
                add("rollback")
        if self.second_job:
            add("second-job")
        for n in range(1, len(self.redefine_after) + 1):
            add(f"redefine:{definition_change(n)}")
        if self.checkpointing != "sync":
            for f in self.async_faults():
                add(f"async:{f['at'] if 'at' in f else f['point']}")
            for job in self.jobs:
                add(f"checkpointing:{job.checkpointing}")
                if job.checkpointing == "async" and job.max_concurrent > 1:
                    add(f"checkpointing:async:max-concurrent-{job.max_concurrent}")
            for prev, job in zip(self.jobs, self.jobs[1:]):
                if prev.checkpointing != job.checkpointing:
                    add(f"checkpointing:{prev.checkpointing}->{job.checkpointing}:boundary")
        return dict(sorted(points.items()))


def min_batches(faults_per_kind: int) -> int:
    """Input files a plan needs: ``4 * faults_per_kind`` job boundaries on odd files (jobs of
    two files at least), and files for the per-file faults (the storage faults avoid the
    files of the other faults and the last files of ``sink`` and ``crash`` jobs)."""
    return 9 * faults_per_kind + 2 if faults_per_kind else 1


def make_plan(seed: int, batches: int, faults_per_kind: int, *, rows_per_batch: int = 120,
              keys: int = 400, master: str = "local-cluster[2,1,1024]",
              backend: str = "rocksdb", checkpoint_root: str = "",
              storage_options: dict[str, Any] | None = None,
              max_parallelism_choice: int = 4, checkpointing: str = "sync") -> Plan:
    """The schedule of a run over ``batches`` input files (see :func:`min_batches`), its jobs
    checkpointing as ``checkpointing`` says (:data:`CHECKPOINTING`)."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, not {checkpointing!r}")
    rng = random.Random(seed)
    if batches < min_batches(faults_per_kind):
        raise ValueError(f"{batches} batches are too few for {faults_per_kind} faults of each "
                         f"kind (need {min_batches(faults_per_kind)})")
    plan = Plan(seed, batches, rows_per_batch, keys, master, backend, checkpoint_root,
                dict(storage_options or {}))
    parallelisms = list(range(1, max_parallelism_choice + 1))
    # Step 1. The first faults_per_kind boundaries (ends of "stop" jobs), each job at least
    # two files long, and their jobs, as plans have always drawn them.
    slots = range(0, batches // 2 - 1)
    cuts = sorted(rng.sample(slots, faults_per_kind)) if faults_per_kind else []
    stop_ends = [2 * c + 1 for c in cuts]  # spread over the run, distinct, >= 2 apart
    starts: dict[int, tuple[str | None, int, int]] = {}  # first file -> mode, p, num_retained
    first = 0
    for i, end in enumerate(stop_ends + [batches - 1]):
        starts[first] = (None if i == 0 else rng.choice(MODES), rng.choice(parallelisms),
                         rng.choice((1, 2)))
        first = end + 1
    ending: dict[int, tuple[str, dict[str, Any]]] = {}  # last file -> format, drill
    for end in stop_ends:
        following = starts[end + 1][0]
        fmt = "native" if following == "CLAIM" or rng.random() < 0.7 else "canonical"
        ending[end] = (fmt, _drill(rng))
    # Step 2. Per-file faults on distinct files.
    fault_files = rng.sample(range(batches), 4 * faults_per_kind)
    # Which variants a short run covers (a long one covers them all in turn).
    offset = rng.randrange(len(DRIVER_POINTS))
    side, first_abort = rng.randrange(2), rng.randrange(2)
    # Where the store merges a subtask's small files into one object (object stores, by
    # default) a snapshot may upload a single file, so an upload fault must fire on the first
    # (the S3 soak of seed 20261122 missed 2 of 20 executor kills planned on a second upload).
    # The heap backend often writes a single file per subtask and checkpoint (its diff), so
    # there too (seed 54 on the heap backend missed its worker kill, planned on a second).
    single_upload = backend == "heap" or \
        CheckpointStorage(checkpoint_root or ".", storage_options).merge_file_size > 0
    n = 0
    for kind in ("worker", "executor", "driver", "abort"):
        for k in range(faults_per_kind):
            file = fault_files[n]
            n += 1
            if kind in ("worker", "executor"):
                at = EXECUTOR_SIDE[(k + side) % 2]
                plan.executor_faults.append(_executor_fault(kind, k, file, f"kill_{kind}", at,
                                                            rng, single_upload))
            elif kind == "driver":
                point = DRIVER_POINTS[(k + offset) % len(DRIVER_POINTS)]
                if point in EXECUTOR_SIDE:
                    plan.executor_faults.append(_executor_fault(kind, k, file, "kill_driver",
                                                                point, rng, single_upload))
                else:
                    plan.driver_faults.append({"id": (kind, k), "file": file, "kind": "driver",
                                               "point": point})
            else:
                how = ABORTS[(k + first_abort) % 2]
                if how == "task-fails":
                    plan.executor_faults.append({"id": (kind, k), "file": file, "kind": "abort",
                                                 "at": how, "subtask": rng.randrange(1 << 20)})
                else:
                    plan.driver_faults.append({"id": (kind, k), "file": file, "kind": "abort",
                                               "point": how})
    plan.restart_parallelism = [rng.choice(parallelisms) for _ in range(8 * faults_per_kind + 8)]
    # Step 3. The other boundaries (drain, sink, crash; faults_per_kind of each) split those
    # jobs, on the free odd files; the jobs they start and the ends they make draw anew.
    more = sorted(rng.sample([c for c in slots if c not in cuts], 3 * faults_per_kind))
    new_ends = [2 * c + 1 for c in more]
    ends = sorted(stop_ends + new_ends) + [batches - 1]
    first = 0
    for end in ends:
        if first not in starts:
            starts[first] = (rng.choice(MODES), rng.choice(parallelisms), rng.choice((1, 2)))
        first = end + 1
    for end in new_ends:
        ending[end] = ("native" if rng.random() < 0.7 else "canonical", _drill(rng))
    stops = _assign_stops(rng, new_ends, faults_per_kind, plan.driver_faults)
    sink_offset, location_offset = rng.randrange(2), rng.randrange(2)
    first, sinks, location = 0, 0, FIRST_LOCATION
    for i, end in enumerate(ends):
        mode, parallelism, num_retained = starts[first]
        job = Job(i, end, parallelism, num_retained, mode, spark_location=location)
        if end != batches - 1:
            job.savepoint_format, job.drill = ending[end]
            if starts[end + 1][0] == "CLAIM":
                job.savepoint_format = "native"  # CLAIM builds on a native snapshot
            job.stop = stops.get(end, "stop")
            if job.stop == "sink":
                job.sink_at = SINK_SAVEPOINT_AT[(sinks + sink_offset) % 2]
                sinks += 1
            if (i + location_offset) % 2 == 0:
                location = f"{FIRST_LOCATION}-{i + 1:03d}"
                job.positions_drill = True
        plan.jobs.append(job)
        first = end + 1
    # Step 4. Storage faults after the checkpoint commit: on files of no other fault, not
    # the last file of a sink or crash job (the savepoint or the crash would pre-empt them).
    taken = set(fault_files) | {j.end_file for j in plan.jobs[:-1] if j.stop in ("sink", "crash")}
    storage_files = rng.sample([f for f in range(batches) if f not in taken],
                               len(STORAGE_POINTS) * faults_per_kind)
    point_offset, outlast_offset = rng.randrange(len(STORAGE_POINTS)), rng.randrange(2)
    for k, file in enumerate(storage_files):
        point = STORAGE_POINTS[(k + point_offset) % len(STORAGE_POINTS)]
        if point == "marker-write":
            outlasting = (k // len(STORAGE_POINTS) + outlast_offset) % 2 == 1
            times = TOLERABLE_FAILED + 1 if outlasting else rng.randint(1, TOLERABLE_FAILED)
        elif point == "listener":
            times = rng.randint(1, 2)
        else:  # the staging delete is tried once: the commit's retry finds the marker written
            times = 1
        plan.storage_faults.append({"id": ("storage", k), "file": file, "kind": "storage",
                                    "point": point, "times": times})
    # Step 5. The second job, after one boundary.
    if len(plan.jobs) > 1:
        plan.second_job = {"after_job": rng.randrange(len(plan.jobs) - 1), "files": 2,
                           "rows": 40, "keys": 60, "seed": rng.randrange(1 << 30),
                           "parallelism": rng.choice(parallelisms)}
    # Step 6. Faults are planned on the batch that reads their file.
    for fault in plan.executor_faults + plan.driver_faults + plan.storage_faults:
        kind, k = fault["id"]
        fault["batch"] = plan.batch_of_file(fault["file"])
        fault["id"] = f"{kind}-{k:03d}-b{fault['batch']}"
    # Step 7. Same-session restarts with a changed definition and rollbacks (drawn after
    # everything older: a seed keeps its faults, jobs and boundaries).
    _draw_redefines(rng, plan, 3 * faults_per_kind)
    _draw_rollbacks(rng, plan, faults_per_kind)
    # Step 8. The asynchronous phase: each job's mode, and its faults (after everything
    # older: a synchronous plan is the seed's plan as it was).
    _draw_async(rng, plan, faults_per_kind, checkpointing)
    return plan


def _draw_async(rng: random.Random, plan: Plan, faults_per_kind: int,
                checkpointing: str) -> None:
    """Step 8 of :func:`make_plan` (the module docstring: how jobs checkpoint)."""
    plan.checkpointing = checkpointing
    if checkpointing == "sync":
        return
    for job in plan.jobs:
        job.checkpointing = "async" if checkpointing == "async" or rng.random() < 0.5 \
            else "sync"
        job.max_concurrent = 2 if rng.random() < 0.4 else 1
    # Files with no other fault, not a sink or crash job's last file (the savepoint or the
    # crash in that sink commit would pre-empt the fault, or the fault it).
    taken = {f["file"] for f in plan.executor_faults + plan.driver_faults + plan.storage_faults}
    taken |= {j.end_file for j in plan.jobs[:-1] if j.stop in ("sink", "crash")}
    wanted = len(ASYNC_POINTS) * faults_per_kind

    def free() -> list[int]:
        return [f for f in range(plan.batches)
                if f not in taken and plan.job_of_file(f).checkpointing == "async"]

    if checkpointing == "mixed":
        modes = {j.checkpointing for j in plan.jobs}
        if len(plan.jobs) > 1 and len(modes) == 1:
            flipped = rng.choice(plan.jobs)
            flipped.checkpointing = "sync" if flipped.checkpointing == "async" else "async"
        # Where the async jobs' files can't hold the faults asked, more jobs are async (one
        # job stays synchronous).
        synchronous = [j for j in plan.jobs if j.checkpointing == "sync"]
        rng.shuffle(synchronous)
        while len(free()) < wanted and len(synchronous) > 1:
            synchronous.pop().checkpointing = "async"
        plan.restart_checkpointing = [rng.choice(("sync", "async"))
                                      for _ in range(len(plan.restart_parallelism))]
    candidates = free()
    files = rng.sample(candidates, min(wanted, len(candidates)))
    if len(files) < wanted:
        plan.notes.append(
            f"async: {len(files)} of {wanted} faults drawn ({faults_per_kind} of each of its "
            f"{len(ASYNC_POINTS)} points), one per free input file of an asynchronous job: "
            f"{len(candidates)} of the {plan.batches} files are (files of synchronous jobs, of "
            f"other faults, and the last file of a sink or crash job are not); run more "
            f"--batches" + (" or --checkpointing async" if checkpointing == "mixed" else ""))
    offset = rng.randrange(len(ASYNC_POINTS))
    for k, file in enumerate(sorted(files)):
        point = ASYNC_POINTS[(k + offset) % len(ASYNC_POINTS)]
        batch = plan.batch_of_file(file)
        fault: dict[str, Any] = {"id": f"async-{k:03d}-b{batch}", "file": file, "batch": batch,
                                 "kind": "async"}
        if point in ASYNC_EXECUTOR_POINTS:
            plan.executor_faults.append({**fault, "at": point,
                                         "subtask": rng.randrange(1 << 20)})
        else:
            plan.driver_faults.append({**fault, "point": point})


def _draw_redefines(rng: random.Random, plan: Plan, count: int) -> None:
    """``count`` same-session restarts with a changed definition, after files inside jobs
    (not a job's last file: the query stops between two batches of one job)."""
    ends = {j.end_file for j in plan.jobs}
    inside = [f for f in range(plan.batches) if f not in ends]
    plan.redefine_after = sorted(rng.sample(inside, min(count, len(inside))))


def _draw_rollbacks(rng: random.Random, plan: Plan, count: int) -> None:
    """``count`` rollbacks. A job ``i`` ended by a ``stop`` or ``sink`` (its output committed;
    a crash's last batch is carried by a savepoint the rollback leaves unused, a drain would
    shift the branch's batch ids), restored from the savepoint before it in the same Spark
    location and not ``CLAIM`` (the query went on after that savepoint, which stays its
    owner's), is followed by a job restoring that older savepoint into a fresh Spark
    checkpoint location: it reads job ``i``'s files again as a new branch. Where no job
    qualifies as drawn, one that ends by a stop or sink is made to (``NO_CLAIM``, the
    previous job's location); the job after it moves to a fresh location, with its positions
    drill, where the plan had kept it."""

    def qualifies(job: Job) -> bool:
        return (0 < job.index < len(plan.jobs) - 1 and job.stop in ("stop", "sink")
                and job.restore_mode != "CLAIM"
                and job.spark_location == plan.jobs[job.index - 1].spark_location)

    chosen: list[Job] = []
    for _ in range(count):
        taken = {j.index + d for j in chosen for d in (-1, 0, 1)}
        eligible = [j for j in plan.jobs if qualifies(j) and j.index not in taken]
        if not eligible:
            eligible = [j for j in plan.jobs if 0 < j.index < len(plan.jobs) - 1
                        and j.stop in ("stop", "sink") and j.index not in taken
                        and j.index + 1 not in {c.index for c in chosen}]
            if not eligible:
                break
            # Keep a crash's next job as drawn (a CLAIM there is the sharpest replay edge).
            eligible = [j for j in eligible if plan.jobs[j.index - 1].stop != "crash"] \
                or eligible
            job = rng.choice(eligible)
            if job.restore_mode == "CLAIM":
                job.restore_mode = "NO_CLAIM"
            previous = plan.jobs[job.index - 1]
            if job.spark_location != previous.spark_location:
                moved = job.spark_location
                for later in plan.jobs[job.index:]:
                    if later.spark_location != moved:
                        break
                    later.spark_location = previous.spark_location
                previous.positions_drill = False
        else:
            job = rng.choice(eligible)
        chosen.append(job)
    for job in chosen:
        following = plan.jobs[job.index + 1]
        following.rollback = True
        if following.restore_mode == "CLAIM" and \
                plan.jobs[job.index - 1].savepoint_format != "native":
            following.restore_mode = "NO_CLAIM"  # CLAIM builds on a native snapshot
        if following.spark_location == job.spark_location:
            fresh = f"{FIRST_LOCATION}-{following.index:03d}-rollback"
            for later in plan.jobs[following.index:]:
                if later.spark_location != job.spark_location:
                    break
                later.spark_location = fresh
            job.positions_drill = True


def _drill(rng: random.Random) -> dict[str, Any]:
    return {"target": rng.choice(DRILL_TARGETS), "damage": rng.choice(DRILL_DAMAGE),
            "replay": rng.random() < 0.3, "seed": rng.randrange(1 << 30)}


def _assign_stops(rng: random.Random, new_ends: list[int], faults_per_kind: int,
                  driver_faults: list[dict[str, Any]]) -> dict[int, str]:
    """How each new boundary ends its job: ``faults_per_kind`` drains, sink and crash stops,
    shuffled; a crash is moved off a file whose driver fault sits in the sink commit (the
    crash would come first, and the fault never)."""
    stops = ["drain", "sink", "crash"] * faults_per_kind
    rng.shuffle(stops)
    busy = {f["file"] for f in driver_faults if f["point"] in SINK_PATH_POINTS}
    for i, end in enumerate(new_ends):
        if stops[i] == "crash" and end in busy:
            swap = next((j for j, e in enumerate(new_ends)
                         if stops[j] != "crash" and e not in busy), None)
            if swap is not None:
                stops[i], stops[swap] = stops[swap], stops[i]
    return dict(zip(new_ends, stops))


def _executor_fault(kind: str, k: int, file: int, fault: str, at: str, rng: random.Random,
                    single_upload: bool = False) -> dict[str, Any]:
    subtask, upload_index = rng.randrange(1 << 20), rng.randrange(2)  # drawn either way: a
    # seed's plan stays the same on a local disk
    return {"id": (kind, k), "file": file, "kind": fault, "at": at, "subtask": subtask,
            "upload_index": 0 if single_upload else upload_index}
