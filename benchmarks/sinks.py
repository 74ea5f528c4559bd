"""What a table sink costs per batch: the keyed count of ``bench throughput`` into
``ParquetSink``, ``DeltaSink`` and ``IcebergSink``, side by side.

The same job (``throughput.KeyedCount`` on the RocksDB backend, one output row per key seen in
the batch with its count so far) runs once per sink over the same generated Parquet files (one
file = one micro-batch), each run its own query with its own checkpoints, in one SparkSession
on ``local[2]``. The sink is the job's only sink, on the local disk. Per batch:
``seconds_per_batch`` is Spark's ``triggerExecution`` (the same clock as ``bench
throughput``), ``sink_s`` the sink's ``commit`` alone (inside it). After the run each sink's
output is read back by the table format's reader and must hold every batch exactly once (the
rows, sum of counts and sum of squared counts of all batches equal the generated data's, and
one Delta version / Iceberg snapshot / Parquet batch directory per batch), or the run fails.

Goal (set with the table sinks, docs/sinks.md): a table sink adds at most 20% per batch over
``ParquetSink``: ``ratio_to_parquet`` (the median batch after the first, against ParquetSink's) at
most 1.2.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from keyedstate.runtime.batch import StagedOutput
from keyedstate.spark.sinks import Sink

from .common import machine, workdir
from .throughput import OUTPUT_DDL, KeyedCount, _input, _warm_up, spark_version, write_batches

PARQUET = "parquet"
DELTA = "delta"
ICEBERG = "iceberg"
SINKS = (PARQUET, DELTA, ICEBERG)
#: the goal: a table sink's median batch at most this many times ParquetSink's
TARGET_RATIO = 1.2
ICEBERG_TABLE = "bench.counts"


class TimedSink(Sink):
    """Another sink, with the seconds of each of its commits kept in :attr:`seconds`."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.seconds: list[float] = []

    def open(self, schema: pa.Schema) -> None:
        self.inner.open(schema)

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        started = time.perf_counter()
        self.inner.commit(spark, batch_id, staged)
        self.seconds.append(time.perf_counter() - started)


def make_sink(name: str, root: str) -> Sink:
    """The sink ``name`` writing under ``root`` (local disk)."""
    if name == PARQUET:
        from keyedstate.spark.sinks import ParquetSink

        return ParquetSink(os.path.join(root, "parquet"))
    if name == DELTA:
        from keyedstate.spark.delta_sink import DeltaSink

        return DeltaSink(os.path.join(root, "delta"))
    if name == ICEBERG:
        from keyedstate.spark.iceberg_sink import IcebergSink

        return IcebergSink(_iceberg_properties(root), ICEBERG_TABLE)
    raise ValueError(f"unknown sink {name!r}; known: {list(SINKS)}")


def _iceberg_properties(root: str) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{root}/iceberg-catalog.db",
            "warehouse": f"file://{root}/iceberg"}


def read_back(name: str, root: str) -> tuple[pa.Table, int]:
    """The sink's output (read by the format's own reader) and how many commits hold it
    (batch directories, Delta versions, Iceberg snapshots)."""
    if name == PARQUET:
        import pyarrow.dataset as ds

        directory = os.path.join(root, "parquet")
        batches = [d for d in os.listdir(directory) if not d.startswith("_")]
        return ds.dataset(directory, format="parquet").to_table(), len(batches)
    if name == DELTA:
        import deltalake

        delta = deltalake.DeltaTable(os.path.join(root, "delta"))
        return delta.to_pyarrow_table(), delta.version() + 1
    if name == ICEBERG:
        from pyiceberg.catalog import load_catalog

        from keyedstate.spark.iceberg_sink import DEFAULT_CATALOG_NAME

        iceberg = load_catalog(DEFAULT_CATALOG_NAME, **_iceberg_properties(root)
                               ).load_table(ICEBERG_TABLE)
        return iceberg.scan().to_arrow(), len(iceberg.snapshots())
    raise ValueError(f"unknown sink {name!r}; known: {list(SINKS)}")


def _aggregates(table: pa.Table) -> tuple[int, int, int]:
    counts = table.column("count")
    return (table.num_rows, int(pc.sum(counts).as_py() or 0),
            int(pc.sum(pc.multiply(counts, counts)).as_py() or 0))


def run_sink(spark: Any, name: str, paths: Sequence[str],
             expected: Sequence[tuple[int, int, int]], root: str, events_per_batch: int,
             parallelism: int) -> dict[str, Any]:
    """Run the keyed count into sink ``name`` over ``paths`` (one batch each), verify what the
    sink holds, and time it."""
    from keyedstate.config import JobConfig
    from keyedstate.spark.api import key_by

    os.makedirs(root)
    sink = TimedSink(make_sink(name, root))
    events = _input(spark, root, paths)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    query = (key_by(events, "user_id").process(KeyedCount(), OUTPUT_DDL).sink(sink)
             .start(JobConfig(checkpoint_dir=os.path.join(root, "ckpt"),
                              parallelism=parallelism, backend="rocksdb"),
                    spark_checkpoint_location=os.path.join(root, "spark"),
                    trigger={"availableNow": True}))
    query.await_termination()
    query.stop()
    wall_s = time.perf_counter() - started
    # Step 1. Every batch exactly once in the sink.
    table, commits = read_back(name, root)
    want = tuple(sum(e[i] for e in expected) for i in range(3))
    if _aggregates(table) != want or commits != len(paths):
        raise AssertionError(
            f"{name}: (rows, sum of counts, sum of squared counts) {_aggregates(table)} in "
            f"{commits} commits; expected {want} in {len(paths)}")
    # Step 2. The batches' times.
    progress = [p for p in query.query.recentProgress if p.numInputRows > 0]
    if [p.numInputRows for p in progress] != [events_per_batch] * len(paths):
        raise AssertionError(f"{name}: expected {len(paths)} batches of {events_per_batch} "
                             f"rows, got {[p.numInputRows for p in progress]}")
    seconds = [p.durationMs["triggerExecution"] / 1000 for p in progress]
    return {
        "sink": name,
        "seconds_per_batch": seconds,
        "sink_s": sink.seconds,
        # the median batch after the first (which creates the state and the table)
        "median_s": statistics.median(seconds[1:]),
        "median_sink_s": statistics.median(sink.seconds[1:]),
        "batches": len(seconds),
        "commits": commits,
        "wall_s": wall_s,
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "verified": True,
    }


def run(keys: int = 100_000, events_per_batch: int | None = None, batches: int = 6,
        parallelism: int = 2, master: str = "local[2]", sinks: Sequence[str] = SINKS,
        progress: Callable[[str], None] | None = None, spark: Any = None) -> dict[str, Any]:
    """Run the keyed count into each of ``sinks`` (``ParquetSink`` first: the reference) over
    the same ``batches`` generated batches of ``events_per_batch`` events (default 10 per
    key) over ``keys`` keys. Fails if a sink's output differs from the generated data's."""
    from keyedstate.spark.session import local_session

    unknown = sorted(set(sinks) - set(SINKS))
    if unknown:
        raise ValueError(f"unknown sinks {unknown}; known: {list(SINKS)}")
    if batches < 2:
        raise ValueError("run at least 2 batches (the first one creates state and table)")
    events = events_per_batch if events_per_batch is not None else 10 * keys
    ordered = sorted(set(sinks), key=SINKS.index)
    say = progress or (lambda msg: None)
    own_session = spark is None
    results = []
    started = time.perf_counter()
    with workdir("sinks") as root:
        say(f"generating {batches} batches of {events:,} events over {keys:,} keys")
        paths, expected = write_batches(os.path.join(root, "data"), batches, events, keys)
        if own_session:
            say(f"starting Spark ({master})")
            spark = local_session(master, "keyedstate-bench-sinks",
                                  {"spark.sql.shuffle.partitions": str(parallelism)})
        try:
            say("warming up the JVM and the Python workers")
            _warm_up(spark, paths, os.path.join(root, "warm-up"), parallelism, "rocksdb")
            for name in ordered:
                say(f"{name}: {batches} batches")
                results.append(run_sink(spark, name, paths, expected,
                                        os.path.join(root, name), events, parallelism))
        finally:
            if own_session:
                spark.stop()
    goals = compute_goals(results)
    return {
        "benchmark": "sinks",
        "machine": {**machine(), "master": master, "spark": spark_version(),
                    "shuffle_partitions": parallelism},
        "workload": {"keys": keys, "events_per_batch": events, "batches": batches,
                     "parallelism": parallelism, "backend": "rocksdb", "storage": "local disk",
                     "timing": "seconds_per_batch: Spark's triggerExecution of each micro-batch; "
                               "sink_s: the sink's commit; medians of the batches after the "
                               "first"},
        "total_s": time.perf_counter() - started,
        "results": results,
        "goals": goals,
        "goals_met": all(g["met"] for g in goals.values()),
    }


def compute_goals(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each table sink's median batch against ParquetSink's (``ratio``, at most
    :data:`TARGET_RATIO`), and what the sinks' own commits take (``added_sink_s``: the
    difference of the median commits). Each result also gets its ``ratio_to_parquet``."""
    by_sink = {r["sink"]: r for r in results}
    goals: dict[str, dict[str, Any]] = {}
    if PARQUET not in by_sink:
        return goals
    reference = by_sink[PARQUET]
    for result in results:
        result["ratio_to_parquet"] = result["median_s"] / reference["median_s"]
        if result["sink"] == PARQUET:
            continue
        ratio = result["ratio_to_parquet"]
        goals[f"{result['sink']} <= {TARGET_RATIO:g}x {PARQUET}"] = {
            "ratio": ratio, "target": TARGET_RATIO, "met": ratio <= TARGET_RATIO,
            "added_sink_s": result["median_sink_s"] - reference["median_sink_s"]}
    return goals
