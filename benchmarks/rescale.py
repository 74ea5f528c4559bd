"""Rescaling a keyed job on Spark: keyedstate's restore at another parallelism against Spark's
offline state repartition (docs/rescaling.md).

**The state.** ``keys`` keys (``user-00000000`` ...), one event each, in Parquet files of
``chunk_keys`` keys; key ``i`` carries ``amount = i % 997``. Both systems keep, per key, one
small value ``(count bigint, total double)``: keyedstate in a ``ValueState`` of a
:class:`KeyedProcessFunction` (RocksDB backend), Spark in the ``GroupState`` of an
``applyInPandasWithState`` query (RocksDB state store provider). Both build it with a real
streaming query over those files, at parallelism 4 (keyedstate: ``parallelism.default``;
Spark: ``spark.sql.shuffle.partitions``), one checkpoint per micro-batch.

**keyedstate: time until the job runs with all its state.** A new job is started from a
retained checkpoint (``execution.state-recovery.path``, NO_CLAIM, fresh checkpoint directory
and Spark checkpoint location) at parallelism 4 (same), 8 (from the p=4 checkpoint), 8 (from
a p=8 checkpoint, same) and 3 (from that p=8 checkpoint), its input one *probe* file: one
event (``amount = 0.5``) for each of up to ``probes`` keys spread over the whole key range.
The timer starts just before ``KeyedProcessJob.start`` and stops when the first batch's
checkpoint is completed and its sink committed (keyedstate's batch listener, inside
``foreachBatch``). It covers, with nothing subtracted: checking the snapshot (every file's size
and checksum), starting the Spark query, listing and planning the batch, routing the probe
events, every subtask's restore (hard-linking its SST files from the checkpoint directory into
its local directory, opening RocksDB, clipping when rescaled), processing the probe events,
every subtask's first checkpoint (NO_CLAIM: the restored files copied into the new job's
directory) and completing it, and committing the sink. All p subtasks run in that batch, with
or without rows, grouped into the cluster's task slots (``keyedstate.spark.tasks``), so every
subtask has restored its state when the timer stops. Configurations run ``repeats`` times, interleaved; figures are medians.

Verification, outside the timer: the probe output must hold each probe key once with its
count and total as expected, and (each configuration's first run; ``verify_every_run``: all)
the checkpoint the restored job wrote is read back with keyedstate's state processor
(:class:`~keyedstate.spark.processor.SavepointReader`): its number of keys, sum of counts and
sum of totals must equal the built state's plus the probes.

**Spark: offline repartition.** ``spark._streamingCheckpointManager.repartition(checkpoint,
n)`` (Spark 4.2+; the query must be stopped; it writes a new batch holding the repartitioned
state) of a copy of the built checkpoint, 4 -> 8 then 8 -> 3, each followed by a restart of
the query with a probe file (time until its first batch's ``foreachBatch`` returned, the
same point as keyedstate's), and a restart without repartition (4 -> 4) for reference. The
repartitioned state is verified with Spark's ``statestore`` data source (number of state
partitions, number of keys, sums) and by the probe outputs of the restarted query.
``applyInPandasWithState`` builds state at a few thousand keys per second on this machine, so
Spark's state is built for at most ``spark_build_budget_s`` seconds (whole files): when that
is fewer keys than ``keys``, keyedstate is also measured at exactly Spark's key count (a
checkpoint retained from its own build at that point), and that same-size comparison is the
goal's; the per-key comparison with the full-size keyedstate state is reported too.

**Savepoints** of the full keyedstate state (its last build checkpoint): native (hard links,
same disk; and byte copies onto another filesystem, ``/dev/shm``, where no link is possible)
and canonical (Parquet, re-encoded), with their sizes against the checkpoint's.

Goals (set with savepoints and rescaling, docs/rescaling.md): a rescaled restore takes at most 1.5x
a same-parallelism restore of the same snapshot; keyedstate's rescale is at least 5x faster than
Spark's repartition.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.state.descriptors import ValueStateDescriptor

from .common import machine, save_figure, workdir

INPUT_SCHEMA = pa.schema([("user_id", pa.string()), ("amount", pa.float64())])
INPUT_DDL = "user_id string, amount double"
OUTPUT_DDL = "user_id string, count bigint, total double"
STATE_DDL = "count bigint, total double"
STATE_NAME = "totals"
PROBE_AMOUNT = 0.5
AMOUNT_MODULO = 997
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
GOAL_RESCALE_VS_SAME = 1.5
GOAL_VS_SPARK = 5.0
#: the restore configurations: (label, source parallelism, target parallelism)
CONFIGS = (("4->4", 4, 4), ("4->8", 4, 8), ("8->8", 8, 8), ("8->3", 8, 3))
#: the same-parallelism restore each rescale is compared with
BASELINE_OF = {"4->8": "4->4", "8->3": "8->8"}

Say = Callable[[str], None]


# --------------------------------------------------------------------------------------------
# the user functions
# --------------------------------------------------------------------------------------------


class KeyedTotals(KeyedProcessFunction):
    """Count and total of ``amount`` per key in one ValueState. Emits a row only for a key
    that already had state (the probes after a restore), so building the state emits
    nothing."""

    totals = ValueStateDescriptor(STATE_NAME, STATE_DDL)

    def open(self, ctx: Context) -> None:
        self.state = ctx.get_state(self.totals)

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[tuple[Any, ...]]:
        current = self.state.value()
        count, total = (current["count"], current["total"]) if current else (0, 0.0)
        new_count = count + rows.num_rows
        new_total = total + float(sum(rows.column("amount").to_pylist()))
        self.state.update({"count": new_count, "total": new_total})
        return [(key, new_count, new_total)] if current else []


def totals_with_group_state(key: tuple[Any, ...], pdfs: Iterator[Any], state: Any
                            ) -> Iterator[Any]:
    """``applyInPandasWithState``: the same count and total in a GroupState, the same output."""
    import pandas as pd

    existed = bool(state.exists)
    count, total = state.get if existed else (0, 0.0)
    for pdf in pdfs:
        count += len(pdf)
        total += float(pdf["amount"].sum())
    state.update((count, total))
    if existed:
        yield pd.DataFrame({"user_id": [key[0]], "count": [count], "total": [total]})


# --------------------------------------------------------------------------------------------
# data and what the state must hold
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Data:
    """The generated input: ``chunks[n]`` holds keys ``[starts[n], starts[n + 1])``."""

    root: str
    keys: int
    chunks: list[str]
    starts: list[int]


def key_names(start: int, stop: int) -> pa.Array:
    return pa.array([f"user-{i:08d}" for i in range(start, stop)], pa.string())


def write_chunks(directory: str, keys: int, chunk_keys: int) -> Data:
    """Parquet files of ``chunk_keys`` keys each (one event per key, ``amount = i % 997``),
    with increasing modification times (the file source takes them in that order)."""
    os.makedirs(directory, exist_ok=True)
    chunks, starts = [], []
    for n, start in enumerate(range(0, keys, chunk_keys)):
        stop = min(start + chunk_keys, keys)
        table = pa.table({"user_id": key_names(start, stop),
                          "amount": (np.arange(start, stop) % AMOUNT_MODULO).astype(np.float64)},
                         schema=INPUT_SCHEMA)
        path = os.path.join(directory, f"chunk-{n:04d}.parquet")
        pq.write_table(table, path, row_group_size=250_000)
        os.utime(path, (1_800_000_000 + n, 1_800_000_000 + n))
        chunks.append(path)
        starts.append(start)
    return Data(directory, keys, chunks, [*starts, keys])


def probe_indices(keys: int, probes: int) -> np.ndarray:
    """Up to ``probes`` distinct key indices spread evenly over ``[0, keys)``."""
    return np.unique(np.linspace(0, keys - 1, min(probes, keys)).astype(np.int64))


def write_probe(path: str, keys: int, probes: int, seq: int) -> None:
    """One event (``amount = 0.5``) for each probe key of a ``keys``-key state."""
    idx = probe_indices(keys, probes)
    table = pa.table({"user_id": pa.array([f"user-{i:08d}" for i in idx], pa.string()),
                      "amount": np.full(idx.size, PROBE_AMOUNT)}, schema=INPUT_SCHEMA)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table, path)
    os.utime(path, (1_900_000_000 + seq, 1_900_000_000 + seq))


@dataclass(frozen=True)
class Expected:
    """What a state built from the first ``keys`` keys holds after ``probed`` probe batches."""

    keys: int
    probes: int
    probed: int = 0

    @property
    def probe_keys(self) -> np.ndarray:
        return probe_indices(self.keys, self.probes)

    def totals(self) -> tuple[int, int, float]:
        """(keys, sum of counts, sum of totals)."""
        base = (np.arange(self.keys, dtype=np.int64) % AMOUNT_MODULO).sum()
        n = self.probe_keys.size * self.probed
        return self.keys, self.keys + n, float(base) + PROBE_AMOUNT * n

    def check_probe_output(self, rows: Sequence[tuple[str, int, float]], who: str) -> None:
        """``rows`` (user_id, count, total) are the output of probe batch ``probed``: one row
        per probe key with its count and total after that batch."""
        idx = self.probe_keys
        want = {f"user-{i:08d}": (1 + self.probed, float(i % AMOUNT_MODULO)
                                  + PROBE_AMOUNT * self.probed) for i in idx}
        got: dict[str, tuple[int, float]] = {}
        for user, count, total in rows:
            if user in got:
                raise AssertionError(f"{who}: key {user} output twice")
            got[user] = (int(count), float(total))
        if got != want:
            wrong = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            raise AssertionError(
                f"{who}: probe output differs for {len(wrong)} of {len(want)} keys, e.g. "
                f"{[(k, got.get(k), want.get(k)) for k in wrong[:3]]} (got, expected)")


def _link(paths: Sequence[str], directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for path in paths:
        target = os.path.join(directory, os.path.basename(path))
        if not os.path.exists(target):
            os.link(path, target)


class Collect:
    """A ``foreachBatch`` sink keeping the (small) output rows and when it returned."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, float]] = []
        self.returned_at: float | None = None

    def __call__(self, df: Any, batch_id: int) -> None:
        self.rows.extend((r[0], r[1], r[2]) for r in df.collect())
        self.returned_at = time.perf_counter()


# --------------------------------------------------------------------------------------------
# keyedstate
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A keyedstate snapshot to restore from, its parallelism and what it holds."""

    path: str
    parallelism: int
    expected: Expected


def _keyed_job(spark: Any, input_dir: str, sink: Collect, files_per_batch: int,
               on_batch: Callable[[Any], None]) -> Any:
    from keyedstate.spark.api import key_by

    events = (spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", files_per_batch)
              .parquet(input_dir))
    job = key_by(events, "user_id").process(KeyedTotals(), OUTPUT_DDL).sink(sink)
    make_driver = job.driver

    def driver(*args: Any, **kwargs: Any) -> Any:
        # the listener is in place before the driver restores anything: no race with batch 0
        d = make_driver(*args, **kwargs)
        d.listeners.append(on_batch)
        return d

    job.driver = driver  # type: ignore[method-assign]
    return job


def build_keyedstate(spark: Any, data: Data, root: str, parallelism: int,
                     phases: Sequence[int], files_per_batch: int, say: Say
                     ) -> tuple[dict[str, Any], dict[int, str]]:
    """Run the keyed job over the chunk files, ``files_per_batch`` per micro-batch, stopping
    and restarting it (from its own checkpoints) after the first ``phases[i]`` files, so that
    a checkpoint holds exactly the keys of those files. Every checkpoint is retained. Returns
    the build's figures and, per phase end (file count), the path of its checkpoint."""
    from keyedstate.config import JobConfig

    ckpt, spark_loc, input_dir = (os.path.join(root, d) for d in ("ckpt", "spark", "input"))
    per_batch: list[dict[str, Any]] = []
    at_phase: dict[int, str] = {}
    started = time.perf_counter()
    for files in phases:
        _link(data.chunks[:files], input_dir)
        stats: list[Any] = []
        job = _keyed_job(spark, input_dir, Collect(), files_per_batch, stats.append)
        query = job.start(JobConfig(checkpoint_dir=ckpt, parallelism=parallelism,
                                    backend="rocksdb", num_retained=10_000,
                                    local_dir=os.path.join(root, "local")),
                          spark_checkpoint_location=spark_loc, trigger={"availableNow": True})
        query.await_termination()
        query.stop()
        if query.query.exception() is not None:
            raise RuntimeError(f"keyedstate build failed: {query.query.exception()}")
        done = [s for s in stats if s.checkpoint_id >= 0]
        if not done:
            raise RuntimeError(f"keyedstate build: no batch ran for the first {files} files")
        for s in done:
            per_batch.append({"batch_id": s.batch_id, "rows_in": s.rows_in,
                              "seconds": s.duration_s, "full_bytes": s.full_bytes,
                              "incremental_bytes": s.incremental_bytes})
            say(f"keyedstate build: batch {s.batch_id} ({s.rows_in:,} keys) in "
                f"{s.duration_s:.1f} s")
        at_phase[files] = os.path.join(ckpt, f"chk-{done[-1].checkpoint_id}")
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "keys_per_s": data.starts[max(phases)] / seconds,
            "batches": per_batch, "files_per_batch": files_per_batch}, at_phase


def read_back(spark: Any, path: str) -> tuple[int, int, float]:
    """(keys, sum of counts, sum of totals) of the ``totals`` state at ``path``, read by
    keyedstate's state processor (one Spark task per key-group range)."""
    from pyspark.sql import functions as F

    from keyedstate.spark.processor import SavepointReader

    df = SavepointReader.read(spark, path).state(STATE_NAME)
    row = df.agg(F.count("*"), F.sum("value.count"), F.sum("value.total")).collect()[0]
    return int(row[0]), int(row[1] or 0), float(row[2] or 0.0)


def restore_keyedstate(spark: Any, source: Source, parallelism: int, root: str,
                       verify: bool) -> tuple[dict[str, Any], Source]:
    """Start a new job from ``source`` at ``parallelism`` with one probe file and time it until
    its first batch completed (module docstring); check the probe output, and with
    ``verify`` the whole state the job checkpointed. Returns the run's figures and the
    snapshot the job left (a source for further restores)."""
    from keyedstate.config import JobConfig, SourcePositions

    expected = replace(source.expected, probed=source.expected.probed + 1)
    probe = os.path.join(root, "input", "probe.parquet")
    write_probe(probe, expected.keys, expected.probes, expected.probed)
    ckpt = os.path.join(root, "ckpt")
    sink = Collect()
    stats: list[Any] = []
    done_at: list[float] = []

    def on_batch(s: Any) -> None:
        stats.append(s)
        if s.checkpoint_id >= 0 and not done_at:
            done_at.append(time.perf_counter())

    job = _keyed_job(spark, os.path.dirname(probe), sink, 1, on_batch)
    # The restored job reads a probe file, a new source: the snapshot's source positions (the
    # build's input) do not apply to it.
    config = JobConfig(checkpoint_dir=ckpt, parallelism=parallelism, backend="rocksdb",
                       restore_path=source.path, local_dir=os.path.join(root, "local"),
                       source_positions=SourcePositions.IGNORE)
    started = time.perf_counter()
    query = job.start(config, spark_checkpoint_location=os.path.join(root, "spark"),
                      trigger={"availableNow": True})
    query.await_termination()
    query.stop()
    if query.query.exception() is not None:
        raise RuntimeError(f"keyedstate restore failed: {query.query.exception()}")
    if not done_at:
        raise RuntimeError("keyedstate restore: no batch completed")
    seconds = done_at[0] - started
    first = next(s for s in stats if s.checkpoint_id >= 0)
    who = f"keyedstate {source.parallelism}->{parallelism}"
    expected.check_probe_output(sink.rows, who)
    if first.restored_subtasks != parallelism:
        raise AssertionError(f"{who}: {first.restored_subtasks} of {parallelism} subtasks "
                             f"restored in the first batch")
    left = Source(os.path.join(ckpt, f"chk-{first.checkpoint_id}"), parallelism, expected)
    result: dict[str, Any] = {
        "seconds": seconds,
        "keys": expected.keys,
        "batch": {"driver_s": first.duration_s, "max_subtask_restore_s": first.restore_s,
                  "max_sync_s": first.sync_duration_s, "max_async_s": first.async_duration_s,
                  "restored_subtasks": first.restored_subtasks, "full_bytes": first.full_bytes,
                  "spark_tasks": first.spark_tasks,
                  "incremental_bytes": first.incremental_bytes,
                  "uploaded_bytes": first.uploaded_bytes,
                  "duplicated_bytes": first.duplicated_bytes,
                  "probe_rows": len(sink.rows)},
        "verified": "probe output",
    }
    if verify:
        verify_started = time.perf_counter()
        got = read_back(spark, left.path)
        if got != expected.totals():
            raise AssertionError(f"{who}: restored state holds (keys, sum of counts, sum of "
                                 f"totals) {got}, expected {expected.totals()}")
        result["verified"] = "probe output + full state read back"
        result["verify_s"] = time.perf_counter() - verify_started
    return result, left


def restore_matrix(spark: Any, p4: Source, root: str, repeats: int, verify_every_run: bool,
                   say: Say, tag: str) -> dict[str, Any]:
    """Every configuration of :data:`CONFIGS`, ``repeats`` rounds, interleaved. The p=8
    source is the checkpoint of a first 4 -> 8 run (reported as ``prepare``, not in the
    medians: it also warms up the query path)."""
    say(f"{tag}: preparing the p=8 source (4->8)")
    prepare, p8 = restore_keyedstate(spark, p4, 8, os.path.join(root, "prepare"), verify=True)
    sources = {4: p4, 8: p8}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in CONFIGS}
    for r in range(repeats):
        for label, src, dst in CONFIGS:
            say(f"{tag}: restore {label}, round {r + 1}/{repeats}")
            run_root = os.path.join(root, f"{label.replace('->', '-to-')}-{r}")
            result, _ = restore_keyedstate(spark, sources[src], dst, run_root,
                                           verify=verify_every_run or r == 0)
            runs[label].append(result)
            shutil.rmtree(run_root, ignore_errors=True)
            say(f"{tag}: {label} in {result['seconds']:.2f} s")
    return {"prepare": prepare, "runs": runs,
            "median_s": {label: statistics.median(r["seconds"] for r in rs)
                         for label, rs in runs.items()},
            "min_s": {label: min(r["seconds"] for r in rs) for label, rs in runs.items()},
            "max_s": {label: max(r["seconds"] for r in rs) for label, rs in runs.items()}}


# --------------------------------------------------------------------------------------------
# Spark
# --------------------------------------------------------------------------------------------


def _spark_query(spark: Any, input_dir: str, checkpoint: str, sink: Collect) -> Any:
    events = spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(input_dir)
    out = events.groupBy("user_id").applyInPandasWithState(
        totals_with_group_state, OUTPUT_DDL, STATE_DDL, "Update", "NoTimeout")
    return (out.writeStream.outputMode("update").foreachBatch(sink)
            .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())


def _run_spark_query(spark: Any, input_dir: str, checkpoint: str) -> tuple[Any, Collect, float]:
    """Run the query until its input is consumed; returns it, its sink and the seconds from
    start until its last ``foreachBatch`` returned."""
    sink = Collect()
    started = time.perf_counter()
    query = _spark_query(spark, input_dir, checkpoint, sink)
    query.awaitTermination()
    query.stop()
    if query.exception() is not None:
        raise RuntimeError(f"the applyInPandasWithState query failed: {query.exception()}")
    if sink.returned_at is None:
        raise RuntimeError("the applyInPandasWithState query ran no batch")
    return query, sink, sink.returned_at - started


def build_spark(spark: Any, data: Data, root: str, budget_s: float, say: Say
                ) -> dict[str, Any]:
    """Build the ``applyInPandasWithState`` state one chunk file per run (one micro-batch),
    until every file is in or ``budget_s`` is spent (whole files; at least one)."""
    input_dir, checkpoint = os.path.join(root, "input"), os.path.join(root, "ckpt")
    started = time.perf_counter()
    files = 0
    batches = []
    while files < len(data.chunks):
        _link(data.chunks[files:files + 1], input_dir)
        query, _, seconds = _run_spark_query(spark, input_dir, checkpoint)
        files += 1
        ops = query.lastProgress["stateOperators"]
        batches.append({"keys": data.starts[files] - data.starts[files - 1], "seconds": seconds,
                        "state_rows_total": ops[0]["numRowsTotal"] if ops else None})
        elapsed = time.perf_counter() - started
        say(f"Spark build: {data.starts[files]:,} keys in {elapsed:.0f} s")
        if elapsed > budget_s:
            break
    seconds = time.perf_counter() - started
    keys = data.starts[files]
    if batches[-1]["state_rows_total"] != keys:
        raise AssertionError(f"Spark state holds {batches[-1]['state_rows_total']} rows, "
                             f"expected {keys}")
    return {"files": files, "keys": keys, "seconds": seconds, "keys_per_s": keys / seconds,
            "budget_s": budget_s, "complete": files == len(data.chunks), "batches": batches,
            "input_dir": input_dir, "checkpoint": checkpoint}


def read_spark_state(spark: Any, checkpoint: str) -> dict[str, Any]:
    """Spark's ``statestore`` data source over the query's latest batch: partitions, keys, sums."""
    from pyspark.sql import functions as F

    df = spark.read.format("statestore").load(checkpoint)
    row = df.agg(F.count("*"), F.sum("value.groupState.count"), F.sum("value.groupState.total"),
                 F.countDistinct("partition_id"), F.max("partition_id")).collect()[0]
    return {"keys": int(row[0]), "sum_count": int(row[1] or 0), "sum_total": float(row[2] or 0),
            "partitions_with_state": int(row[3]), "partitions": int(row[4]) + 1}


def spark_cycle(spark: Any, built: dict[str, Any], expected: Expected, root: str, seq: int,
                verify: bool) -> dict[str, Any]:
    """On copies of the built checkpoint: restart at the same parallelism (4 -> 4); and
    repartition 4 -> 8, restart, repartition 8 -> 3, restart. Each restart consumes one
    probe file (then removed, so that the next copy does not see it). Verifies the probe
    outputs and, with ``verify``, the state partitions and contents after each repartition."""
    manager = spark._streamingCheckpointManager
    out: dict[str, Any] = {}
    # restart at the same parallelism, for reference
    same = os.path.join(root, f"same-{seq}")
    shutil.copytree(built["checkpoint"], same)
    out["restart_4->4_s"] = _spark_restart(spark, built, same, replace(expected, probed=1),
                                           seq * 10 + 1, "4->4", 4)
    shutil.rmtree(same, ignore_errors=True)
    checkpoint = os.path.join(root, f"cycle-{seq}")
    shutil.copytree(built["checkpoint"], checkpoint)
    state = expected
    for label, n, step in (("4->8", 8, 2), ("8->3", 3, 3)):
        started = time.perf_counter()
        manager.repartition(checkpoint, n)
        out[f"repartition_{label}_s"] = time.perf_counter() - started
        if verify:
            verify_started = time.perf_counter()
            got = read_spark_state(spark, checkpoint)
            want = dict(zip(("keys", "sum_count", "sum_total"), state.totals()))
            if got["partitions"] != n or any(got[k] != v for k, v in want.items()):
                raise AssertionError(f"Spark repartition {label}: the statestore source reads "
                                     f"{got}, expected {n} partitions and {want}")
            out[f"state_after_{label}"] = got
            out[f"verify_{label}_s"] = time.perf_counter() - verify_started
        state = replace(state, probed=state.probed + 1)
        out[f"restart_{label}_s"] = _spark_restart(spark, built, checkpoint, state,
                                                   seq * 10 + step, label, n)
    shutil.rmtree(checkpoint, ignore_errors=True)
    out["verified"] = ("probe outputs + statestore source after each repartition" if verify
                       else "probe outputs")
    return out


def _spark_restart(spark: Any, built: dict[str, Any], checkpoint: str, expected: Expected,
                   seq: int, label: str, partitions: int) -> float:
    """Restart the query on ``checkpoint`` with one probe file; seconds until its batch's
    ``foreachBatch`` returned. The probe output must match ``expected`` (``probed`` already
    counting this batch)."""
    probe = os.path.join(built["input_dir"], f"probe-{seq:04d}.parquet")
    write_probe(probe, expected.keys, expected.probes, seq)
    try:
        query, sink, seconds = _run_spark_query(spark, built["input_dir"], checkpoint)
    finally:
        os.unlink(probe)
    expected.check_probe_output(sink.rows, f"Spark restart {label}")
    ops = query.lastProgress["stateOperators"]
    ran_with = ops[0].get("numShufflePartitions") if ops else None
    if ran_with != partitions:
        raise AssertionError(f"Spark restart {label} ran with {ran_with} state partitions, "
                             f"not {partitions}")
    return seconds


def run_spark(spark: Any, data: Data, root: str, budget_s: float, probes: int, repeats: int,
              parallelism: int, say: Say) -> dict[str, Any]:
    """Build Spark's state, then ``repeats`` repartition cycles (:func:`spark_cycle`). The
    session's state store provider and shuffle partitions are set for the run and restored
    after it."""
    settings = {"spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
                "spark.sql.shuffle.partitions": str(parallelism)}
    before = {k: spark.conf.get(k, None) for k in settings}
    for k, v in settings.items():
        spark.conf.set(k, v)
    try:
        return _run_spark(spark, data, root, budget_s, probes, repeats, parallelism, say)
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


def _run_spark(spark: Any, data: Data, root: str, budget_s: float, probes: int, repeats: int,
               parallelism: int, say: Say) -> dict[str, Any]:
    built = build_spark(spark, data, os.path.join(root, "build"), budget_s, say)
    expected = Expected(built["keys"], probes)
    state = read_spark_state(spark, built["checkpoint"])
    if state["partitions"] != parallelism or state["keys"] != built["keys"]:
        raise AssertionError(f"Spark's built state: {state}")
    size = _du(os.path.join(built["checkpoint"], "state"))
    cycles = []
    for r in range(repeats):
        say(f"Spark: repartition cycle {r + 1}/{repeats} ({built['keys']:,} keys)")
        cycles.append(spark_cycle(spark, built, expected, os.path.join(root, "cycles"), r + 1,
                                  verify=True))
    medians = {k: statistics.median(c[k] for c in cycles)
               for k in cycles[0] if k.endswith("_s")}
    return {"build": {k: v for k, v in built.items() if k not in ("input_dir", "checkpoint")},
            "state_dir_bytes": size, "cycles": cycles, "median_s": medians}


# --------------------------------------------------------------------------------------------
# savepoints
# --------------------------------------------------------------------------------------------


def _du(path: str) -> int:
    """Bytes of the regular files under ``path`` (each path counted, hard links included)."""
    total = 0
    for base, _, names in os.walk(path):
        for name in names:
            full = os.path.join(base, name)
            if os.path.isfile(full):
                total += os.path.getsize(full)
    return total


def savepoints(source: str, root: str, say: Say) -> dict[str, Any]:
    """Native (hard links; byte copies onto ``/dev/shm``) and canonical savepoints of the
    checkpoint ``source``, timed, with their sizes against the checkpoint's."""
    from keyedstate.checkpoint.resolve import resolve_snapshot
    from keyedstate.checkpoint.savepoint import unique_files, write_native_savepoint
    from keyedstate.processor.canonical import write_canonical_savepoint

    os.makedirs(root, exist_ok=True)
    snapshot = resolve_snapshot(source)
    state_bytes = sum(f.size for f in unique_files(snapshot.metadata))
    out: dict[str, Any] = {"state_bytes": state_bytes,
                           "state_full_size": snapshot.metadata.full_size,
                           "state_files": len(unique_files(snapshot.metadata))}
    targets = [("native_link", os.path.join(root, "native"), "native")]
    if os.path.isdir("/dev/shm") and os.stat("/dev/shm").st_dev != os.stat(root).st_dev:
        targets.append(("native_copy", tempfile.mkdtemp(prefix="keyedstate-bench-sp-",
                                                        dir="/dev/shm"), "native"))
    targets.append(("canonical", os.path.join(root, "canonical"), "canonical"))
    for name, target, fmt in targets:
        say(f"savepoint: {name}")
        started = time.perf_counter()
        if fmt == "native":
            write_native_savepoint(snapshot, target)
        else:
            write_canonical_savepoint(snapshot, target)
        seconds = time.perf_counter() - started
        size = _du(target)
        out[name] = {"seconds": seconds, "bytes": size, "bytes_vs_state": size / state_bytes,
                     "state_mb_per_s": state_bytes / 2**20 / seconds, "target": target}
        if name == "native_copy":
            shutil.rmtree(target, ignore_errors=True)
    out["native_link"]["how"] = "hard links (same filesystem): no byte copied"
    if "native_copy" in out:
        out["native_copy"]["how"] = "byte copies onto /dev/shm (another filesystem)"
    out["canonical"]["how"] = "every subtask restored, state re-encoded as Parquet"
    return out


# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------


def run(keys: int = 10_000_000, chunk_keys: int = 250_000, files_per_batch: int = 4,
        repeats: int = 5, spark_repeats: int = 3, spark_build_budget_s: float = 1800.0,
        probes: int = 1000, verify_every_run: bool = False, master: str = "local[2]",
        progress: Callable[[str], None] | None = None, spark: Any = None) -> dict[str, Any]:
    """Build both states, time keyedstate's restores (every configuration, ``repeats``
    rounds), Spark's repartition cycles (``spark_repeats``) and the savepoints; see the module
    docstring. Fails if any restored state differs from what was built."""
    from keyedstate.spark.session import local_session

    if keys < 1 or chunk_keys < 1 or repeats < 1 or spark_repeats < 1:
        raise ValueError("keys, chunk_keys, repeats and spark_repeats must be >= 1")
    chunk_keys = min(chunk_keys, keys)
    say = progress or (lambda msg: None)
    own_session = spark is None
    parallelism = 4
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    with workdir("rescale") as root:
        say(f"generating {keys:,} keys in files of {chunk_keys:,}")
        data = write_chunks(os.path.join(root, "data"), keys, chunk_keys)
        if own_session:
            say(f"starting Spark ({master})")
            spark = local_session(master, "keyedstate-bench-rescale",
                                  {"spark.sql.shuffle.partitions": str(parallelism)})
        try:
            # Spark first: its key count decides where keyedstate's build keeps a checkpoint.
            spark_result = run_spark(spark, data, os.path.join(root, "spark"),
                                     spark_build_budget_s, probes, spark_repeats, parallelism,
                                     say)
            spark_files = spark_result["build"]["files"]
            phases = sorted({spark_files, len(data.chunks)})
            build, at_phase = build_keyedstate(spark, data, os.path.join(root, "keyedstate"),
                                               parallelism, phases, files_per_batch, say)
            full = Source(at_phase[len(data.chunks)], parallelism, Expected(keys, probes))
            say("keyedstate: checking the built state")
            if read_back(spark, full.path) != full.expected.totals():
                raise AssertionError("keyedstate's built state differs from the input")
            matrix = restore_matrix(spark, full, os.path.join(root, "restores"), repeats,
                                    verify_every_run, say, f"{keys:,} keys")
            same_size = None
            if spark_files < len(data.chunks):
                small = Source(at_phase[spark_files], parallelism,
                               Expected(data.starts[spark_files], probes))
                same_size = restore_matrix(spark, small, os.path.join(root, "restores-small"),
                                           max(1, repeats - 1), verify_every_run, say,
                                           f"{small.expected.keys:,} keys")
            sp = savepoints(full.path, os.path.join(root, "savepoints"), say)
        finally:
            if own_session:
                spark.stop()
    result: dict[str, Any] = {
        "benchmark": "rescale",
        "machine": {**machine(), "master": master, "spark": _spark_version(),
                    "shuffle_partitions": parallelism, "load_average_at_start": load_at_start},
        "workload": {
            "keys": keys, "chunk_keys": chunk_keys, "files_per_batch": files_per_batch,
            "state": f"one ValueState / GroupState ({STATE_DDL}) per key",
            "keyedstate_backend": "rocksdb", "spark_state_store": "rocksdb",
            "parallelism": parallelism, "repeats": repeats, "spark_repeats": spark_repeats,
            "probes": probes,
            "timing": "keyedstate: from KeyedProcessJob.start of a new job restoring the "
                      "snapshot until its first batch's checkpoint completed and sink "
                      "committed (every subtask restored; nothing subtracted). Spark: "
                      "repartition() call alone; restart: from writeStream.start until the "
                      "first batch's foreachBatch returned. Medians over the rounds.",
        },
        "keyedstate": {"build": build, "restores": matrix, "same_size_as_spark": same_size},
        "spark": spark_result,
        "savepoints": sp,
        "total_s": time.perf_counter() - started,
    }
    result["goals"] = compute_goals(result)
    result["goals_met"] = all(g["met"] for g in result["goals"].values())
    return result


def compute_goals(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rescale / same-parallelism (median times, same snapshot) at most 1.5x; Spark's median
    repartition time / keyedstate's median rescale time at least 5x, keyedstate measured at
    Spark's key count (the full-size run when Spark's state is complete). The per-key ratio
    against the full-size keyedstate run is reported alongside."""
    goals: dict[str, dict[str, Any]] = {}
    medians = result["keyedstate"]["restores"]["median_s"]
    for rescale, same in BASELINE_OF.items():
        ratio = medians[rescale] / medians[same]
        goals[f"rescale {rescale} <= {GOAL_RESCALE_VS_SAME:g}x same-parallelism {same}"] = {
            "ratio": ratio, "target": GOAL_RESCALE_VS_SAME, "met": ratio <= GOAL_RESCALE_VS_SAME}
    spark = result["spark"]
    spark_keys = spark["build"]["keys"]
    small = result["keyedstate"]["same_size_as_spark"]
    ours = small["median_s"] if small else medians
    full_keys = result["workload"]["keys"]
    for label in ("4->8", "8->3"):
        theirs = spark["median_s"][f"repartition_{label}_s"]
        ratio = theirs / ours[label]
        per_key = (theirs / spark_keys) / (medians[label] / full_keys)
        goals[f"keyedstate {label} >= {GOAL_VS_SPARK:g}x faster than Spark's repartition"] = {
            "ratio": ratio, "keys_compared": spark_keys, "per_key_ratio_vs_full_size": per_key,
            "ratio_incl_spark_restart": (theirs + spark["median_s"][f"restart_{label}_s"])
            / ours[label],
            "target": GOAL_VS_SPARK, "met": ratio >= GOAL_VS_SPARK}
    return goals


def _spark_version() -> str:
    import pyspark

    return pyspark.__version__


# --------------------------------------------------------------------------------------------
# the figure
# --------------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: str) -> None:
    """Left: seconds until the job runs with all its state, per configuration (keyedstate at
    full size, keyedstate at Spark's size when smaller, Spark's repartition and repartition +
    restart). Right: savepoint seconds and sizes against the state's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = result["keyedstate"]
    spark = result["spark"]
    keys = result["workload"]["keys"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120,
                                 gridspec_kw={"width_ratios": [3, 2]})
    labels = [label for label, _, _ in CONFIGS]
    series: list[tuple[str, list[float | None], str]] = [
        (f"keyedstate, {keys:,} keys", [ks["restores"]["median_s"][c] for c in labels],
         "#1f77b4")]
    if ks["same_size_as_spark"]:
        series.append((f"keyedstate, {spark['build']['keys']:,} keys",
                       [ks["same_size_as_spark"]["median_s"][c] for c in labels], "#aec7e8"))
    m = spark["median_s"]
    series.append((f"Spark repartition, {spark['build']['keys']:,} keys",
                   [None, m["repartition_4->8_s"], None, m["repartition_8->3_s"]], "#d62728"))
    series.append((f"Spark (repartition +) restart, {spark['build']['keys']:,} keys",
                   [m["restart_4->4_s"], m["repartition_4->8_s"] + m["restart_4->8_s"], None,
                    m["repartition_8->3_s"] + m["restart_8->3_s"]], "#ff9896"))
    width = 0.8 / len(series)
    for n, (name, values, color) in enumerate(series):
        xs = [i + (n - (len(series) - 1) / 2) * width for i in range(len(labels))]
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        bars = ax.bar([x for x, _ in pts], [v for _, v in pts], width, label=name, color=color)
        for bar, (_, v) in zip(bars, pts):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{v:.1f}",
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), [f"{c}\n({'same p' if c in ('4->4', '8->8') else 'rescale'})"
                                       for c in labels])
    tallest = max(v for _, values, _ in series for v in values if v is not None)
    ax.set_ylim(0, tallest * 1.45)
    ax.set_ylabel("seconds until running with all state (median)")
    ax.set_title("Restore / rescale, local[2]", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    sp = result["savepoints"]
    names = [k for k in ("native_link", "native_copy", "canonical") if k in sp]
    secs = [sp[k]["seconds"] for k in names]
    bars = bx.bar(names, secs, color=["#2ca02c", "#98df8a", "#9467bd"][:len(names)])
    for bar, kind in zip(bars, names):
        bx.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                f"{sp[kind]['seconds']:.3g} s\n{sp[kind]['bytes'] / 2**20:.0f} MiB",
                ha="center", va="bottom", fontsize=7)
    bx.set_yscale("log")
    bx.set_ylim(min(secs) / 3, max(secs) * 10)
    bx.set_ylabel("seconds (log scale)")
    bx.set_title(f"Savepoints of {keys:,} keys (checkpoint {sp['state_bytes'] / 2**20:.0f} MiB)",
                 fontsize=10)
    save_figure(fig, path)


if __name__ == "__main__":
    # python -m keyedstate_benchmarks.rescale RESULT.json FIGURE.png: draw the figure of a saved run.
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
