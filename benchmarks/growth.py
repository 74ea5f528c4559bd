"""Does a batch cost the same when the state is 50 times larger? (bounded batch cost)

The keyed count of ``bench throughput`` (:class:`~.throughput.KeyedCount`: a
``KeyedProcessFunction`` with a bigint ``ValueState`` per key, the per-key path
``process_key``) on real Spark (``local[2]`` by default), parallelism 2, checkpoints on the
local S3 server (moto on loopback, through s3fs; Spark's offset log on the local disk). Each
measured batch is ``events_per_batch`` (200 K) events over exactly ``distinct_keys`` (50 K)
distinct keys, drawn uniformly without replacement from the state's key space; the job runs
once with a state of ``small_keys`` (100 K) keys and once with ``keys`` (5 M), on each backend
(``rocksdb``, then ``heap``), each run a query of its own over generated Parquet files (one file
= one micro-batch, ``maxFilesPerTrigger=1``, ``trigger(availableNow=True)``).

**Loading the state.** The job itself loads it, in its first batches: ``load_batch_keys`` (1 M)
events per batch, each key of the key space exactly once over the loading batches (5 batches at
5 M keys). These batches are recorded (phase ``load``) and never measured. Why not a savepoint
written by the state processor API (``SavepointWriter``) that the job starts from: the job's
first batch would bulk-load it into empty backends (``restore_canonical``, a Python loop over
every record too, so hardly faster) and its first checkpoint would upload all of it: the state
of a job just restored from a bootstrap, not the one a running job holds after writing its state
itself. Loading through the job gives the state a long-running job has (its own backend files,
its checkpoint chain: RocksDB's shared SST files, the heap backend's base snapshot and diffs),
checks the loading batches' output like every other batch, and is fast enough: the load is
``keys`` calls of ``process_key`` in 2 subtasks (about 15 s per million keys on this 2-core
machine under other load; the JSON's ``load_s``), once per backend. Then ``warm_up_batches``
(1) batches of the measured shape (phase ``warm-up``, not measured: the first batch after the
large loading batches may still pay for their flushes and compactions) and ``batches`` (30)
measured batches. Before all runs, a throw-away run of the small state's loading batch and
``session_warm_up_batches`` (10) more on the first backend starts the Python workers and
JIT-compiles the JVM (without it, the first run's measured batches were 1.5x the next run's).

**Per batch** (every batch, every phase, in ``per_batch``): ``trigger_s``, Spark's
``triggerExecution`` of the micro-batch (listing, planning, the batch, the commit logs: the
clock of ``bench throughput``); ``driver_s``, the driver's part (``foreachBatch``: routing,
subtasks, checkpoint, sink); from the driver's :class:`~keyedstate.spark.driver.BatchStats`:
``uploaded_bytes`` (bytes the executors sent to the store for the checkpoint),
``incremental_bytes`` (the checkpoint's new state, from its handles), ``full_bytes`` (the
checkpoint's full size: every state file it references, i.e. what a restore reads: RocksDB's SST
files, older versions included until compactions drop them; the heap backend's base snapshot
and its chain of diffs), ``restored_subtasks`` / ``reused_subtasks`` (placement: a subtask
restores when the Python worker its task lands on holds no live copy of its state at the last
checkpoint; on ``local[2]`` either of two workers takes a task, on ``local-cluster`` either
executor too; ``caught_up_subtasks``: of those, how many caught a stale live copy up instead of
reading the whole state; ``background_caught_up_subtasks``: of the reused, how many found
their copy caught up in the background by their worker, ``keyedstate.live-copies.
background-catch-up``, with the longest such catch-up in ``background_catch_up_s``, off the
batch's path), ``restore_s`` (the slowest subtask's restore, 0 when all reused) with the bytes
restores downloaded or found in the executors' file caches; ``sink_s`` and ``verified``.

**Behind a latency model** (``--latency``; docs/object-storage.md, "A latency model for
benchmarks"): the checkpoints (``--store``: on the local S3 server, the default, or in a local
directory) are reached through ``kslatency://``, every request paying the model's first-byte
latency and its bytes at the model's per-stream bandwidth; the JSON records the model's
parameters. Every process (the driver, which runs in this process, and Spark's Python workers)
logs each request with its start time, so each batch's window (from its trigger to the next
one's) gets its requests: ``driver_requests``, ``worker_requests`` (with their modeled
seconds) and ``requests`` (by kind and by area of the root), and the phases the statistics do
not record: ``staging_s`` (the slowest worker's wall seconds writing staged output),
``metadata_commit_s`` (the driver's ``_metadata`` PUT), ``commit_requests_s`` (the commit
marker, deleting the staged files, listing old markers) and ``output_commit_s`` (those plus
``sink_s``). Each run summarizes the medians of every phase (``phases_median_s``: also
``sync_s``, ``async_s``, ``restore_s`` from the statistics) and of the requests per batch.
The local directory without a model is the baseline "checkpoints on local disk"; with a model
the same directory behaves as an object store (inlining, merging, the file cache: checkpoint
storage sees a remote filesystem) and pays its round trips.

**Output latency** (every batch's ``output_latency_s``): from the start of the trigger that
reads the batch's file (the file taken as published then) to the end of its sink commit
(:mod:`.growth_checkpointing` says why).

**Comparing checkpointing** (``--compare-checkpointing``, ``checkpointing=`` of :func:`run`;
:mod:`.growth_checkpointing`): at ``keys`` only, per backend, the job once with checkpoints on
local disk (no latency), once behind the latency model (synchronous) and once behind it in the
asynchronous mode (``async-upload``, one checkpoint in flight), judged by that module's goals;
``--repeats N`` runs them N times per backend, in order then reversed, and pools them.
In the asynchronous mode a batch's statistics come when its checkpoint completes, during the
next batch: its ``driver_s`` runs to its sink commit there, and a batch's window of requests
holds the previous batch's ``_metadata`` and commit.

**Verification.** The job's only sink reads each batch's output (the staged files, in the
driver) and compares it key by key with the generated data's counts: the keys of the batch,
each with its count so far. A batch missing, differing or run with another number of input rows
fails the run.

**Per (backend, keys)**: median, p90 (linear interpolation) and max of the measured batches'
``trigger_s``; the largest upload (bytes, and as a fraction of that checkpoint's
``full_bytes``); restored and reused subtasks summed. Goals, per backend: the median at
``keys`` at most 1.3x the median at ``small_keys``; the p90 and the max at ``keys`` at most 2x
the median at ``keys``.

Run ``keyedstate bench growth [--keys N] [--latency MODEL]`` or, with the master, backends,
batches, store and sizes, ``python -m keyedstate_benchmarks.growth --master
local-cluster[2,1,1024] --out docs/bench-results/growth.json`` (the figure goes to
``docs/img/growth.png``, ``--plot``). The generated batches and the verifying sink are in
:mod:`.growth_workload`, what a batch's requests tell in :mod:`.growth_requests`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from keyedstate.testing.latency import LatencyModel, read_request_log

from .common import Location, behind, latency_model, machine, save_figure, workdir
from .cpu import CpuSampler, cpu_medians
from .growth_checkpointing import MODES, Checkpointing, compare, modes
from .growth_checkpointing import compute_goals as checkpointing_goals
from .growth_checkpointing import plot as plot_checkpointing
from .growth_requests import (
    LOGGED_PHASES,
    check_protocol_installed,
    describe_store,
    request_phases,
)
from .growth_workload import LOAD, MEASURED, Batch, VerifiedCounts, write_workload
from .remote import STORE_PRIORITIES, LocalS3
from .throughput import OUTPUT_DDL, KeyedCount, _input, spark_version

BACKENDS = ("rocksdb", "heap")
#: where checkpoints go: the local S3 server (moto on loopback) or a local directory
STORES = ("s3", "local")
#: the small state's keys (the reference of the median goal)
SMALL_KEYS = 100_000
#: the goals: the large state's median at most this times the small state's ...
GOAL_MEDIAN_RATIO = 1.3
#: ... and its p90 and max at most this times its own median
GOAL_TAIL_RATIO = 2.0
#: --compare-checkpointing's latency model when none is given
COMPARE_MODEL = "s3-standard-same-region"


# --------------------------------------------------------------------------------------------
# one run: one backend, one state size
# --------------------------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def with_options(config: Any, options: Mapping[str, str]) -> Any:
    """``config`` (a :class:`~keyedstate.config.JobConfig`) with ``options`` (dotted keys to
    values in their string form, as ``--job-option`` gives them) set, parsed as
    :meth:`~keyedstate.config.JobConfig.from_mapping` parses them."""
    if not options:
        return config
    from keyedstate.config import JobConfig

    parsed = JobConfig.from_mapping({"execution.checkpointing.dir": config.checkpoint_dir,
                                     **options})
    fields = JobConfig.keys()
    return replace(config, **{fields[k]: getattr(parsed, fields[k]) for k in options})


def run_job(spark: Any, store: Callable[[str, str], Location], backend: str,
            workload: Sequence[Batch], root: str, parallelism: int, name: str,
            async_upload: bool = False, job_options: Mapping[str, str] | None = None,
            cpu: CpuSampler | None = None) -> tuple[list[dict[str, Any]], float]:
    """Run the keyed count over ``workload`` (its own query, checkpoints in the folder ``name``
    of the store: ``store(root, name)`` gives it; with ``async_upload``, in the asynchronous
    mode, one checkpoint in flight; ``job_options``, dotted keys, set last) and verify every
    batch's output; returns each batch's figures (module docstring; ``cpu_s`` from ``cpu``)
    and the query's wall seconds."""
    from keyedstate.config import JobConfig
    from keyedstate.spark.api import key_by

    os.makedirs(root)
    location = store(root, name)
    events = _input(spark, root, [b.path for b in workload])
    sink = VerifiedCounts(workload)
    job = key_by(events, "user_id").process(KeyedCount(), OUTPUT_DDL).sink(sink)
    started = time.perf_counter()
    config = with_options(JobConfig(checkpoint_dir=location.url("ckpt"),
                                    parallelism=parallelism, backend=backend,
                                    storage_options=location.options,
                                    local_dir=os.path.join(root, "local"),
                                    async_upload=async_upload, max_concurrent_checkpoints=1),
                          job_options or {})
    query = job.start(config,
                      spark_checkpoint_location=os.path.join(root, "spark"),
                      trigger={"availableNow": True})
    try:
        query.await_termination()
    finally:
        query.stop()
    wall_s = time.perf_counter() - started
    ended = time.time()
    # Step 1. Every batch's output right, and every batch read its whole file.
    sink.check(name)
    progress = {p.batchId: p for p in query.query.recentProgress if p.numInputRows > 0}
    rows = [progress[b].numInputRows if b in progress else None for b in range(len(workload))]
    if rows != [b.events for b in workload] or len(progress) != len(workload):
        raise AssertionError(f"{name}: expected batches of {[b.events for b in workload]} rows, "
                             f"Spark reports {rows} for batches 0..{len(workload) - 1} and "
                             f"{len(progress)} batches with rows (spark.sql.streaming."
                             f"numRecentProgressUpdates too small?)")
    stats = {s.batch_id: s for s in query.stats if s.checkpoint_id >= 0}
    if sorted(stats) != list(range(len(workload))):
        raise AssertionError(f"{name}: checkpoints for batches {sorted(stats)}, expected "
                             f"0..{len(workload) - 1}")
    # Step 2. Every batch's figures; behind a latency model, its requests and the phases
    # they time (each batch's window: from its trigger to the next one's).
    records = read_request_log(location.log_dir) if location.log_dir else None
    starts = [_epoch(progress[b].timestamp) for b in range(len(workload))]
    per_batch = []
    for batch_id, batch in enumerate(workload):
        s, p = stats[batch_id], progress[batch_id]
        end = starts[batch_id + 1] if batch_id + 1 < len(starts) else ended
        requests = (request_phases(records, starts[batch_id], end, os.getpid(),
                                   sink.seconds[batch_id])
                    if records is not None else {})
        per_batch.append({
            "batch_id": batch_id, "phase": batch.phase, "events": batch.events,
            "keys": int(len(batch.keys)),
            "trigger_s": p.durationMs["triggerExecution"] / 1000, "driver_s": s.duration_s,
            # Spark's split of the trigger (addBatch is foreachBatch: keyedstate's batch)
            "spark_phases_s": {k: v / 1000 for k, v in p.durationMs.items()},
            "sink_s": sink.seconds[batch_id], "checkpoint_id": s.checkpoint_id,
            # from the trigger that reads the batch's file to its sink commit's end
            "output_latency_s": sink.committed_at[batch_id] - starts[batch_id],
            "uploaded_bytes": s.uploaded_bytes, "incremental_bytes": s.incremental_bytes,
            "full_bytes": s.full_bytes, "objects_written": s.objects_written,
            "restored_subtasks": s.restored_subtasks, "reused_subtasks": s.reused_subtasks,
            "caught_up_subtasks": s.caught_up_subtasks,
            "background_caught_up_subtasks": s.background_caught_up_subtasks,
            "background_catch_up_s": s.background_catch_up_s,
            "restore_s": s.restore_s, "restore_downloaded_bytes": s.restore_downloaded_bytes,
            "restore_cache_hit_bytes": s.restore_cache_hit_bytes,
            "sync_s": s.sync_duration_s, "async_s": s.async_duration_s,
            "verified": sink.verified[batch_id],
            # CPU seconds by process in the batch's window (benchmarks/cpu.py)
            "cpu_s": cpu.window(starts[batch_id], end) if cpu is not None else None,
            **requests,
        })
    return per_batch, wall_s


def _epoch(timestamp: str) -> float:
    """Seconds since the epoch of a progress report's ISO timestamp (a trigger's start)."""
    return dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()



def run_one(spark: Any, store: Callable[[str, str], Location], backend: str, keys: int,
            workload: Sequence[Batch], root: str, parallelism: int,
            mode: Checkpointing | None = None, job_options: Mapping[str, str] | None = None,
            cpu: CpuSampler | None = None, repeat: int = 0) -> dict[str, Any]:
    """:func:`run_job` for ``backend`` at ``keys`` keys (checkpointing as ``mode`` says, if
    given; ``repeat``: which run of that mode, with checkpoints of its own), and the summary
    of its measured batches: median, p90 and max seconds (also the median of the batches
    where every subtask reused its live copy and of those where one restored: placement),
    output latency, uploads, state size, CPU seconds by process."""
    load_before = os.getloadavg()[0]
    name = f"{backend}-{keys}" + (f"-{mode.name}" if mode is not None else "") \
        + (f"-repeat-{repeat}" if repeat else "")
    per_batch, wall_s = run_job(spark, store, backend, workload, root, parallelism, name,
                                async_upload=mode is not None and mode.async_upload,
                                job_options=job_options, cpu=cpu)
    measured = [b for b in per_batch if b["phase"] == MEASURED]
    seconds = [b["trigger_s"] for b in measured]
    largest = max(measured, key=lambda b: b["uploaded_bytes"])
    latency = [b["output_latency_s"] for b in measured]
    return {
        "backend": backend, "keys": keys,
        **({"checkpointing": mode.name, "repeat": repeat} if mode is not None else {}),
        "load_batches": sum(b["phase"] == LOAD for b in per_batch),
        "load_s": sum(b["trigger_s"] for b in per_batch if b["phase"] == LOAD),
        "batches": len(measured),
        "median_s": statistics.median(seconds), "p90_s": _percentile(seconds, 90),
        "max_s": max(seconds), "mean_s": statistics.fmean(seconds),
        "seconds_per_batch": seconds,
        "output_latency_median_s": statistics.median(latency),
        "output_latency_p90_s": _percentile(latency, 90),
        "median_all_reused_s": _median_or_none([b["trigger_s"] for b in measured
                                                if not b["restored_subtasks"]]),
        "median_any_restored_s": _median_or_none([b["trigger_s"] for b in measured
                                                  if b["restored_subtasks"]]),
        "largest_upload_bytes": largest["uploaded_bytes"],
        "largest_upload_fraction": largest["uploaded_bytes"] / max(1, largest["full_bytes"]),
        "median_upload_bytes": statistics.median(b["uploaded_bytes"] for b in measured),
        "full_bytes_last": measured[-1]["full_bytes"],
        "full_bytes_max": max(b["full_bytes"] for b in measured),
        "restored_subtasks": sum(b["restored_subtasks"] for b in measured),
        "reused_subtasks": sum(b["reused_subtasks"] for b in measured),
        "caught_up_subtasks": sum(b["caught_up_subtasks"] for b in measured),
        "background_caught_up_subtasks": sum(b["background_caught_up_subtasks"]
                                             for b in measured),
        "phases_median_s": {phase: _median_or_none([b[phase] for b in measured
                                                     if b.get(phase) is not None])
                            for phase in ("sync_s", "async_s", "restore_s", *LOGGED_PHASES,
                                          "sink_s")},
        "cpu_median_s": cpu_medians(measured),
        "requests_per_batch_median": {
            who: _median_or_none([b[f"{who}_requests"] for b in measured
                                  if f"{who}_requests" in b])
            for who in ("driver", "worker")},
        "wall_s": wall_s,
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "verified": all(b["verified"] for b in per_batch),
        "per_batch": per_batch,
    }


# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------


def run(keys: int = 5_000_000, small_keys: int = SMALL_KEYS, batches: int = 30,
        warm_up_batches: int = 1, events_per_batch: int = 200_000, distinct_keys: int = 50_000,
        load_batch_keys: int = 1_000_000, backends: Sequence[str] = BACKENDS,
        session_warm_up_batches: int = 10, parallelism: int = 2, master: str = "local[2]",
        progress: Callable[[str], None] | None = None, spark: Any = None, store: str = "s3",
        latency: str | LatencyModel | None = None, checkpointing: Sequence[str] = (),
        job_options: Mapping[str, str] | None = None, store_priority: str = "normal",
        repeats: int = 1) -> dict[str, Any]:
    """Run the keyed count at ``small_keys`` and at ``keys`` keys on each of ``backends``
    (module docstring); fails if any batch's output differs from the generated data's. First,
    a throw-away run of the small state's loading batches and ``session_warm_up_batches``
    more on the first backend warms the session up. ``spark``: a session to use (else one on
    ``master`` is started and stopped here). ``store``: checkpoints on the local S3 server
    (``"s3"``) or a local directory (``"local"``); ``latency``: a latency model they are
    behind (``--latency``: ``none``, a model's name or figures such as ``ms=30,mb_per_s=90``;
    docs/object-storage.md, "A latency model for benchmarks").

    ``checkpointing``: modes of :mod:`.growth_checkpointing` (``local-disk``,
    ``latency-sync``, ``latency-async``; ``--compare-checkpointing`` runs all three): the job
    runs at ``keys`` only (``small_keys`` <= ``keys`` is the session warm-up's state), once
    per mode on each backend, behind ``latency`` (default :data:`COMPARE_MODEL`), and the
    goals are those of :func:`.growth_checkpointing.compute_goals`. ``repeats``: how many
    times each backend runs its modes, in order then reversed (only with ``checkpointing``;
    the comparison and the goals pool a mode's repeats: :mod:`.growth_checkpointing`).

    ``job_options``: settings (dotted keys, values in their string form) of every job's
    configuration, set after the benchmark's own (``--job-option``); the JSON's workload
    records them."""
    from keyedstate.spark.session import local_session

    model = latency_model(latency)
    if checkpointing and model is None:
        model = latency_model(COMPARE_MODEL)
    chosen: list[Checkpointing | None] = list(modes(checkpointing, store)) or [None]
    if model is not None:
        check_protocol_installed()
    if store not in STORES:
        raise ValueError(f"unknown store {store!r}; known: {list(STORES)}")
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        raise ValueError(f"unknown backends {unknown or backends}; known: {list(BACKENDS)}")
    if not (0 < small_keys <= keys if checkpointing else 0 < small_keys < keys):
        raise ValueError(f"keys ({keys:,}) must be more than the small state's {small_keys:,}")
    if not 0 < distinct_keys <= min(small_keys, events_per_batch):
        raise ValueError(f"distinct_keys ({distinct_keys:,}) must be at most the small state's "
                         f"keys ({small_keys:,}) and the events per batch ({events_per_batch:,})")
    if repeats < 1 or (repeats > 1 and not checkpointing):
        raise ValueError(f"repeats ({repeats}) must be at least 1, and more than 1 only when "
                         f"comparing checkpointing modes")
    if batches < 2 or load_batch_keys < 1 or warm_up_batches < 0 or session_warm_up_batches < 0:
        raise ValueError("run at least 2 measured batches, with load_batch_keys >= 1 and no "
                         "negative number of warm-up batches")
    say = progress or (lambda msg: None)
    own_session = spark is None
    sizes = (keys,) if checkpointing else (small_keys, keys)
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    with ExitStack() as stack:
        root = stack.enter_context(workdir("growth"))
        uses_s3 = any((m.store if m is not None else store) == "s3" for m in chosen)
        s3 = stack.enter_context(LocalS3(priority=store_priority)) if uses_s3 else None
        cpu = stack.enter_context(CpuSampler(s3.proc.pid if s3 is not None else None))

        def location_of(mode: Checkpointing | None) -> Callable[[str, str], Location]:
            def location(run_root: str, name: str) -> Location:
                """A run's checkpoints: a folder of the bucket or of the run's directory,
                behind the model (unless ``mode`` says not), whose requests the run's
                directory logs."""
                on_s3 = (mode.store if mode is not None else store) == "s3"
                base, options = (s3.url(name), s3.options) if on_s3 and s3 is not None else \
                    (os.path.join(run_root, "store"), {})
                shaped = model if mode is None or mode.behind_model else None
                return behind(base, options, shaped, os.path.join(run_root, "requests"))
            return location

        workloads: dict[int, list[Batch]] = {}
        for size in dict.fromkeys((small_keys, *sizes)):
            say(f"generating {size:,} keys' batches")
            workloads[size] = write_workload(os.path.join(root, f"data-{size}"), size,
                                             load_batch_keys, warm_up_batches, batches,
                                             events_per_batch, distinct_keys)
        if own_session:
            say(f"starting Spark ({master})")
            most = max(len(w) for w in workloads.values())
            spark = local_session(master, "keyedstate-bench-growth", {
                "spark.sql.shuffle.partitions": str(parallelism),
                # every batch's progress is read back at the end
                "spark.sql.streaming.numRecentProgressUpdates": str(max(100, most + 10))})
        try:
            # The session's first batches pay for starting Python workers and JIT-compiling
            # the JVM's hot paths (in a first try, a first measured run's batches were still
            # 1.5x the next run's): a throw-away run of the small state's first batches.
            warm_up: dict[str, Any] = {"backend": backends[0], "keys": small_keys,
                                       "batches": 0, "wall_s": 0.0}
            if session_warm_up_batches:
                first = workloads[small_keys]
                first = first[:sum(b.phase == LOAD for b in first) + session_warm_up_batches]
                say(f"warming up the session: {len(first)} throw-away batches")
                per_batch, wall_s = run_job(spark, location_of(chosen[0]), backends[0], first,
                                            os.path.join(root, "session-warm-up"), parallelism,
                                            "session-warm-up", job_options=job_options)
                warm_up.update(batches=len(per_batch), wall_s=wall_s,
                               trigger_s=[b["trigger_s"] for b in per_batch])
            # A stopped job's live copies stay in the Python workers a while: the heap
            # backend's are millions of Python objects, so heap runs last (default order).
            # Repeats run the modes in order, then reversed (ABC CBA), so that a load drifting
            # over a backend's runs weighs on every mode alike.
            for backend in backends:
                for size in sizes:
                    for repeat in range(repeats):
                        for mode in chosen if repeat % 2 == 0 else chosen[::-1]:
                            workload = workloads[size]
                            named = f"{backend}-{size}" + (f"-{mode.name}" if mode else "") \
                                + (f"-repeat-{repeat}" if repeat else "")
                            say(f"{named}: {sum(b.phase == LOAD for b in workload)} loading + "
                                f"{warm_up_batches} warm-up + {batches} measured batches")
                            results.append(run_one(spark, location_of(mode), backend, size,
                                                   workload, os.path.join(root, named),
                                                   parallelism, mode, job_options=job_options,
                                                   cpu=cpu, repeat=repeat))
            master = spark.sparkContext.master  # a session given may run elsewhere
        finally:
            if own_session:
                spark.stop()
    goals = (checkpointing_goals(results, model.name) if checkpointing and model is not None
             else compute_goals(results, small_keys, keys))
    return {
        "benchmark": "growth",
        "machine": {**machine(), "master": master, "spark": spark_version(),
                    "shuffle_partitions": parallelism},
        "workload": {"keys": keys, "small_keys": small_keys, "batches": batches,
                     "warm_up_batches": warm_up_batches, "events_per_batch": events_per_batch,
                     "distinct_keys_per_batch": distinct_keys, "load_batch_keys": load_batch_keys,
                     "session_warm_up_batches": session_warm_up_batches,
                     "repeats": repeats, "parallelism": parallelism, "backends": list(backends),
                     "job_options": dict(job_options or {}),
                     "function": "throughput.KeyedCount (process_key, bigint ValueState)",
                     "storage": describe_store(store, model),
                     "store": store,
                     # the local S3 server's CPU scheduling (benchmarks/remote.py, LocalS3)
                     "store_priority": store_priority if uses_s3 else None,
                     "latency": model.parameters() if model is not None else None,
                     "checkpointing": [m.describe() for m in chosen if m is not None] or None,
                     "timing": "trigger_s: Spark's triggerExecution of each micro-batch; "
                               "median, p90, max of the measured batches"},
        "total_s": time.perf_counter() - started,
        "session_warm_up": warm_up,
        "results": results,
        **({"comparison": compare(results)} if checkpointing else {}),
        "goals": goals,
        "goals_met": bool(goals) and all(g["met"] for g in goals.values()),
    }


def compute_goals(results: Sequence[dict[str, Any]], small_keys: int, keys: int
                  ) -> dict[str, dict[str, Any]]:
    """Per backend: the median batch at ``keys`` against the one at ``small_keys`` (at most
    :data:`GOAL_MEDIAN_RATIO`), and the p90 and the max batch at ``keys`` against its median
    (at most :data:`GOAL_TAIL_RATIO` each)."""
    by = {(r["backend"], r["keys"]): r for r in results}
    goals: dict[str, dict[str, Any]] = {}
    for backend in dict.fromkeys(r["backend"] for r in results):
        small, large = by.get((backend, small_keys)), by.get((backend, keys))
        if small is None or large is None:
            continue
        ratio = large["median_s"] / small["median_s"]
        goals[f"{backend}: median at {keys:,} keys <= {GOAL_MEDIAN_RATIO:g}x median at "
              f"{small_keys:,}"] = {"ratio": ratio, "target": GOAL_MEDIAN_RATIO,
                                    "met": ratio <= GOAL_MEDIAN_RATIO}
        for stat in ("p90", "max"):
            ratio = large[f"{stat}_s"] / large["median_s"]
            goals[f"{backend}: {stat} at {keys:,} keys <= {GOAL_TAIL_RATIO:g}x its median"] = {
                "ratio": ratio, "target": GOAL_TAIL_RATIO, "met": ratio <= GOAL_TAIL_RATIO}
    return goals


# --------------------------------------------------------------------------------------------
# the figure
# --------------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: str) -> None:
    """One panel per backend: each measured batch's seconds at both state sizes (a ring where a
    subtask restored its state instead of reusing its live copy), their medians (dotted) and
    the goals' lines (dashed: 1.3x the small state's median, 2x the large state's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    backends = list(dict.fromkeys(r["backend"] for r in result["results"]))
    fig, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 4.4), dpi=120,
                             sharey=True, squeeze=False)
    w = result["workload"]
    colors = {w["small_keys"]: "#7f7f7f", w["keys"]: "#1f77b4"}
    top = max(max(r["seconds_per_batch"]) for r in result["results"])
    for ax, backend in zip(axes[0], backends):
        ringed = False
        for r in (r for r in result["results"] if r["backend"] == backend):
            measured = [b for b in r["per_batch"] if b["phase"] == MEASURED]
            xs = range(1, len(measured) + 1)
            color = colors.get(r["keys"], "#ff7f0e")
            ax.plot(xs, [b["trigger_s"] for b in measured], marker="o", markersize=3,
                    color=color, label=f"{r['keys']:,} keys (median {r['median_s']:.2f} s, "
                                       f"p90 {r['p90_s']:.2f}, max {r['max_s']:.2f})")
            restored = [(x, b["trigger_s"]) for x, b in zip(xs, measured)
                        if b["restored_subtasks"]]
            if restored:
                ax.scatter([x for x, _ in restored], [y for _, y in restored], s=40,
                           facecolors="none", edgecolors=color, linewidths=1,
                           label=None if ringed else "a subtask restored (no live copy)")
                ringed = True
            ax.axhline(r["median_s"], color=color, linestyle=":", linewidth=1)
            if r["keys"] == w["keys"]:
                ax.axhline(GOAL_TAIL_RATIO * r["median_s"], color="#d62728", linestyle="--",
                           linewidth=1, label=f"goal: p90, max <= {GOAL_TAIL_RATIO:g}x median")
            else:
                ax.axhline(GOAL_MEDIAN_RATIO * r["median_s"], color="#2ca02c", linestyle="--",
                           linewidth=1, label=f"goal: median <= {GOAL_MEDIAN_RATIO:g}x "
                                              f"{r['keys']:,} keys' median")
        ax.set_ylim(0, 1.5 * top)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("measured batch")
        ax.set_title(backend, fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("seconds per batch (Spark's triggerExecution)")
    m = result["machine"]
    fig.suptitle(f"Batch time as the state grows: {w['events_per_batch']:,} events over "
                 f"{w['distinct_keys_per_batch']:,} keys per batch, {m['master']}, checkpoints "
                 f"on {w.get('storage', 'S3 (moto)')}; {m['date']}, load average "
                 f"{m['load_average']}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="keyedstate bench growth, with its options")
    parser.add_argument("--keys", type=int, default=5_000_000, help="the large state's keys")
    parser.add_argument("--batches", type=int, default=30, help="measured batches per run")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated, run in this order")
    parser.add_argument("--master", default="local[2]",
                        help="Spark master, e.g. local-cluster[2,1,1024]")
    parser.add_argument("--store", choices=STORES, default="s3",
                        help="checkpoints on the local S3 server or a local directory "
                             "(default: %(default)s)")
    parser.add_argument("--latency", default=None,
                        help="the checkpoints' latency model: none, s3-standard-same-region or "
                             "figures such as ms=30,mb_per_s=90 (default: none; "
                             f"{COMPARE_MODEL} with --compare-checkpointing)")
    parser.add_argument("--compare-checkpointing", action="store_true",
                        help="at --keys only, per backend: checkpoints on local disk, behind "
                             "the latency model, and behind it in the asynchronous mode, "
                             "judged by the asynchronous phase's goals")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --compare-checkpointing, run each backend's modes this many "
                             "times, in order then reversed, and pool them (default: "
                             "%(default)s)")
    parser.add_argument("--store-priority", choices=STORE_PRIORITIES, default="normal",
                        help="the local S3 server's CPU scheduling: normal, or idle (it runs "
                             "only on a core the job leaves idle, as a remote store's CPU is "
                             "not the job's; default: %(default)s)")
    parser.add_argument("--job-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of every job's configuration (dotted key, e.g. "
                             "keyedstate.live-copies.background-restore=true); repeatable")
    parser.add_argument("--small-keys", type=int, default=SMALL_KEYS,
                        help="the small state's keys (default: %(default)s)")
    parser.add_argument("--events-per-batch", type=int, default=200_000)
    parser.add_argument("--distinct-keys", type=int, default=50_000,
                        help="distinct keys per measured batch (default: %(default)s)")
    parser.add_argument("--load-batch-keys", type=int, default=1_000_000,
                        help="keys per loading batch (default: %(default)s)")
    parser.add_argument("--session-warm-up-batches", type=int, default=10)
    parser.add_argument("--out", default=None, help="write the JSON result here (and the "
                                                    "figure to --plot)")
    parser.add_argument("--plot", default=None,
                        help="the figure's path, written with --out (default: "
                             "docs/img/growth.png, with --compare-checkpointing "
                             "docs/img/growth-checkpointing.png)")
    parser.add_argument("--from-json", default=None,
                        help="draw the figure of a saved result to --plot, run nothing")
    args = parser.parse_args(argv)
    if args.compare_checkpointing and args.latency is not None \
            and latency_model(args.latency) is None:
        parser.error("--compare-checkpointing compares checkpoints behind a latency model "
                     f"with local disk: give one (--latency {COMPARE_MODEL}, the default) "
                     "instead of none")
    figure = args.plot or os.path.join("docs", "img", "growth-checkpointing.png"
                                       if args.compare_checkpointing else "growth.png")
    if args.from_json:
        with open(args.from_json) as f:
            draw(json.load(f), figure)
        return
    result = run(keys=args.keys, batches=args.batches, master=args.master,
                 backends=[b.strip() for b in args.backends.split(",") if b.strip()],
                 store=args.store, latency=args.latency, small_keys=args.small_keys,
                 events_per_batch=args.events_per_batch, distinct_keys=args.distinct_keys,
                 load_batch_keys=args.load_batch_keys,
                 session_warm_up_batches=args.session_warm_up_batches,
                 checkpointing=MODES if args.compare_checkpointing else (),
                 job_options=dict(o.split("=", 1) for o in args.job_option),
                 store_priority=args.store_priority, repeats=args.repeats,
                 progress=lambda message: print(message, file=sys.stderr, flush=True))
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        draw(result, figure)
    print(text)


def draw(result: dict[str, Any], path: str) -> None:
    """The figure of a result: :func:`plot`, or that of the checkpointing comparison."""
    if result.get("comparison") is not None:
        plot_checkpointing(result, path)
    else:
        plot(result, path)


if __name__ == "__main__":
    main()
