"""The click-sessions job: one KeyedProcessFunction, run locally (no Java) or on Spark.

Per user it keeps running totals (a typed ValueState, read and written for all users of a
batch at once: ``process_batch``, the vectorized path) and event-time session windows with a
30-minute gap (a MapState of open sessions plus event-time timers, merged as Flink merges
session windows); every batch it emits the user's totals, and each session when its timer
fires (side output ``sessions``). The run, on either runtime:

1. Generate a click stream (``user_id``, ``ts``, ``amount``) as Parquet files (disorder below
   the watermark delay, so no event is late).
2. Run the job over the first half of the files (one file per micro-batch, one checkpoint
   each) at parallelism 2, RocksDB state; stop it with a native savepoint.
3. Start a new job from that savepoint at parallelism 3 (rescaling) over the rest of the
   files; stop with drain (the watermark goes to +infinity, every open session fires).
4. Check the outputs against an oracle computed from the events in plain Python.

``python examples/click_sessions.py --runtime local`` (or ``spark``); ``keyedstate demo``
runs it on Spark, ``keyedstate demo --local`` locally. Installed, this folder is the
``keyedstate_examples`` package.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

if TYPE_CHECKING:
    import pandas as pd

from keyedstate.config import JobConfig
from keyedstate.runtime.function import Context, KeyedBatch, KeyedProcessFunction
from keyedstate.runtime.local import LocalJob
from keyedstate.state.descriptors import MapStateDescriptor, ValueStateDescriptor

if __package__:
    from .harness import (
        Check,
        add_directory_option,
        prepare_directory,
        publish,
        write_parquet_files,
    )
else:  # run as a script: python examples/click_sessions.py
    from harness import (  # type: ignore[no-redef]
        Check,
        add_directory_option,
        prepare_directory,
        publish,
        write_parquet_files,
    )

GAP_MS = 30 * 60 * 1000
WATERMARK_DELAY_MS = 5 * 60 * 1000

INPUT_SCHEMA = pa.schema([("user_id", pa.string()), ("ts", pa.timestamp("us", tz="UTC")),
                          ("amount", pa.float64())])
INPUT_DDL = "user_id string, ts timestamp, amount double"
COUNTS_SCHEMA = "user_id string, count bigint, total double, batch_id bigint"
SESSIONS_SCHEMA = ("user_id string, session_start timestamp, session_end timestamp, "
                   "events bigint, amount double")
UTC = dt.timezone.utc

Event = tuple[str, int, float]  # user_id, event time (ms), amount


def generate_events(n: int, users: int, seed: int = 42) -> Iterator[Event]:
    """Clicks in event-time order up to ``WATERMARK_DELAY_MS`` of disorder (so none is late)."""
    rng = random.Random(seed)
    t = 1_700_000_000_000
    for _ in range(n):
        t += rng.randint(0, 400)
        jitter = rng.randint(0, WATERMARK_DELAY_MS // 2)
        yield f"user-{rng.randrange(users):06d}", t - jitter, round(rng.uniform(0.5, 100.0), 2)


class ClickAnalytics(KeyedProcessFunction):
    """Running totals per user, computed for all users of a batch at once (the vectorized
    path), and event-time session windows merged per user (the per-key state calls)."""

    totals = ValueStateDescriptor("totals", "count bigint, total double")
    sessions = MapStateDescriptor("sessions", "bigint", "last bigint, events bigint, amount double")

    def open(self, ctx: Context) -> None:
        self.totals_state = ctx.get_state(self.totals)
        self.sessions_state = ctx.get_state(self.sessions)

    def process_batch(self, batch: KeyedBatch, ctx: Context) -> pa.Table:
        # Running totals: one bulk read and one bulk write of the ValueState for every user of
        # the batch; the batch's count and sum per user come from Arrow (rows are grouped by
        # user, key i's rows at offsets[i]:offsets[i + 1]).
        per_user = (pa.table({"i": batch.key_index(), "amount": batch.rows.column("amount")})
                    .group_by("i", use_threads=False).aggregate([("amount", "sum")])
                    .sort_by("i"))
        previous = self.totals_state.get_many(batch.keys)
        counts = pc.add(pa.array([0 if p is None else p["count"] for p in previous], pa.int64()),
                        batch.counts)
        totals = pc.add(pa.array([0.0 if p is None else p["total"] for p in previous],
                                 pa.float64()), per_user.column("amount_sum").combine_chunks())
        self.totals_state.update_many(
            batch.keys, pa.StructArray.from_arrays([counts, totals], ["count", "total"]))
        # Sessions need each user's events in order: the per-key calls, user by user.
        ts_ms, amounts = _ms(batch.rows.column("ts")), batch.rows.column("amount").to_pylist()
        offsets = batch.offsets.to_pylist()
        for i, key in enumerate(batch.keys.keys):
            ctx.set_current_key(key)
            start, end = offsets[i], offsets[i + 1]
            self._merge_sessions(ts_ms[start:end], amounts[start:end], ctx)
        return pa.table({"user_id": batch.key_columns.column("user_id"), "count": counts,
                         "total": totals,
                         "batch_id": pa.repeat(pa.scalar(ctx.batch_id, pa.int64()), len(batch))})

    def _merge_sessions(self, ts_ms: list[int], amounts: list[float], ctx: Context) -> None:
        """Merge the current user's events (in arrival order) into their open sessions."""
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

    def on_timer(self, timestamp: int, ctx: Context) -> None:
        for s_start, s in list(self.sessions_state.items()):
            if s["last"] + GAP_MS == timestamp:
                self.sessions_state.remove(s_start)
                ctx.output("sessions", {
                    "user_id": ctx.current_key,
                    "session_start": dt.datetime.fromtimestamp(s_start / 1000, UTC),
                    "session_end": dt.datetime.fromtimestamp(timestamp / 1000, UTC),
                    "events": s["events"], "amount": s["amount"]})


def write_input(directory: str, events: list[Event], files: int) -> list[str]:
    """``events`` as ``files`` Parquet files under ``directory/generated``, in order."""
    table = pa.table({
        "user_id": [e[0] for e in events],
        "ts": pa.array([e[1] * 1000 for e in events], pa.timestamp("us", tz="UTC")),
        "amount": [e[2] for e in events],
    }, schema=INPUT_SCHEMA)
    return write_parquet_files(os.path.join(directory, "generated"), table, files)


# -- the oracle ------------------------------------------------------------------------------


def oracle(events: list[Event]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Computed directly from all events, independently of keyedstate (vectorized pandas):
    the totals per user (index ``user_id``; ``count``, ``total``) and the sessions
    (``user_id``, ``start``, ``end`` in ms, ``events``, ``amount``)."""
    import pandas as pd

    df = pd.DataFrame(events, columns=["user_id", "ts", "amount"])
    totals = df.groupby("user_id").agg(count=("ts", "size"), total=("amount", "sum"))
    df = df.sort_values(["user_id", "ts"], kind="stable", ignore_index=True)
    # Sorted by time within a user, a session starts where the gap to the previous event
    # exceeds GAP_MS (or at the user's first event); numbering those starts names them.
    previous = df.groupby("user_id")["ts"].shift()
    session_id = (previous.isna() | (df["ts"] > previous + GAP_MS)).cumsum()
    sessions = df.groupby(session_id).agg(
        user_id=("user_id", "first"), start=("ts", "min"), last=("ts", "max"),
        events=("ts", "size"), amount=("amount", "sum"))
    sessions["end"] = sessions.pop("last") + GAP_MS
    return totals, sessions.reset_index(drop=True)


def _ms(column: pa.ChunkedArray) -> list[int]:
    micros = column.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
    return pc.divide(micros, 1000).to_pylist()


def verify(events: list[Event], counts: pa.Table, sessions: pa.Table) -> dict[str, Check]:
    """The job's outputs (every batch's ``counts``, every emitted session) against the
    oracle; one verdict per check, by identifier."""
    import pandas as pd

    expected_totals, expected_sessions = oracle(events)
    rows = counts.to_pandas()
    once_ok = not rows.duplicated(["user_id", "batch_id"]).any()
    final = (rows.sort_values("batch_id", kind="stable").groupby("user_id").last()
             .reindex(expected_totals.index))
    totals_ok = (len(rows.groupby("user_id")) == len(expected_totals)
                 and bool((final["count"] == expected_totals["count"]).all())
                 and bool(((final["total"] - expected_totals["total"]).abs() < 1e-6).all()))
    key = ["user_id", "start", "end", "events"]
    got = pd.DataFrame({
        "user_id": sessions.column("user_id").to_pylist(),
        "start": _ms(sessions.column("session_start")),
        "end": _ms(sessions.column("session_end")),
        "events": sessions.column("events").to_pylist(),
    }).sort_values(key, ignore_index=True)
    want = expected_sessions[key].sort_values(key, ignore_index=True)
    sessions_ok = len(got) == len(want) and bool(
        (got.astype({"events": "int64"}) == want.astype({"events": "int64"})).all().all())
    return {"totals_match_oracle": Check(totals_ok, "totals match the oracle"),
            "one_count_row_per_user_and_batch": Check(once_ok,
                                                      "one count row per user and batch"),
            "sessions_match_oracle": Check(sessions_ok, "sessions match the oracle")}


# -- the two runtimes ------------------------------------------------------------------------

#: The phases of a run, in order (``keyedstate demo`` shows one progress bar per phase).
PHASES = ("generate", "run p=2", "savepoint", "restart p=3", "drain", "verify")


class RunProgress(Protocol):
    """Where a run is: told when each of :data:`PHASES` begins and after each checkpointed
    batch. Called on the thread that runs the job (on Spark: from the query listener)."""

    def phase(self, name: str, batches: int) -> None:
        """Phase ``name`` begins; it will run ``batches`` micro-batches (0: none)."""

    def batch(self, stats: dict[str, Any]) -> None:
        """A batch of the current phase completed its checkpoint: ``stats`` has at least
        ``batch_id``, ``rows_in``, ``incremental_bytes`` and ``full_bytes``."""


class Quiet:
    """A :class:`RunProgress` that shows nothing."""

    def phase(self, name: str, batches: int) -> None:
        pass

    def batch(self, stats: dict[str, Any]) -> None:
        pass


QUIET = Quiet()



@dataclass
class DemoReport:
    """What a run did: per batch, the checkpoint and its sizes (and on Spark its timings)."""

    runtime: str
    events: int
    batches: int = 0
    seconds: float = 0.0
    parallelism: list[int] = field(default_factory=lambda: [2, 3])
    savepoint: str = ""
    sessions: int = 0
    stats: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, Check] = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks.values())


def _config(directory: str, job: int, parallelism: int, restore: str | None = None
            ) -> JobConfig:
    return JobConfig(checkpoint_dir=os.path.join(directory, "checkpoints", f"job-{job}"),
                     parallelism=parallelism, backend="rocksdb", restore_path=restore,
                     watermark_column="ts",
                     watermark_delay=dt.timedelta(milliseconds=WATERMARK_DELAY_MS),
                     local_dir=os.path.join(directory, "local"))


def run_local(directory: str, events: int, users: int, files: int,
              progress: RunProgress = QUIET) -> DemoReport:
    """The job with :class:`~keyedstate.runtime.local.LocalJob` (steps in the module
    docstring), in ``directory`` (new, empty or an earlier run's:
    :func:`~harness.prepare_directory`)."""
    prepare_directory(directory)
    progress.phase("generate", 0)
    all_events = list(generate_events(events, users))
    paths = write_input(directory, all_events, files)
    report = DemoReport(runtime="local", events=events)
    outputs: dict[str, list[pa.Table]] = {"main": [], "sessions": []}

    def record(job: LocalJob, out: dict[str, pa.Table], rows_in: int) -> None:
        for tag in outputs:
            outputs[tag].append(out[tag])
        latest = job.latest_checkpoint
        assert latest is not None
        stats = {"batch_id": job.last_batch_id, "checkpoint_id": latest.checkpoint_id,
                 "rows_in": rows_in, "incremental_bytes": latest.metadata.incremental_size,
                 "full_bytes": latest.metadata.full_size}
        report.stats.append(stats)
        progress.batch(stats)

    def new_job(config: JobConfig) -> LocalJob:
        return LocalJob(ClickAnalytics(), key_columns=["user_id"], input_schema=INPUT_DDL,
                        output_schema=COUNTS_SCHEMA, side_outputs={"sessions": SESSIONS_SCHEMA},
                        config=config)

    started = time.perf_counter()
    savepoint_dir = os.path.join(directory, "savepoints", "savepoint-1")
    first, rest = paths[:files // 2], paths[files // 2:]
    progress.phase("run p=2", len(first))
    with new_job(_config(directory, 1, 2)) as job:
        for path in first:
            table = pq.read_table(path)
            record(job, job.process_batch(table), table.num_rows)
        progress.phase("savepoint", 0)
        report.savepoint = job.stop(savepoint=savepoint_dir) or ""
    progress.phase("restart p=3", len(rest))
    with new_job(_config(directory, 2, 3, restore=savepoint_dir)) as job:
        for path in rest:
            table = pq.read_table(path)
            record(job, job.process_batch(table), table.num_rows)
        progress.phase("drain", 1)
        job.stop(drain=True)
        record(job, job.last_outputs, 0)
    report.seconds = time.perf_counter() - started
    progress.phase("verify", 0)
    report.batches = len(report.stats)
    sessions = pa.concat_tables(outputs["sessions"])
    report.sessions = sessions.num_rows
    report.checks = verify(all_events, pa.concat_tables(outputs["main"]), sessions)
    return report


def run_spark(spark: Any, directory: str, events: int, users: int, files: int,
              progress: RunProgress = QUIET) -> DemoReport:
    """The job on Spark (steps in the module docstring): a file source over
    ``directory/input`` (one file per micro-batch), outputs to ``directory/output/`` through
    :class:`~keyedstate.spark.sinks.ParquetSink`; ``directory`` is new, empty or an earlier
    run's (:func:`~harness.prepare_directory`)."""
    from keyedstate.spark.api import key_by
    from keyedstate.spark.driver import BatchStats
    from keyedstate.spark.sinks import ParquetSink

    prepare_directory(directory)
    progress.phase("generate", 0)
    all_events = list(generate_events(events, users))
    generated = write_input(directory, all_events, files)
    input_dir = os.path.join(directory, "input")
    os.makedirs(input_dir)
    report = DemoReport(runtime="spark", events=events)

    def record(s: BatchStats) -> None:
        if s.checkpoint_id < 0:  # a batch without a checkpoint (nothing new to read)
            return
        report.stats.append(dict(s.__dict__))
        progress.batch(report.stats[-1])

    def run(config: JobConfig, *, savepoint: str | None = None, drain: bool = False
            ) -> str | None:
        source = (spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1)
                  .parquet(input_dir))
        job = (key_by(source, "user_id")
               .process(ClickAnalytics(), output_schema=COUNTS_SCHEMA,
                        side_outputs={"sessions": SESSIONS_SCHEMA})
               .sink(ParquetSink(os.path.join(directory, "output", "counts")))
               .sink(ParquetSink(os.path.join(directory, "output", "sessions")),
                     output="sessions"))
        query = job.start(config, trigger={"availableNow": True},
                          spark_checkpoint_location=os.path.join(directory, "checkpoints",
                                                                 "spark"))
        query.add_listener(record)
        query.await_termination()
        progress.phase("savepoint" if savepoint else "drain", 0 if savepoint else 1)
        return query.stop(savepoint=savepoint, drain=drain)

    started = time.perf_counter()
    first, rest = generated[: files // 2], generated[files // 2:]
    publish(first, input_dir)  # in event-time order, or later files would make earlier ones late
    savepoint_dir = os.path.join(directory, "savepoints", "savepoint-1")
    progress.phase("run p=2", len(first))
    report.savepoint = run(_config(directory, 1, 2), savepoint=savepoint_dir) or ""
    publish(rest, input_dir)
    progress.phase("restart p=3", len(rest))
    run(_config(directory, 2, 3, restore=savepoint_dir), drain=True)
    report.seconds = time.perf_counter() - started
    progress.phase("verify", 0)
    report.batches = len(report.stats)
    sessions = pq.read_table(os.path.join(directory, "output", "sessions"))
    report.sessions = sessions.num_rows
    report.checks = verify(all_events, pq.read_table(os.path.join(directory, "output", "counts")),
                           sessions)
    return report


def main(argv: list[str] | None = None) -> int:
    """``python examples/click_sessions.py --runtime local|spark``: run the job, print the
    report as JSON; exit status 1 if the outputs differ from the oracle."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runtime", choices=["local", "spark"], default="local")
    add_directory_option(parser, "./click-sessions")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--files", type=int, default=10, help="input files, one batch each")
    args = parser.parse_args(argv)
    if args.runtime == "local":
        report = run_local(args.dir, args.events, args.users, args.files)
    else:
        from keyedstate.spark.session import local_session

        spark = local_session("local[2]", "click-sessions")
        try:
            report = run_spark(spark, args.dir, args.events, args.users, args.files)
        finally:
            spark.stop()
    print(json.dumps({**asdict(report), "verified": report.verified}, indent=2, default=str))
    return 0 if report.verified else 1


if __name__ == "__main__":
    raise SystemExit(main())
