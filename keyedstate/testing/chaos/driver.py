"""The soak's Spark application (``python -m keyedstate.testing.chaos.driver RUN_DIR``): the driver
the controller (:mod:`keyedstate.testing.chaos.runner`) starts, kills and starts again.

It runs the plan's jobs from the one ``progress.json`` names, one streaming query per job
(``availableNow`` over the input files of the job's batches, one file per batch, in the job's
Spark checkpoint location), and:

1. installs the driver-side faults (:mod:`keyedstate.testing.chaos.driver_faults`): SIGKILL of itself
   after each step of the checkpoint commit, around the sink commit and before the staging
   clean-up; a failing ``_metadata`` write (an aborted checkpoint); transient storage errors
   after the checkpoint commit (the sink-commit marker write, the staging delete; a batch
   listener is added per query). Nothing in keyedstate is changed: the hooks wrap its classes
   in this process only;
2. restarts the query in this process after an injected abort or a storage error that outlasted
   the commit retries, and in an asynchronous job after a failure that discarded the batches
   after the last completed checkpoint (``CheckpointDiscardedError``: the restart rewinds
   Spark's log to that checkpoint and the source delivers them again), at a new parallelism.
   An asynchronous job's query completes its checkpoints in flight (``flush``) before it
   counts as done, so that such a failure meets this restart, not the job's stop;
3. stops the query after each planned file of a same-session restart with a changed
   definition (``plan.redefine_after``) and starts the job again in this process (same
   SparkSession, same checkpoint directory and Spark checkpoint location) with the next
   definition (:class:`~keyedstate.testing.chaos.workload.Definition`; a dropped state goes
   through ``drop_states``); ``progress.json`` records how far the job got (``segment``);
4. at a job boundary (:mod:`keyedstate.testing.chaos.boundary`): ends the job as planned (a savepoint
   at the stop, after a drain, from inside the sink commit, or offline after a crash), runs a
   corruption drill on a copy of the job's checkpoint directory and a positions drill on a copy
   of the savepoint, checks the directory (:func:`check_job_dir`: gc, then no orphan and no
   missing file), runs the second job if it is due, and moves on to the next job, which
   restores the savepoint in its mode;
5. before a rollback job (``Job.rollback``) first runs it without ``on_rollback="branch"``:
   it must be refused with :class:`~keyedstate.errors.SinkRollbackError`, leaving nothing
   behind (:func:`rollback_check`), then with it;
6. after the last job: reads the final state with the state processor API
   (:class:`~keyedstate.spark.processor.SavepointReader`) into ``final/``.

Everything it does is appended to ``events.jsonl`` (one JSON object per line).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from keyedstate.config import LATE_EVENTS_TAG, JobConfig, LateEvents, OnRollback, RestoreMode
from keyedstate.errors import CheckpointDiscardedError
from keyedstate.spark.sinks import ParquetSink, StagedOutput
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import (
    ASYNC_MARKER_FILE,
    CLAIM_MARKER_FILE,
    COMMITS_DIR,
    COMPLETED_MARKER_FILE,
    METADATA_FILE,
    SPARK_OFFSETS_DIR,
    commit_marker,
    staging_dir,
)
from keyedstate.testing.chaos.driver_faults import (
    BOUNDARY_CRASH,
    DriverFaults,
    boundary_crash_id,
    install_driver_hooks,
)
from keyedstate.testing.chaos.plan import (
    ASYNC_TIMEOUT_S,
    MAX_PARALLELISM,
    TOLERABLE_FAILED,
    Job,
    Plan,
)
from keyedstate.testing.chaos.workload import (
    DRIVER_PID_FILE,
    INJECTED,
    INPUT_DDL,
    MARKERS_DIR,
    OUTPUT_DDL,
    PLAN_FILE,
    WATERMARK_DELAY_MS,
    ChaosFunction,
    Definition,
    claim_marker,
    input_file_name,
    marker_path,
    publish_input,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["BOUNDARY_CRASH", "DriverFaults", "boundary_crash_id", "install_driver_hooks"]

PROGRESS_FILE = "progress.json"
EVENTS_FILE = "events.jsonl"
FINAL_DIR = "final"


def log_event(run_dir: str, event: str, **info: Any) -> None:
    line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **info},
                      default=str)
    with open(os.path.join(run_dir, EVENTS_FILE), "a") as f:
        f.write(line + "\n")
        f.flush()


def read_progress(run_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(run_dir, PROGRESS_FILE)) as f:
            return dict(json.load(f))
    except FileNotFoundError:
        return {"job": 0, "restarts": 0, "parallelism": None}


def write_progress(run_dir: str, progress: dict[str, Any]) -> None:
    path = os.path.join(run_dir, PROGRESS_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(progress, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SinkSavepoint:
    """A ``sink`` job end: the savepoint taken from inside the sink commit of the job's last
    batch (the main sink's before it copies anything, or the last sink's after it copied
    everything, :data:`~keyedstate.testing.chaos.plan.SINK_SAVEPOINT_AT`), on the batch thread, with
    :meth:`KeyedJobDriver.savepoint` (its lock is re-entrant). Once: not again when the
    savepoint exists (a replay after a restart), nor from a commit the savepoint itself runs."""

    def __init__(self, plan: Plan, run_dir: str, job: Job) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.job = job
        self.batch = plan.end_batch(job)
        self.target = plan.savepoint_dir(job.index)
        #: the query's :class:`KeyedJobDriver`, set before the query starts
        self.driver: Any = None
        self._taking = False

    def take(self, batch_id: int, at: str) -> None:
        if (at != self.job.sink_at or batch_id != self.batch or self.driver is None
                or self._taking
                or clear_unfinished_savepoint(self.target, self.plan.storage_options)):
            return
        self._taking = True
        try:
            claim_marker(self.run_dir, via_marker(self.job, "sink"), at=at, batch=batch_id)
            started = time.time()
            self.driver.savepoint(self.target, self.job.savepoint_format)
            log_event(self.run_dir, "sink-savepoint", job=self.job.index, batch_id=batch_id,
                      at=at, seconds=time.time() - started)
        finally:
            self._taking = False


def clear_unfinished_savepoint(target: str, storage_options: Any) -> bool:
    """Whether ``target`` holds a finished savepoint; if it holds only what a killed savepoint
    run left (files, no ``_metadata``), delete them first, as an operator would: a savepoint is
    written only into a new or empty target, so a retry needs it empty."""
    storage = CheckpointStorage(target, storage_options)
    if storage.exists(METADATA_FILE):
        return True
    storage.delete(storage.list_files())
    return False


def via_marker(job: Job, via: str) -> str:
    """The marker that says how a job's savepoint was taken (``stop``, ``drain``, ``sink``,
    ``cli``), claimed just before it is."""
    return f"via-{job.index:03d}-{via}"


class ChaosSink(ParquetSink):
    """A :class:`ParquetSink` with crash points around its commit and a ledger of every
    commit (``ledger/``): a batch committed twice must be committed with the same rows."""

    def __init__(self, path: str, output: str, run_dir: str, faults: DriverFaults | None,
                 last: bool, savepoint: SinkSavepoint | None = None) -> None:
        super().__init__(path)
        self.output = output
        self.run_dir = run_dir
        self.faults = faults
        self.last = last
        self.savepoint = savepoint
        self._batch_id = -1

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        faults = self.faults
        if self.savepoint is not None and self.savepoint.driver is None and faults is not None:
            # An asynchronous job's restart commits its last completed checkpoint's output
            # while its driver starts, before run_job has it in hand.
            self.savepoint.driver = faults.starting
        if faults is not None and self.output == "main":
            faults.crash(batch_id, BOUNDARY_CRASH)
            faults.crash(batch_id, "sink-before")
            faults.crash(batch_id, "kill-before-sink")
            if self.savepoint is not None:
                self.savepoint.take(batch_id, "main-before")
        self._batch_id = batch_id
        super().commit(spark, batch_id, staged)
        self._ledger(batch_id, staged)
        if faults is not None and self.last:
            if self.savepoint is not None:
                self.savepoint.take(batch_id, "last-after")
            faults.crash(batch_id, "sink-after")
            faults.crash(batch_id, "kill-after-sink")

    def _publish(self, target: CheckpointStorage, written: str, name: str,
                 manifest: bytes) -> None:
        """"sink-mid": what a commit interrupted half-way leaves, every part written to the
        sink's temporary directory (an object store: to the batch directory) and the batch
        not published yet."""
        if self.faults is not None and self.output == "main":
            self.faults.crash(self._batch_id, "sink-mid")
        super()._publish(target, written, name, manifest)

    def _ledger(self, batch_id: int, staged: StagedOutput) -> None:
        import hashlib

        rows = []
        for path in staged.paths:
            table = pq.read_table(staged.storage.fs.open(staged.storage.path(path), "rb"))
            rows += [json.dumps(r, sort_keys=True, default=str) for r in table.to_pylist()]
        digest = hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()
        directory = os.path.join(self.run_dir, "ledger")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{self.output}-b{batch_id}-{uuid.uuid4().hex}.json"),
                  "w") as f:
            json.dump({"batch_id": batch_id, "output": self.output, "rows": len(rows),
                       "lineage": staged.lineage, "sha256": digest, "time": time.time()}, f)


# -- one job -------------------------------------------------------------------------------------

def job_config(plan: Plan, run_dir: str, job: Job, parallelism: int,
               definition: int | None = None, checkpointing: str | None = None) -> JobConfig:
    """The job's configuration under ``definition`` (default: the one its first batch runs
    with) and ``checkpointing`` (default: the job's mode; ``async`` sets
    ``async-upload`` with the job's ``max-concurrent-checkpoints`` and a short
    :data:`~keyedstate.testing.chaos.plan.ASYNC_TIMEOUT_S`): a rollback restores the
    savepoint before the previous job's, in branch mode; a definition without ``buckets``
    drops it."""
    if definition is None:
        definition = plan.definition_of_file(plan.first_file(job))
    source = plan.restored_from(job)
    previous = None if source is None else plan.savepoint_dir(source)
    asynchronous: dict[str, Any] = {}  # a synchronous job's configuration as it always was
    if (checkpointing or job.checkpointing) == "async":
        asynchronous = {"async_upload": True, "max_concurrent_checkpoints": job.max_concurrent,
                        "checkpoint_timeout": dt.timedelta(seconds=ASYNC_TIMEOUT_S)}
    return JobConfig(
        checkpoint_dir=plan.job_dir(job.index), backend=plan.backend, parallelism=parallelism,
        max_parallelism=MAX_PARALLELISM, num_retained=job.num_retained,
        restore_path=previous, restore_mode=RestoreMode(job.restore_mode or "NO_CLAIM"),
        watermark_column="ts", watermark_delay=dt.timedelta(milliseconds=WATERMARK_DELAY_MS),
        late_events=LateEvents.SIDE_OUTPUT, tolerable_failed_checkpoints=TOLERABLE_FAILED,
        local_dir=os.path.join(run_dir, "local"), storage_options=plan.storage_options,
        drop_states=Definition.of(definition).drop_states(),
        on_rollback=OnRollback.BRANCH if job.rollback else OnRollback.REFUSE,
        **asynchronous)


def spark_location(run_dir: str, job: Job) -> str:
    return os.path.join(run_dir, job.spark_location)


def build_job(df: Any, run_dir: str | None, out_dir: str, faults: DriverFaults | None,
              savepoint: SinkSavepoint | None = None, definition: int = 0) -> Any:
    from keyedstate.spark.api import key_by

    job = key_by(df, "key").process(ChaosFunction(run_dir, definition), OUTPUT_DDL)
    job.sink(ChaosSink(os.path.join(out_dir, "main"), "main", run_dir or out_dir, faults, False,
                       savepoint))
    job.sink(ChaosSink(os.path.join(out_dir, "late"), "late", run_dir or out_dir, faults, True,
                       savepoint), output=LATE_EVENTS_TAG)
    return job


def _injected_fault(exc: BaseException) -> str | None:
    text = str(exc)
    at = text.find(INJECTED)
    if at < 0:
        return None
    start = text.find("(fault ", at)
    return text[start + 7: text.find(")", start)] if start >= 0 else None


def _discarded(exc: BaseException) -> bool:
    """Whether ``exc`` is the asynchronous mode's :class:`CheckpointDiscardedError`."""
    return isinstance(exc, CheckpointDiscardedError) or "CheckpointDiscardedError" in str(exc)


def claimed_since(run_dir: str, since: float) -> list[str]:
    """The faults whose markers were claimed since ``since`` (a query's start)."""
    directory = os.path.join(run_dir, MARKERS_DIR)
    if not os.path.isdir(directory):
        return []
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json") or name.endswith("-handled.json"):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                marker = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        if marker.get("kind") and marker.get("time", 0.0) >= since:
            out.append(name[:-5])
    return out


def run_job(spark: Any, plan: Plan, run_dir: str, job: Job, progress: dict[str, Any],
            faults: DriverFaults) -> Any:
    """Run ``job`` until every input file of its batches is processed (and, in the
    asynchronous mode, every checkpoint in flight completed and its output committed); restart
    the query after each injected abort or storage error, after each discard of batches in
    flight (asynchronous mode), and after each file of a same-session restart with a changed
    definition (``progress["segment"]``: the files up to the segment's last are published,
    the query runs them and stops, the next segment starts with the next definition). The
    query checkpoints as ``progress["checkpointing"]`` says (a restarted driver's draw), else
    as the job. Returns the finished :class:`KeyedQuery`."""
    from keyedstate.spark.query import KeyedQuery

    input_dir = os.path.join(run_dir, "input")
    location = spark_location(run_dir, job)
    first = plan.first_file(job)
    segments = [f for f in plan.redefine_after if first <= f < job.end_file] + [job.end_file]
    while True:
        segment = min(progress.get("segment", 0), len(segments) - 1)
        up_to = segments[segment]
        definition = plan.definition_of_file(up_to)
        publish_input(os.path.join(run_dir, "generated"), input_dir, up_to)
        parallelism = progress["parallelism"] or job.parallelism
        checkpointing = progress.get("checkpointing") or job.checkpointing
        cfg = job_config(plan, run_dir, job, parallelism, definition, checkpointing)
        events = (spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1)
                  .parquet(input_dir))
        started = time.time()
        hook = SinkSavepoint(plan, run_dir, job) if job.stop == "sink" else None
        # KeyedProcessJob.start, with the driver in hand before the first batch runs (the
        # sink savepoint and the listeners need it).
        driver = build_job(events, run_dir, os.path.join(run_dir, "out"), faults, hook,
                           definition).driver(cfg, location)
        if hook is not None:
            hook.driver = driver
        # A listener that fails (an injected storage error) keeps the later ones from running.
        driver.listeners.append(lambda s: faults.fail_storage(s.batch_id, "listener"))
        driver.listeners.append(lambda s: log_event(
            run_dir, "batch", job=job.index, batch_id=s.batch_id,
            checkpoint_id=s.checkpoint_id, skipped=s.skipped_replay, rows_in=s.rows_in,
            rows_out=s.rows_out, duration_s=s.duration_s, restored=s.restored_subtasks,
            reused=s.reused_subtasks, restore_s=s.restore_s, full_bytes=s.full_bytes,
            incremental_bytes=s.incremental_bytes, attempts=s.attempts))
        faults.spark_location = location
        query = KeyedQuery(events.writeStream.foreachBatch(driver.process_batch)
                           .option("checkpointLocation", location)
                           .trigger(availableNow=True).start(), driver)
        branch = driver.branch()
        log_event(run_dir, "query-start", job=job.index, parallelism=parallelism,
                  restore_mode=job.restore_mode, start_s=time.time() - started,
                  spark_location=job.spark_location, definition=definition,
                  segment=segment, query_id=driver.query_id(),
                  parent_query_id=branch.parent_query_id if branch else None,
                  fork_batch_id=branch.fork_batch_id if branch else None,
                  recovery_notes=query.driver.coordinator.recovery_notes,
                  checkpointing=checkpointing,
                  max_concurrent=cfg.max_concurrent_checkpoints if cfg.async_upload else None,
                  resumed_batch=driver.last_batch_id)
        try:
            query.await_termination()
            if cfg.async_upload:
                # The checkpoints still in flight complete here, inside this try: a discard
                # meets the restart below, not the job's stop.
                query.driver.flush()
            if segment == len(segments) - 1:
                return query
            # A same-session restart with a changed definition: a plain stop, then the same
            # driver starts the job again with the next definition.
            query.stop()
            progress["segment"] = segment + 1
            write_progress(run_dir, progress)
            log_event(run_dir, "redefine", job=job.index, after_file=up_to,
                      after_batch=driver.last_batch_id,
                      definition=plan.definition_of_file(up_to + 1))
        except Exception as exc:
            fault = _injected_fault(exc)
            discarded = cfg.async_upload and _discarded(exc)
            if fault is None and not discarded:
                raise
            query.query.stop()
            if discarded:
                # The batches after the last completed checkpoint are gone; the restart
                # rewinds Spark's log and the source delivers them again. Explained when a
                # fault fired during this query.
                claimed = claimed_since(run_dir, started)
                log_event(run_dir, "discard", job=job.index, fault=fault, claimed=claimed,
                          explained=bool(fault or claimed),
                          batches=getattr(exc, "discarded_batches", None)
                          or getattr(driver.failure, "discarded_batches", None),
                          back_at=driver.last_batch_id, error=str(exc).splitlines()[0][:300])
            if fault is not None:
                claim_marker(run_dir, fault + "-handled")
            progress["restarts"] += 1
            progress["parallelism"] = plan.restart_parallelism[
                progress["restarts"] % len(plan.restart_parallelism)]
            write_progress(run_dir, progress)
            log_event(run_dir, "abort", fault=fault, job=job.index,
                      error=str(exc).splitlines()[0][:300])


def check_job_dir(plan: Plan, directory: str, *, apply_gc: bool = True) -> dict[str, Any]:
    """gc (as an operator's cron would: the one garbage finder, ``find_garbage``), then what
    is left, judged independently of it: every file must be referenced by a committed
    checkpoint or belong to the layout (``_metadata``, sink-commit markers, claim markers,
    the pending batch's staged output); every referenced file must exist with its size and
    checksum."""
    from keyedstate.checkpoint.resolve import ResolvedSnapshot
    from keyedstate.checkpoint.savepoint import verify_snapshot_files
    from keyedstate.processor.inspection import delete_garbage, find_garbage

    storage = CheckpointStorage(directory, plan.storage_options)
    report = find_garbage(storage)
    collected = delete_garbage(report) if apply_gc and report.files else 0
    referenced: set[str] = set()
    missing: list[str] = []
    ids = storage.checkpoint_ids()
    pending = ""
    for checkpoint_id in ids:
        path = storage.metadata_path(checkpoint_id)
        metadata = storage.read_metadata(path)
        referenced.add(path)
        referenced.update(f.path for f in metadata.files())
        try:
            verify_snapshot_files(ResolvedSnapshot(storage, path, metadata))
        except Exception as exc:  # noqa: BLE001 - reported, the run fails on it
            missing.append(f"{type(exc).__name__}: {exc}")
        batch = int(metadata.properties.get("batch_id", -1))
        if checkpoint_id == ids[-1] and "staged" in metadata.properties and not storage.exists(
                commit_marker(batch, checkpoint_id)):
            # The job ended between its latest checkpoint and that checkpoint's sink commit
            # (a crash job end): its staged output waits, and its savepoint carries a copy.
            pending = staging_dir(batch) + "/"
    # The root's markers belong to the layout, like Spark's offsets.
    files = [p for p in storage.list_files()
             if not p.startswith(f"{SPARK_OFFSETS_DIR}/")
             and p not in (COMPLETED_MARKER_FILE, ASYNC_MARKER_FILE)]
    layout = [p for p in files if p.startswith(f"{COMMITS_DIR}/")
              or p.endswith(f"/{CLAIM_MARKER_FILE}") or (pending and p.startswith(pending))]
    orphans = [p for p in files if p not in referenced and p not in layout]
    return {"directory": directory, "checkpoints": ids, "files": len(files),
            "referenced": len(referenced), "gc_collected": collected,
            "gc_bytes": report.bytes, "orphans": orphans[:20], "orphan_count": len(orphans),
            "commit_markers": len(layout), "pending_output": pending, "missing": missing,
            "bytes": sum(int(storage.fs.size(storage.path(p))) for p in files)}


def read_final_state(spark: Any, plan: Plan, run_dir: str, job: Job) -> None:
    """Every state and the timers of the last job's latest checkpoint, through the state
    processor API, as Parquet under ``final/``."""
    from keyedstate.spark.processor import SavepointReader

    out = os.path.join(run_dir, FINAL_DIR)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    reader = SavepointReader.read(spark, plan.job_dir(job.index),
                                  storage_options=plan.storage_options)
    frames = {name: reader.state(name) for name in reader.state_names}
    frames["timers"] = reader.timers()
    for name, df in frames.items():
        # pyspark annotates toPandas() with an alias of pandas' DataFrame that resolves only
        # with pandas-stubs (not installed): named here as pandas' own class.
        frame: pd.DataFrame = df.toPandas()
        frame.to_parquet(os.path.join(out, f"{name}.parquet"))
    log_event(run_dir, "final-state", checkpoint=reader.snapshot.metadata.checkpoint_id,
              batch_id=reader.snapshot.metadata.properties.get("batch_id"),
              states=sorted(frames))


def rollback_marker(job: Job) -> str:
    return f"rollback-check-{job.index:03d}"


def _files_under(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(folder, name), path)
                  for folder, _, names in os.walk(path) for name in names)


def rollback_check(spark: Any, plan: Plan, run_dir: str, job: Job) -> dict[str, Any]:
    """The rollback ``job`` started exactly as planned but without ``on_rollback="branch"``:
    it must be refused with :class:`~keyedstate.errors.SinkRollbackError` at start, before
    anything is restored or written (docs/sinks.md): no file in its checkpoint directory or
    its new Spark checkpoint location, nothing changed in the sinks, the savepoint not
    claimed (the savepoint). Returns ``outcome`` (``refused``, ``started``, ``other-error``), ``error``,
    ``left``, ``sinks_changed``, ``claimed``, ``restore_path``, ``violation``."""
    from keyedstate.errors import SinkRollbackError

    cfg = job_config(plan, run_dir, job, job.parallelism).replace(on_rollback="refuse")
    assert cfg.restore_path is not None
    out = os.path.join(run_dir, "out")
    sinks_before = _files_under(out)
    static = spark.read.schema(INPUT_DDL).parquet(
        os.path.join(run_dir, "generated", input_file_name(0)))
    result: dict[str, Any] = {"outcome": "refused", "error": "",
                              "restore_path": cfg.restore_path}
    try:
        build_job(static, run_dir, out, None,
                  definition=plan.definition_of_file(plan.first_file(job))).driver(
            cfg, spark_location(run_dir, job))
        result["outcome"] = "started"
    except SinkRollbackError as exc:
        result["error"] = str(exc).splitlines()[0][:600]
    except Exception as exc:  # noqa: BLE001 - judged by the verdict
        result["outcome"] = "other-error"
        result["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
    checkpoint_dir = plan.job_dir(job.index)
    location = spark_location(run_dir, job)
    result["left"] = (
        [f"checkpoint dir: {p}"
         for p in CheckpointStorage(checkpoint_dir, plan.storage_options).list_files()]
        + [f"spark location: {p}" for p in _files_under(location)])[:20]
    result["sinks_changed"] = sinks_before != _files_under(out)
    restored = CheckpointStorage(cfg.restore_path, plan.storage_options)
    result["claimed"] = restored.exists(CLAIM_MARKER_FILE)
    result["violation"] = (result["outcome"] != "refused" or bool(result["left"])
                           or result["sinks_changed"] or result["claimed"])
    return result


def _housekeeping(plan: Plan, index: int) -> None:
    """The operator's part: delete job directories and savepoints two jobs back (the
    current job restored from the previous savepoint; nothing older is needed), but a
    savepoint a rollback restores, until that rollback ran."""
    doomed = {index - 2}
    if index >= 1 and plan.jobs[index - 1].rollback:
        doomed.add(index - 3)  # kept for the rollback that just ran
    if index < len(plan.jobs) and plan.jobs[index].rollback:
        doomed.discard(index - 2)
    for k in sorted(d for d in doomed if d >= 0):
        for url in (plan.job_dir(k), plan.savepoint_dir(k)):
            storage = CheckpointStorage(url, plan.storage_options)
            try:
                storage.fs.rm(storage.root, recursive=True)
            except FileNotFoundError:
                pass


def restart_checkpointing(plan: Plan, run_dir: str, job: Job, drawn: str) -> str:
    """The mode of a driver restarted in ``job`` (``mixed``: ``drawn`` by the controller
    from :attr:`Plan.restart_checkpointing`): asynchronous while the job has ``async`` faults
    that have not fired (they fire only there), else ``drawn``."""
    pending = [f for f in plan.async_faults() if plan.job_of_file(f["file"]).index == job.index
               and not os.path.exists(marker_path(run_dir, f["id"]))]
    return "async" if pending else drawn


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    run_dir = os.path.abspath(args[0])
    with open(os.path.join(run_dir, DRIVER_PID_FILE), "w") as f:
        f.write(str(os.getpid()))
    with open(os.path.join(run_dir, PLAN_FILE)) as f:
        plan = Plan.from_json(json.load(f))
    progress = read_progress(run_dir)
    if "--parallelism" in args:
        progress["parallelism"] = int(args[args.index("--parallelism") + 1])
        write_progress(run_dir, progress)
    if "--checkpointing" in args and progress["job"] < len(plan.jobs):
        progress["checkpointing"] = restart_checkpointing(
            plan, run_dir, plan.jobs[progress["job"]], args[args.index("--checkpointing") + 1])
        write_progress(run_dir, progress)
    faults = DriverFaults(run_dir, plan)
    install_driver_hooks(faults)
    from keyedstate.spark.session import local_session

    started = time.time()
    spark = local_session(plan.master, "keyedstate-chaos", {
        "spark.task.maxFailures": "4",
        "spark.sql.shuffle.partitions": "4",
        "spark.local.dir": os.path.join(run_dir, "spark-local"),
        "spark.deploy.maxExecutorRetries": "-1",
    })
    log_event(run_dir, "driver-start", app_id=spark.sparkContext.applicationId,
              start_s=time.time() - started, job=progress["job"],
              parallelism=progress["parallelism"])
    from keyedstate.testing.chaos import boundary

    while progress["job"] < len(plan.jobs):
        job = plan.jobs[progress["job"]]
        _housekeeping(plan, job.index)
        log_event(run_dir, "job-start", job=job.index, restore_mode=job.restore_mode,
                  spark_location=job.spark_location, rollback=job.rollback)
        if job.rollback and not os.path.exists(marker_path(run_dir, rollback_marker(job))):
            with faults.pause():
                result = rollback_check(spark, plan, run_dir, job)
            log_event(run_dir, "rollback-check", job=job.index, **result)
            claim_marker(run_dir, rollback_marker(job))
        if job.index == len(plan.jobs) - 1:
            run_job(spark, plan, run_dir, job, progress, faults).stop()
            read_final_state(spark, plan, run_dir, job)
        else:
            boundary.end_job(spark, plan, run_dir, job, progress, faults)
        with faults.pause():
            log_event(run_dir, "job-check", job=job.index,
                      **check_job_dir(plan, plan.job_dir(job.index)))
        second = plan.second_job
        if second and second["after_job"] == job.index and not progress.get("second_done"):
            boundary.run_second_job(spark, plan, run_dir, faults)
            progress["second_done"] = True
            write_progress(run_dir, progress)
        progress["job"] = job.index + 1
        progress["parallelism"] = None
        progress["checkpointing"] = None
        progress["segment"] = 0
        write_progress(run_dir, progress)
    log_event(run_dir, "done")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
