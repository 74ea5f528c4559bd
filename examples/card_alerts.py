"""Card spend alerts: a spend profile per card, an alert on a spike, a summary when the card
goes idle; one KeyedProcessFunction, run locally (no Java) or on Spark.

Per card (the key) the job keeps the profile of the card's current activity period:

- the largest amount, a ``ReducingState`` (:class:`ReducingStateDescriptor` with ``max``);
- the number of transactions and their average, an ``AggregatingState``
  (:class:`AggregatingStateDescriptor` with :class:`SpendProfile`, Flink's
  ``AggregateFunction``: a typed accumulator, a result computed from it);
- the event times of the period's first and last transaction, a ``ValueState``.

A transaction above ``SPIKE_FACTOR`` times the card's average, once the period has
``MIN_HISTORY`` transactions, goes to the side output ``alerts`` (``ctx.output``). A card with
no transaction for ``IDLE_MS`` of event time has gone idle: an event-time timer at its last
transaction + ``IDLE_MS`` emits the period's summary (the main output) and clears the card's
state. A transaction arriving after such a gap within one micro-batch (its timer could not fire
yet: timers fire at the start of a batch) closes the period the same way first. The run, on
either runtime:

1. Generate transactions (``card_id``, ``ts``, ``amount``, ``merchant``) as Parquet files, one
   per micro-batch, with event-time disorder below the watermark delay (no transaction is
   late).
2. Run the job over every file at parallelism 2 with RocksDB state, a checkpoint per batch. On
   Spark: ``start(config, trigger={"availableNow": True}, query_name="card-alerts")`` (every
   file there is now, then the query ends), both outputs to ``ParquetSink`` directories, read
   back with plain Spark (``recursiveFileLookup``).
3. Stop with drain: the watermark goes to +infinity, so every idle timer fires and every open
   period is summarised.
4. Check the summaries and alerts against an oracle that replays the transactions in plain
   Python.

``python examples/card_alerts.py --runtime local`` (or ``spark``) prints a JSON report; exit
status 1 if an output differs from the oracle.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import random
import time
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keyedstate.config import JobConfig
from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.runtime.local import LocalJob
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)

if __package__:
    from .harness import (
        Check,
        Report,
        add_directory_option,
        prepare_directory,
        publish,
        write_parquet_files,
    )
else:  # run as a script: python examples/card_alerts.py
    from harness import (  # type: ignore[no-redef]
        Check,
        Report,
        add_directory_option,
        prepare_directory,
        publish,
        write_parquet_files,
    )

IDLE_MS = 30 * 60 * 1000
WATERMARK_DELAY_MS = 5 * 60 * 1000
MIN_HISTORY = 3
SPIKE_FACTOR = 5.0
#: mean event-time gap between two transactions of one card
MEAN_GAP_MS = 15 * 60 * 1000
START_MS = 1_700_000_000_000
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
MERCHANTS = ["grocer", "fuel", "online", "travel", "cafe", "pharmacy"]

INPUT_DDL = "card_id string, ts timestamp, amount double, merchant string"
PERIODS_DDL = ("card_id string, first_transaction timestamp, last_transaction timestamp, "
               "transactions bigint, average double, max_amount double")
#: an alerting transaction with the card's average and largest amount before it
ALERTS_DDL = ("card_id string, ts timestamp, amount double, merchant string, average double, "
              "max_amount double")

Transaction = tuple[str, int, float, str]  # card_id, event time (ms), amount, merchant
Period = tuple[str, int, int, int, float, float]  # as PERIODS_DDL, times in ms
Alert = tuple[str, int, float, str, float, float]  # as ALERTS_DDL, times in ms


def generate_transactions(n: int, cards: int, seed: int = 7) -> Iterator[Transaction]:
    """Transactions in event-time order up to ``WATERMARK_DELAY_MS / 2`` of disorder (so none
    is late); about 2% are spikes of 400-2,000 against everyday amounts of 2-120."""
    rng = random.Random(seed)
    t = START_MS
    step = 2 * MEAN_GAP_MS // cards
    for _ in range(n):
        t += rng.randint(0, step)
        jitter = rng.randint(0, WATERMARK_DELAY_MS // 2)
        spike = rng.random() < 0.02
        amount = round(rng.uniform(400, 2_000) if spike else rng.uniform(2, 120), 2)
        yield f"card-{rng.randrange(cards):05d}", t - jitter, amount, rng.choice(MERCHANTS)


def as_table(transactions: list[Transaction]) -> pa.Table:
    return pa.table({
        "card_id": [t[0] for t in transactions],
        "ts": pa.array([t[1] * 1000 for t in transactions], pa.timestamp("us", tz="UTC")),
        "amount": [t[2] for t in transactions],
        "merchant": [t[3] for t in transactions],
    })


def epoch_ms(column: pa.ChunkedArray | pa.Array) -> list[int]:
    """A timestamp column as epoch milliseconds (whatever its unit and time zone)."""
    micros = column.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
    return pc.divide(micros, 1000).to_pylist()


# -- the job ---------------------------------------------------------------------------------


class SpendProfile:
    """Flink's ``AggregateFunction`` over a card's amounts: the accumulator (of the state's
    declared type ``transactions bigint, total double``) counts and sums them, the result is
    the count and the average."""

    def create_accumulator(self) -> dict[str, Any]:
        return {"transactions": 0, "total": 0.0}

    def add(self, value: float, accumulator: dict[str, Any]) -> dict[str, Any]:
        return {"transactions": accumulator["transactions"] + 1,
                "total": accumulator["total"] + value}

    def get_result(self, accumulator: dict[str, Any]) -> dict[str, Any]:
        n = accumulator["transactions"]
        return {"transactions": n, "average": accumulator["total"] / n if n else 0.0}


class CardAlerts(KeyedProcessFunction):
    """Spend profile per card and activity period; alerts on spikes (side output ``alerts``),
    a summary per period when the card goes idle (main output)."""

    max_amount: ReducingStateDescriptor[float] = ReducingStateDescriptor("max_amount", max,
                                                                         "double")
    profile = AggregatingStateDescriptor("profile", SpendProfile(),
                                         "transactions bigint, total double")
    period = ValueStateDescriptor("period", "first bigint, last bigint")

    def open(self, ctx: Context) -> None:
        self.max_state = ctx.get_state(self.max_amount)
        self.profile_state = ctx.get_state(self.profile)
        self.period_state = ctx.get_state(self.period)

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        before = self.period_state.value()
        # The card's one timer: at the open period's last transaction + IDLE_MS.
        registered = before["last"] + IDLE_MS if before is not None else None
        period = before
        summaries = []
        for ts, row in zip(epoch_ms(rows.column("ts")), rows.to_pylist()):
            if period is not None and ts >= period["last"] + IDLE_MS:
                # Idle before this transaction: close the period as its timer would have.
                summaries.append(self._summary(key, period))
                self._clear()
                period = None
            profile = self.profile_state.get()
            if (profile is not None and profile["transactions"] >= MIN_HISTORY
                    and row["amount"] > SPIKE_FACTOR * profile["average"]):
                ctx.output("alerts", {"card_id": key, "ts": row["ts"], "amount": row["amount"],
                                      "merchant": row["merchant"],
                                      "average": profile["average"],
                                      "max_amount": self.max_state.get()})
            self.profile_state.add(row["amount"])
            self.max_state.add(row["amount"])
            period = ({"first": ts, "last": ts} if period is None else
                      {"first": min(period["first"], ts), "last": max(period["last"], ts)})
        assert period is not None  # rows is never empty
        self.period_state.update(period)
        due = period["last"] + IDLE_MS
        if registered != due:
            timers = ctx.timer_service
            if registered is not None:
                timers.delete_event_time_timer(registered)
            timers.register_event_time_timer(due)
        return summaries

    def on_timer(self, timestamp: int, ctx: Context) -> list[dict[str, Any]]:
        period = self.period_state.value()
        # Deleted timers never fire; the check only documents which timer this is.
        if period is None or period["last"] + IDLE_MS != timestamp:
            return []
        summary = self._summary(ctx.current_key, period)
        self._clear()
        return [summary]

    def _summary(self, key: Any, period: dict[str, int]) -> dict[str, Any]:
        profile = self.profile_state.get()
        return {"card_id": key,
                "first_transaction": EPOCH + dt.timedelta(milliseconds=period["first"]),
                "last_transaction": EPOCH + dt.timedelta(milliseconds=period["last"]),
                "transactions": profile["transactions"], "average": profile["average"],
                "max_amount": self.max_state.get()}

    def _clear(self) -> None:
        self.period_state.clear()
        self.profile_state.clear()
        self.max_state.clear()


# -- the oracle ------------------------------------------------------------------------------


def oracle(transactions: list[Transaction]) -> tuple[list[Period], list[Alert]]:
    """Period summaries and alerts, replaying ``transactions`` in arrival order in plain
    Python: a period ends at the first transaction ``IDLE_MS`` or more after its latest one,
    or at the end of the stream (the drain)."""
    periods: list[Period] = []
    alerts: list[Alert] = []
    open_periods: dict[str, dict[str, Any]] = {}

    def summary(card: str, p: dict[str, Any]) -> Period:
        return card, p["first"], p["last"], p["n"], p["total"] / p["n"], p["max"]

    for card, ts, amount, merchant in transactions:
        p = open_periods.get(card)
        if p is not None and ts >= p["last"] + IDLE_MS:
            periods.append(summary(card, p))
            p = None
        if p is None:
            p = open_periods[card] = {"first": ts, "last": ts, "n": 0, "total": 0.0,
                                      "max": -math.inf}
        if p["n"] >= MIN_HISTORY and amount > SPIKE_FACTOR * p["total"] / p["n"]:
            alerts.append((card, ts, amount, merchant, p["total"] / p["n"], p["max"]))
        p["n"], p["total"], p["max"] = p["n"] + 1, p["total"] + amount, max(p["max"], amount)
        p["first"], p["last"] = min(p["first"], ts), max(p["last"], ts)
    periods += [summary(card, p) for card, p in open_periods.items()]
    return periods, alerts


def _rounded(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Rows sorted, floats rounded to 6 places (the job and the oracle sum in the same order,
    but a reader may round-trip a double through text)."""
    return sorted(tuple(round(v, 6) if isinstance(v, float) else v for v in r) for r in rows)


def verify(transactions: list[Transaction], periods: pa.Table, alerts: pa.Table
           ) -> dict[str, Check]:
    """The job's outputs against the oracle; one verdict per check, by identifier."""
    want_periods, want_alerts = oracle(transactions)
    got_periods = list(zip(periods.column("card_id").to_pylist(),
                           epoch_ms(periods.column("first_transaction")),
                           epoch_ms(periods.column("last_transaction")),
                           periods.column("transactions").to_pylist(),
                           periods.column("average").to_pylist(),
                           periods.column("max_amount").to_pylist()))
    got_alerts = list(zip(alerts.column("card_id").to_pylist(), epoch_ms(alerts.column("ts")),
                          alerts.column("amount").to_pylist(),
                          alerts.column("merchant").to_pylist(),
                          alerts.column("average").to_pylist(),
                          alerts.column("max_amount").to_pylist()))
    return {"period_summaries_match_oracle": Check(
                _rounded(got_periods) == _rounded(want_periods),
                "period summaries match the oracle"),
            "alerts_match_oracle": Check(_rounded(got_alerts) == _rounded(want_alerts),
                                         "alerts match the oracle")}


# -- the two runtimes ------------------------------------------------------------------------


def job_config(directory: str) -> JobConfig:
    return JobConfig(checkpoint_dir=os.path.join(directory, "checkpoints"), parallelism=2,
                     backend="rocksdb", watermark_column="ts",
                     watermark_delay=dt.timedelta(milliseconds=WATERMARK_DELAY_MS),
                     local_dir=os.path.join(directory, "local"))


def _generate(directory: str, transactions: int, cards: int, files: int
              ) -> tuple[list[Transaction], list[str]]:
    prepare_directory(directory)
    generated = list(generate_transactions(transactions, cards))
    paths = write_parquet_files(os.path.join(directory, "generated"), as_table(generated), files)
    return generated, paths


def run_local(directory: str, transactions: int = 20_000, cards: int = 500, files: int = 6
              ) -> Report:
    """The job with :class:`~keyedstate.runtime.local.LocalJob` (steps in the module
    docstring), in ``directory`` (new, empty or an earlier
    run's: :func:`~harness.prepare_directory`)."""
    generated, paths = _generate(directory, transactions, cards, files)
    report = Report(example="card_alerts", runtime="local", events=transactions)
    outputs: dict[str, list[pa.Table]] = {"main": [], "alerts": []}
    started = time.perf_counter()
    with LocalJob(CardAlerts(), key_columns=["card_id"], input_schema=INPUT_DDL,
                  output_schema=PERIODS_DDL, side_outputs={"alerts": ALERTS_DDL},
                  config=job_config(directory)) as job:
        for path in [*paths, None]:
            if path is None:
                job.stop(drain=True)
                out = job.last_outputs
            else:
                out = job.process_batch(pq.read_table(path))
            for tag in outputs:
                outputs[tag].append(out[tag])
            report.batches += 1
    report.seconds = time.perf_counter() - started
    periods, alerts = (pa.concat_tables(outputs[t]) for t in ("main", "alerts"))
    report.outputs = {"periods": periods.num_rows, "alerts": alerts.num_rows}
    report.checks = verify(generated, periods, alerts)
    return report


def run_spark(spark: Any, directory: str, transactions: int = 20_000, cards: int = 500,
              files: int = 6) -> Report:
    """The job on Spark (steps in the module docstring): a file source over
    ``directory/input`` (one file per micro-batch), summaries to the
    :class:`~keyedstate.spark.sinks.ParquetSink` ``directory/output/periods``, alerts to
    ``directory/output/alerts``; ``directory`` is new, empty or an
    earlier run's (:func:`~harness.prepare_directory`)."""
    from keyedstate.spark import ParquetSink, key_by

    generated, paths = _generate(directory, transactions, cards, files)
    report = Report(example="card_alerts", runtime="spark", events=transactions)
    input_dir = os.path.join(directory, "input")
    publish(paths, input_dir)
    out = os.path.join(directory, "output")
    started = time.perf_counter()
    source = (spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1)
              .parquet(input_dir))
    job = (key_by(source, "card_id")
           .process(CardAlerts(), output_schema=PERIODS_DDL,
                    side_outputs={"alerts": ALERTS_DDL})
           .sink(ParquetSink(os.path.join(out, "periods")))
           .sink(ParquetSink(os.path.join(out, "alerts")), output="alerts"))
    # availableNow: every file there is now, one per batch (maxFilesPerTrigger), then the
    # query ends; the name shows in Spark's UI and in spark.streams.active.
    query = job.start(job_config(directory), trigger={"availableNow": True},
                      query_name="card-alerts")
    query.await_termination()
    query.stop(drain=True)
    report.seconds = time.perf_counter() - started
    report.batches = len(query.stats)
    report.details = {"query_name": query.query.name, "query_id": str(query.query.id),
                      "timers_fired": sum(s.timers_fired for s in query.stats),
                      "timers_fired_in_drain": query.stats[-1].timers_fired}
    # The sink's batch directories are no key=value partitions: Spark reads them only with
    # recursiveFileLookup (docs/spark.md, "ParquetSink files").
    periods, alerts = (spark.read.option("recursiveFileLookup", "true")
                       .parquet(os.path.join(out, name)).toArrow()
                       for name in ("periods", "alerts"))
    report.outputs = {"periods": periods.num_rows, "alerts": alerts.num_rows}
    report.checks = verify(generated, periods, alerts)
    return report


def main(argv: list[str] | None = None) -> int:
    """``python examples/card_alerts.py --runtime local|spark``: run the job, print the report
    as JSON; exit status 1 if the outputs differ from the oracle."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runtime", choices=["local", "spark"], default="local")
    add_directory_option(parser, "./card-alerts")
    parser.add_argument("--transactions", type=int, default=20_000)
    parser.add_argument("--cards", type=int, default=500)
    parser.add_argument("--files", type=int, default=6, help="input files, one batch each")
    args = parser.parse_args(argv)
    if args.runtime == "local":
        report = run_local(args.dir, args.transactions, args.cards, args.files)
    else:
        from keyedstate.spark.session import local_session

        spark = local_session("local[2]", "card-alerts")
        try:
            report = run_spark(spark, args.dir, args.transactions, args.cards, args.files)
        finally:
            spark.stop()
    return report.print_json()


if __name__ == "__main__":
    raise SystemExit(main())
