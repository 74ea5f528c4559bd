"""``keyedstate demo``: the main job, end to end on local Spark with RocksDB state.

1. Generate a click stream (``user_id``, ``ts``, ``amount``) as Parquet files under
   ``DIR/input/`` (disorder below the watermark delay, so no event is late).
2. Run the keyed job over the first half of the files (one file per micro-batch) at
   parallelism 2: running totals per user to ``DIR/output/counts/`` and event-time session
   windows (30-minute gap, emitted by timers) to ``DIR/output/sessions/``.
3. Stop it with a native savepoint under ``DIR/savepoints/``; restart from that savepoint at
   parallelism 3 (rescaling) over the rest of the files; stop with drain (every open session
   fires).
4. Check the outputs against pandas over the input, and print a summary.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from keyedstate.config import JobConfig
from keyedstate.demo import GAP_MS, WATERMARK_DELAY_MS, generate_events
from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.spark.api import key_by
from keyedstate.spark.driver import BatchStats
from keyedstate.spark.sinks import ParquetSink
from keyedstate.state.descriptors import MapStateDescriptor, ValueStateDescriptor

INPUT_SCHEMA = pa.schema([("user_id", pa.string()), ("ts", pa.timestamp("us", tz="UTC")),
                          ("amount", pa.float64())])
COUNTS_SCHEMA = "user_id string, count bigint, total double, batch_id bigint"
SESSIONS_SCHEMA = ("user_id string, session_start timestamp, session_end timestamp, "
                   "events bigint, amount double")
UTC = dt.timezone.utc


class ClickAnalytics(KeyedProcessFunction):
    """Running totals per user, and event-time session windows merged per key batch."""

    totals = ValueStateDescriptor("totals", "count bigint, total double")
    sessions = MapStateDescriptor("sessions", "bigint", "last bigint, events bigint, amount double")

    def open(self, ctx: Context) -> None:
        self.totals_state = ctx.get_state(self.totals)
        self.sessions_state = ctx.get_state(self.sessions)

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        ts_ms = [int(t.timestamp() * 1000) for t in rows.column("ts").to_pylist()]
        amounts = rows.column("amount").to_pylist()
        now = self.totals_state.value() or {"count": 0, "total": 0.0}
        count, total = now["count"] + len(ts_ms), now["total"] + sum(amounts)
        self.totals_state.update({"count": count, "total": total})
        # Session windows: merge each event's [ts, ts + gap) with the open sessions it touches
        # (Flink's MergingWindowSet), in memory for the whole key batch, then write back.
        before = dict(self.sessions_state.items())
        open_sessions = dict(before)
        for ts, amount in zip(ts_ms, amounts):
            start, last, events, amt = ts, ts, 1, amount
            for s_start in [s for s, v in open_sessions.items()
                            if s <= ts + GAP_MS and ts <= v["last"] + GAP_MS]:
                s = open_sessions.pop(s_start)
                start, last = min(start, s_start), max(last, s["last"])
                events, amt = events + s["events"], amt + s["amount"]
            open_sessions[start] = {"last": last, "events": events, "amount": amt}
        # One event-time timer per open session, at its end; deletes before registers, since
        # a merged session may keep the end of one it replaced.
        timers = ctx.timer_service
        for s_start, old in before.items():
            new = open_sessions.get(s_start)
            if new is None:
                self.sessions_state.remove(s_start)
            if new is None or new["last"] != old["last"]:
                timers.delete_event_time_timer(old["last"] + GAP_MS)
        for s_start, s in open_sessions.items():
            old = before.get(s_start)
            if old != s:
                self.sessions_state.put(s_start, s)
            if old is None or old["last"] != s["last"]:
                timers.register_event_time_timer(s["last"] + GAP_MS)
        return [{"user_id": key, "count": count, "total": total, "batch_id": ctx.batch_id}]

    def on_timer(self, timestamp: int, ctx: Context) -> None:
        for s_start, s in list(self.sessions_state.items()):
            if s["last"] + GAP_MS == timestamp:
                self.sessions_state.remove(s_start)
                ctx.output("sessions", {
                    "user_id": ctx.current_key,
                    "session_start": dt.datetime.fromtimestamp(s_start / 1000, UTC),
                    "session_end": dt.datetime.fromtimestamp(timestamp / 1000, UTC),
                    "events": s["events"], "amount": s["amount"]})


def write_input(directory: str, events: int, users: int, files: int) -> list[str]:
    """The generated click stream as ``files`` Parquet files, in event-time order."""
    staging = os.path.join(directory, "generated")
    os.makedirs(staging, exist_ok=True)
    all_events = list(generate_events(events, users))
    per_file = -(-len(all_events) // files)
    paths = []
    for n in range(files):
        chunk = all_events[n * per_file:(n + 1) * per_file]
        table = pa.table({
            "user_id": [e[0] for e in chunk],
            "ts": pa.array([e[1] * 1000 for e in chunk], pa.timestamp("us", tz="UTC")),
            "amount": [e[2] for e in chunk],
        }, schema=INPUT_SCHEMA)
        path = os.path.join(staging, f"events-{n:04d}.parquet")
        pq.write_table(table, path)
        paths.append(path)
    return paths


@dataclass
class SparkDemoReport:
    events: int
    batches: int = 0
    seconds: float = 0.0
    parallelism: list[int] = field(default_factory=list)
    savepoint: str = ""
    stats: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)


def _phase(spark: Any, directory: str, config: JobConfig, on_batch: Callable[[BatchStats], None],
           *, savepoint: str | None = None, drain: bool = False) -> str | None:
    events = (spark.readStream.schema(
        "user_id string, ts timestamp, amount double")
        .option("maxFilesPerTrigger", 1).parquet(os.path.join(directory, "input")))
    job = (key_by(events, "user_id")
           .process(ClickAnalytics(), output_schema=COUNTS_SCHEMA,
                    side_outputs={"sessions": SESSIONS_SCHEMA})
           .sink(ParquetSink(os.path.join(directory, "output", "counts")))
           .sink(ParquetSink(os.path.join(directory, "output", "sessions")), output="sessions"))
    query = job.start(config, trigger={"availableNow": True},
                      spark_checkpoint_location=os.path.join(directory, "checkpoints", "spark"))
    query.add_listener(on_batch)
    query.await_termination()
    return query.stop(savepoint=savepoint, drain=drain)


def run_spark_demo(spark: Any, directory: str, events: int, users: int, files: int,
                   on_batch: Callable[[BatchStats], None]) -> SparkDemoReport:
    shutil.rmtree(directory, ignore_errors=True)
    report = SparkDemoReport(events=events, parallelism=[2, 3])
    generated = write_input(directory, events, users, files)
    input_dir = os.path.join(directory, "input")
    os.makedirs(input_dir)
    stats: list[BatchStats] = []

    def record(s: BatchStats) -> None:
        stats.append(s)
        on_batch(s)

    def publish(paths: list[str]) -> None:
        # The file source takes files in modification-time order: make it the event-time
        # order, or later files would make earlier ones late.
        for path in paths:
            target = os.path.join(input_dir, os.path.basename(path))
            shutil.copy(path, target)
            n = int(os.path.basename(path).split("-")[1].split(".")[0])
            os.utime(target, (1_700_000_000 + n, 1_700_000_000 + n))

    started = time.perf_counter()
    publish(generated[: files // 2])
    delay = dt.timedelta(milliseconds=WATERMARK_DELAY_MS)
    savepoint_dir = os.path.join(directory, "savepoints", "savepoint-1")
    report.savepoint = _phase(spark, directory, JobConfig(
        checkpoint_dir=os.path.join(directory, "checkpoints", "job-1"), parallelism=2,
        backend="rocksdb", watermark_column="ts", watermark_delay=delay),
        record, savepoint=savepoint_dir) or ""
    publish(generated[files // 2:])
    _phase(spark, directory, JobConfig(
        checkpoint_dir=os.path.join(directory, "checkpoints", "job-2"), parallelism=3,
        restore_path=savepoint_dir, backend="rocksdb", watermark_column="ts",
        watermark_delay=delay), record, drain=True)
    report.seconds = time.perf_counter() - started
    report.batches = sum(1 for s in stats if s.checkpoint_id >= 0)
    report.stats = [s.__dict__ for s in stats]
    report.checks = verify(directory)
    return report


def verify(directory: str) -> dict[str, bool]:
    """The outputs against pandas over the input (an oracle independent of keyedstate)."""
    import pandas as pd

    events = pd.read_parquet(os.path.join(directory, "input"))
    counts = pd.read_parquet(os.path.join(directory, "output", "counts"))
    sessions = pd.read_parquet(os.path.join(directory, "output", "sessions"))
    expected = events.groupby("user_id").agg(count=("amount", "size"), total=("amount", "sum"))
    final = counts.sort_values("batch_id").groupby("user_id").last()
    totals_ok = (final.index.sort_values().equals(expected.index.sort_values())
                 and (final["count"].reindex(expected.index) == expected["count"]).all()
                 and ((final["total"].reindex(expected.index) - expected["total"]).abs() < 1e-6).all())
    once_ok = not counts.duplicated(["user_id", "batch_id"]).any()
    gap = pd.Timedelta(milliseconds=GAP_MS)
    rows = []
    for user, group in events.sort_values("ts").groupby("user_id"):
        new = group["ts"].diff() > gap
        for _, sess in group.groupby(new.cumsum()):
            rows.append((user, sess["ts"].min(), sess["ts"].max() + gap, len(sess)))
    want = sorted((u, s.value, e.value, n) for u, s, e, n in
                  ((u, pd.Timestamp(s), pd.Timestamp(e), n) for u, s, e, n in rows))
    got = sorted((r.user_id, pd.Timestamp(r.session_start).value, pd.Timestamp(r.session_end).value,
                  int(r.events)) for r in sessions.itertuples())
    return {"totals match pandas": bool(totals_ok), "one count row per user and batch": bool(once_ok),
            "sessions match pandas": want == got}
