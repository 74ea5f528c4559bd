"""Keyed process functions used by the Spark tests (importable by the Python workers)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from keyedstate.runtime.function import Context, KeyedBatch, KeyedProcessFunction
from keyedstate.runtime.local_aggregation import Count, LocalAggregation, Max, Sum
from keyedstate.spark.sinks import ParquetSink, StagedOutput
from keyedstate.state.descriptors import ValueStateDescriptor

COUNT_SCHEMA = "user_id string, count bigint, total double, batch_id bigint"


class RunningTotals(KeyedProcessFunction):
    """Count and total per user; one output row per user and batch."""

    totals = ValueStateDescriptor("totals", "count bigint, total double")

    def open(self, ctx: Context) -> None:
        self.state = ctx.get_state(self.totals)

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        now = self.state.value() or {"count": 0, "total": 0.0}
        amounts = rows.column("amount").to_pylist()
        new = {"count": now["count"] + len(amounts), "total": now["total"] + sum(amounts)}
        self.state.update(new)
        return [{"user_id": key, **new, "batch_id": ctx.batch_id}]


class PerElementTotals(RunningTotals):
    """The same through process_element (one call per row)."""

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        for row in rows.to_pylist():
            self.process_element(row, ctx)
        now = self.state.value()
        return [{"user_id": key, **now, "batch_id": ctx.batch_id}]

    def process_element(self, row: dict[str, Any], ctx: Context) -> None:
        now = self.state.value() or {"count": 0, "total": 0.0}
        self.state.update({"count": now["count"] + 1, "total": now["total"] + row["amount"]})


class VectorizedTotals(RunningTotals):
    """The same through process_batch: bulk state calls, Arrow in and out."""

    def process_batch(self, batch: KeyedBatch, ctx: Context) -> pa.Table:
        sums = (pa.table({"key": batch.key_index(), "amount": batch.rows.column("amount")})
                .group_by("key", use_threads=False).aggregate([("amount", "sum")])
                .sort_by("key").column("amount_sum").combine_chunks())
        old = self.state.get_many(batch.keys)
        counts = pc.add(pa.array([o["count"] if o else 0 for o in old], pa.int64()),
                        batch.counts)
        totals = pc.add(pa.array([o["total"] if o else 0.0 for o in old], pa.float64()), sums)
        new = pa.StructArray.from_arrays([counts, totals], names=["count", "total"])
        self.state.update_many(batch.keys, new)
        return pa.table({"user_id": batch.key_columns.column("user_id"), "count": counts,
                         "total": totals,
                         "batch_id": pa.repeat(ctx.batch_id, len(batch)).cast(pa.int64())})


class FailOnKey(RunningTotals):
    """Raises for one key: the query must stop naming the batch, subtask and key."""

    def __init__(self, bad_key: str) -> None:
        self.bad_key = bad_key

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        if key == self.bad_key:
            raise ValueError(f"cannot handle {key}")
        return super().process_key(key, rows, ctx)


class SlowBatch(RunningTotals):
    """Takes ``seconds`` longer in batch ``batch_id`` (in ``open``, each subtask), after writing
    ``started-<batch>-<subtask>`` to ``marker_dir``: a batch to stop or interrupt mid-flight."""

    def __init__(self, batch_id: int, seconds: float, marker_dir: str) -> None:
        self.batch_id = batch_id
        self.seconds = seconds
        self.marker_dir = marker_dir

    def open(self, ctx: Context) -> None:
        super().open(ctx)
        if ctx.batch_id == self.batch_id:
            open(os.path.join(self.marker_dir, f"started-{ctx.batch_id}-{ctx.subtask_index}"),
                 "w").close()
            time.sleep(self.seconds)


class KillWorkerOnce(RunningTotals):
    """Kills its own Python worker (SIGKILL) in the first attempt of one batch, mid-batch,
    after it has updated some state: the retried task must start from committed state."""

    def __init__(self, batch_id: int, marker_dir: str) -> None:
        self.batch_id = batch_id
        self.marker_dir = marker_dir

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        out = super().process_key(key, rows, ctx)
        marker = os.path.join(self.marker_dir, f"killed-{ctx.batch_id}-{ctx.subtask_index}")
        if ctx.batch_id == self.batch_id and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))  # which worker died (its local directory's name)
            os.kill(os.getpid(), 9)
        return out


class WrongOutput(RunningTotals):
    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        return [{"user_id": key, "count": "not a number", "total": 0.0, "batch_id": 0}]


class MisspelledOutput(RunningTotals):
    """Emits ``totl`` for ``total``: once silently dropped (and ``total`` written as null)."""

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        return [{"user_id": key, "count": 1, "totl": 0.0, "batch_id": ctx.batch_id}]


def _executor_jvm_pid() -> int:
    """The executor JVM above this Python worker (worker -> pyspark daemon -> JVM)."""
    pid = os.getpid()
    for _ in range(5):
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                return pid
    raise RuntimeError("no executor JVM above this worker (not on local-cluster?)")


class KillExecutorOnce(RunningTotals):
    """SIGKILLs its executor JVM in the first attempt of one batch, after updating state."""

    def __init__(self, batch_id: int, marker_dir: str) -> None:
        self.batch_id = batch_id
        self.marker_dir = marker_dir

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        out = super().process_key(key, rows, ctx)
        marker = os.path.join(self.marker_dir, "killed")
        if ctx.batch_id == self.batch_id and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(_executor_jvm_pid(), 9)
        return out


class FailingSink(ParquetSink):
    """Fails the commit of one batch, once: a driver that stops between checkpoint commit and
    sink commit."""

    def __init__(self, path: str, batch_id: int, marker: str) -> None:
        super().__init__(path)
        self.batch_id = batch_id
        self.marker = marker

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        if batch_id == self.batch_id and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise RuntimeError("driver stopped between checkpoint commit and sink commit")
        super().commit(spark, batch_id, staged)


class KillingSink(ParquetSink):
    """SIGKILLs the process that commits batch ``batch_id``, once (a ``marker`` file says it
    did), unless that is the process that made the sink: over Spark Connect, the server's
    copy of the driver dies, never the client."""

    def __init__(self, path: str, batch_id: int, marker: str) -> None:
        super().__init__(path)
        self.batch_id = batch_id
        self.marker = marker
        self.client_pid = os.getpid()

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        if batch_id == self.batch_id and os.getpid() != self.client_pid \
                and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        super().commit(spark, batch_id, staged)


IDLE_AFTER_MS = 10_000
IDLE_SCHEMA = "user_id string, at bigint, count bigint"


class IdleCounts(KeyedProcessFunction):
    """A running count per user, and an event-time timer ``IDLE_AFTER_MS`` after each user's
    latest event that emits the count to the side output ``idle`` (run locally and on Spark:
    :class:`~keyedstate.runtime.local.LocalJob` must give the same output and state)."""

    count = ValueStateDescriptor("count", "bigint")
    last = ValueStateDescriptor("last", "bigint")

    def open(self, ctx: Context) -> None:
        self.count_state = ctx.get_state(self.count)
        self.last_state = ctx.get_state(self.last)

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        ts_ms = [int(t.timestamp() * 1000) for t in rows.column("ts").to_pylist()]
        count = (self.count_state.value() or 0) + len(ts_ms)
        self.count_state.update(count)
        old = self.last_state.value()
        new = max(ts_ms) if old is None else max(old, *ts_ms)
        if new != old:
            if old is not None:
                ctx.timer_service.delete_event_time_timer(old + IDLE_AFTER_MS)
            ctx.timer_service.register_event_time_timer(new + IDLE_AFTER_MS)
            self.last_state.update(new)
        return [{"user_id": key, "count": count, "total": 0.0, "batch_id": ctx.batch_id}]

    def on_timer(self, timestamp: int, ctx: Context) -> None:
        ctx.output("idle", {"user_id": ctx.current_key, "at": timestamp,
                            "count": self.count_state.value()})
        self.last_state.clear()


class VectorizedIdleCounts(IdleCounts):
    """:class:`IdleCounts` through process_batch: counts and latest event times with bulk
    state calls; timers per key (``ctx.set_current_key``) only where the latest time moved;
    ``on_timer`` as in IdleCounts. Must give IdleCounts' output and state."""

    def process_batch(self, batch: KeyedBatch, ctx: Context) -> pa.Table:
        ts_ms = pc.divide(batch.rows.column("ts").cast(pa.int64()), 1000)
        latest = (pa.table({"key": batch.key_index(), "ts": ts_ms})
                  .group_by("key", use_threads=False).aggregate([("ts", "max")])
                  .sort_by("key").column("ts_max").to_pylist())
        counts = pc.add(pa.array(self.count_state.get_many(batch.keys), pa.int64())
                        .fill_null(0), batch.counts)
        self.count_state.update_many(batch.keys, counts)
        old = self.last_state.get_many(batch.keys)
        new = [t if o is None else max(o, t) for o, t in zip(old, latest)]
        for key, before, after in zip(batch.keys.keys, old, new):
            if after != before:
                ctx.set_current_key(key)
                if before is not None:
                    ctx.timer_service.delete_event_time_timer(before + IDLE_AFTER_MS)
                ctx.timer_service.register_event_time_timer(after + IDLE_AFTER_MS)
        self.last_state.update_many(batch.keys, new)
        return pa.table({"user_id": batch.key_columns.column("user_id"), "count": counts,
                         "total": pa.repeat(0.0, len(batch)),
                         "batch_id": pa.repeat(ctx.batch_id, len(batch)).cast(pa.int64())})


def write_batch_file(directory: str, n: int, table: pa.Table) -> None:
    """``table`` as ``<directory>/part-<n:03d>.parquet``, modified at second ``n`` of a fixed
    epoch: Spark's file source takes files oldest first, so with ``maxFilesPerTrigger`` 1
    file ``n`` is read by the ``n``-th micro-batch."""
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"part-{n:03d}.parquet")
    pq.write_table(table, path)
    os.utime(path, (1_700_000_000 + n, 1_700_000_000 + n))


def file_stream(spark: Any, input_dir: str, tables: list[pa.Table], schema: str) -> Any:
    """A streaming DataFrame reading ``tables`` as Parquet files in ``input_dir``, one file per
    micro-batch in list order (:func:`write_batch_file`)."""
    for n, table in enumerate(tables):
        write_batch_file(input_dir, n, table)
    return spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(input_dir)


# --------------------------------------------------------------------------------------------
# two-phase (local-global) aggregation
# --------------------------------------------------------------------------------------------

TWO_PHASE_INPUT = "user_id string, ts timestamp, cents bigint"
TWO_PHASE_SCHEMA = "user_id string, count bigint, cents bigint, last_ms bigint, batch_id bigint"


class TwoPhaseTotals(KeyedProcessFunction):
    """The global phase of a keyed count, sum and latest event time: the runtime hands it one
    row per key and batch (``local_aggregation``), which it merges into its state in bulk."""

    local_aggregation = LocalAggregation(events=Count(), cents=Sum("cents"), last=Max("ts"),
                                         valued=Count("cents"))
    totals = ValueStateDescriptor("totals", "count bigint, cents bigint, last_ms bigint")

    def open(self, ctx: Context) -> None:
        self.state = ctx.get_state(self.totals)

    @staticmethod
    def rows(table: pa.Table) -> list[dict[str, Any]]:
        """The aggregated rows, the latest event time in epoch ms."""
        assert table.column_names == ["user_id", "events", "cents", "last", "valued"]
        last = pc.divide(table.column("last").cast(pa.int64()), 1000)
        return table.set_column(3, "last", last).to_pylist()

    def merge(self, now: dict[str, Any] | None, row: dict[str, Any]) -> dict[str, Any]:
        assert row["valued"] <= row["events"]
        now = now or {"count": 0, "cents": 0, "last_ms": row["last"]}
        return {"count": now["count"] + row["events"],
                "cents": now["cents"] + (row["cents"] or 0),
                "last_ms": max(now["last_ms"], row["last"])}

    def process_batch(self, batch: KeyedBatch, ctx: Context) -> list[dict[str, Any]]:
        assert len(batch.rows) == len(batch.keys)  # one row per key
        rows = self.rows(batch.rows)
        merged = [self.merge(now, row) for now, row in zip(self.state.get_many(batch.keys), rows)]
        self.state.update_many(batch.keys, merged)
        return [{"user_id": r["user_id"], "count": m["count"], "cents": m["cents"],
                 "last_ms": m["last_ms"], "batch_id": ctx.batch_id}
                for r, m in zip(rows, merged)]


class TwoPhasePerKeyTotals(TwoPhaseTotals):
    """The same through ``process_key``: the key's one aggregated row."""

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        (row,) = self.rows(rows)
        merged = self.merge(self.state.value(), row)
        self.state.update(merged)
        return [{"user_id": key, "count": merged["count"], "cents": merged["cents"],
                 "last_ms": merged["last_ms"], "batch_id": ctx.batch_id}]

    process_batch = KeyedProcessFunction.process_batch  # type: ignore[assignment]


def two_phase_batches(n: int, events: int = 400, users: int = 30, seed: int = 11
                      ) -> list[pa.Table]:
    """``n`` batches 5 s of event time apart, rows up to 3 s out of order (some late with a
    1 s watermark delay); some amounts are null."""
    import random

    rng = random.Random(seed)
    t0 = 1_700_000_000_000
    out = []
    for b in range(n):
        ts = [t0 + b * 5000 + rng.randint(0, 4000) - rng.randint(0, 3000) for _ in range(events)]
        out.append(pa.table({
            "user_id": [f"u{rng.randrange(users):03d}" for _ in range(events)],
            "ts": pa.array([t * 1000 for t in ts], pa.timestamp("us", tz="UTC")),
            "cents": pa.array([None if rng.random() < 0.05 else rng.randint(1, 10_000)
                               for _ in range(events)], pa.int64()),
        }))
    return out


def two_phase_oracle(tables: list[pa.Table], delay_ms: int | None, first_batch_id: int = 0
                     ) -> tuple[list[list[tuple]], list[int]]:
    """With pandas: per batch, the sorted ``(user_id, count, cents, last_ms, batch_id)`` rows
    of the keys with on-time rows, and the late rows per batch (``delay_ms`` None: no
    watermark). The watermark after a batch: max(previous, largest event time - delay)."""
    import pandas as pd

    watermark = -(1 << 63)
    state: dict[str, tuple[int, int, int]] = {}
    out, late_counts = [], []
    for b, table in enumerate(tables):
        df = table.to_pandas()
        df["ms"] = table.column("ts").cast(pa.int64()).to_numpy() // 1000
        late = df["ms"] < watermark if delay_ms is not None else pd.Series(False, df.index)
        late_counts.append(int(late.sum()))
        agg = df[~late].groupby("user_id").agg(count=("cents", "size"), cents=("cents", "sum"),
                                               last_ms=("ms", "max"))
        for key, r in agg.iterrows():
            count, cents, last_ms = state.get(key, (0, 0, int(r["last_ms"])))
            state[key] = (count + int(r["count"]), cents + int(r["cents"]),
                          max(last_ms, int(r["last_ms"])))
        out.append(sorted((k, *state[k], first_batch_id + b) for k in agg.index))
        if delay_ms is not None:
            watermark = max(watermark, int(df["ms"].max()) - delay_ms)
    return out, late_counts
