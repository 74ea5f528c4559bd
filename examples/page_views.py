"""Page views, deduplicated: per user, the views and last visit of each page, counting each
event once though the source delivers some twice; run locally (no Java) or on Spark.

The source (a tracker behind an at-least-once queue) redelivers about one view in ten, with
the same ``event_id``, often in a later micro-batch. Per user (the key) the job keeps
two map states (:class:`MapStateDescriptor`, typed keys and values):

- ``seen``: the event ids already counted, with a state TTL of a day
  (:class:`StateTtlConfig`: an id is forgotten a day after it was written, so the state stays
  bounded; TTL runs on processing time, as Flink's);
- ``pages``: per page, the number of views and the latest view's event time.

Every batch emits the pages of each user that changed (the main output, an upsert stream: the
row with the highest ``batch_id`` per user and page is current); a redelivered view goes to
the side output ``duplicates`` instead. The run, on either runtime:

1. Generate views (``user_id``, ``event_id``, ``page``, ``ts``) with redeliveries, as Parquet
   files, one per micro-batch.
2. Run the job over the first half of the files at parallelism 2 (RocksDB state, a checkpoint
   per batch), stop it; start it again on the rest: it resumes from its last checkpoint, and
   redeliveries of views counted before the stop are still recognised. On Spark:
   ``start(config, trigger={"processingTime": "1 second"}, query_name="page-views")``,
   ``process_all_available()``, ``stop()``; outputs to ``ParquetSink`` directories, read
   back with pyarrow.
3. Check the current rows and the duplicates against an oracle that deduplicates the views in
   plain Python (the run lasts seconds, far less than the TTL: no id expires in it).

``python examples/page_views.py --runtime local`` (or ``spark``) prints a JSON report; exit
status 1 if an output differs from the oracle.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import time
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from keyedstate.config import JobConfig
from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.runtime.local import LocalJob
from keyedstate.state.descriptors import MapStateDescriptor, StateTtlConfig

if __package__:
    from .harness import (
        Check,
        Report,
        add_directory_option,
        prepare_directory,
        publish,
        write_parquet_files,
    )
else:  # run as a script: python examples/page_views.py
    from harness import (  # type: ignore[no-redef]
        Check,
        Report,
        add_directory_option,
        prepare_directory,
        publish,
        write_parquet_files,
    )

REDELIVERED = 0.1
#: a redelivery repeats one of the last this many views
REDELIVERY_WINDOW = 400
PAGES = ["/", "/pricing", "/docs", "/docs/state", "/docs/spark", "/blog", "/signup", "/login",
         "/account", "/checkout"]
START_MS = 1_700_000_000_000

INPUT_DDL = "user_id string, event_id string, page string, ts timestamp"
VISITS_DDL = "user_id string, page string, views bigint, last_seen timestamp, batch_id bigint"
DUPLICATES_DDL = "user_id string, event_id string, page string, ts timestamp, batch_id bigint"

View = tuple[str, str, str, int]  # user_id, event_id, page, event time (ms)


def generate_views(n: int, users: int, seed: int = 11) -> Iterator[View]:
    """``n`` deliveries: views in event-time order, a ``REDELIVERED`` share of them repeats
    of one of the last ``REDELIVERY_WINDOW`` views (the same event id, page and time)."""
    rng = random.Random(seed)
    t = START_MS
    recent: list[View] = []
    for i in range(n):
        if recent and rng.random() < REDELIVERED:
            yield rng.choice(recent[-REDELIVERY_WINDOW:])
            continue
        t += rng.randint(0, 2_000)
        view = (f"user-{rng.randrange(users):05d}", f"ev-{i:08d}", rng.choice(PAGES), t)
        recent.append(view)
        yield view


def as_table(views: list[View]) -> pa.Table:
    return pa.table({
        "user_id": [v[0] for v in views], "event_id": [v[1] for v in views],
        "page": [v[2] for v in views],
        "ts": pa.array([v[3] * 1000 for v in views], pa.timestamp("us", tz="UTC")),
    })


def epoch_ms(column: pa.ChunkedArray | pa.Array) -> list[int]:
    """A timestamp column as epoch milliseconds (whatever its unit and time zone)."""
    micros = column.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
    return pc.divide(micros, 1000).to_pylist()


# -- the job ---------------------------------------------------------------------------------


class PageVisits(KeyedProcessFunction):
    """Views and last visit per user and page, each event id counted once."""

    seen = MapStateDescriptor("seen", "string", "timestamp",
                              ttl=StateTtlConfig(ttl=dt.timedelta(days=1)))
    pages = MapStateDescriptor("pages", "string", "views bigint, last_seen timestamp")

    def open(self, ctx: Context) -> None:
        self.seen_state = ctx.get_state(self.seen)
        self.pages_state = ctx.get_state(self.pages)

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        changed: dict[str, dict[str, Any]] = {}
        for view in rows.to_pylist():
            if self.seen_state.contains(view["event_id"]):
                ctx.output("duplicates", {**view, "batch_id": ctx.batch_id})
                continue
            self.seen_state.put(view["event_id"], view["ts"])
            page = view["page"]
            visits = changed.get(page) or self.pages_state.get(page)
            changed[page] = (
                {"views": 1, "last_seen": view["ts"]} if visits is None else
                {"views": visits["views"] + 1, "last_seen": max(visits["last_seen"], view["ts"])})
        self.pages_state.put_all(changed)
        return [{"user_id": key, "page": page, **visits, "batch_id": ctx.batch_id}
                for page, visits in changed.items()]


# -- the oracle ------------------------------------------------------------------------------


def oracle(views: list[View]) -> tuple[dict[tuple[str, str], tuple[int, int]],
                                       list[tuple[str, str]]]:
    """``{(user, page): (views, last view's ms)}`` over the distinct event ids, and every
    redelivery ``(user, event id)``, in plain Python."""
    seen: set[str] = set()
    visits: dict[tuple[str, str], tuple[int, int]] = {}
    duplicates = []
    for user, event_id, page, ts in views:
        if event_id in seen:
            duplicates.append((user, event_id))
            continue
        seen.add(event_id)
        n, last = visits.get((user, page), (0, ts))
        visits[(user, page)] = (n + 1, max(last, ts))
    return visits, duplicates


def verify(views: list[View], visits: pa.Table, duplicates: pa.Table) -> dict[str, Check]:
    """The job's outputs against the oracle; one verdict per check, by identifier."""
    want_visits, want_duplicates = oracle(views)
    rows = sorted(zip(visits.column("batch_id").to_pylist(), visits.column("user_id").to_pylist(),
                      visits.column("page").to_pylist(), visits.column("views").to_pylist(),
                      epoch_ms(visits.column("last_seen"))))
    current = {(user, page): (n, last) for _, user, page, n, last in rows}
    once = len({(b, user, page) for b, user, page, _, _ in rows}) == len(rows)
    got_duplicates = sorted(zip(duplicates.column("user_id").to_pylist(),
                                duplicates.column("event_id").to_pylist()))
    return {"current_views_match_oracle": Check(
                current == want_visits, "current views per user and page match the oracle"),
            "one_row_per_user_page_and_batch": Check(once, "one row per user, page and batch"),
            "duplicates_match_oracle": Check(got_duplicates == sorted(want_duplicates),
                                             "duplicates match the oracle")}


def redelivered_across_the_restart(views: list[View], paths: list[str]) -> int:
    """Redeliveries in the second half of the files of a view in the first half: what only
    state restored from the checkpoint recognises."""
    first_half = sum(pq.ParquetFile(p).metadata.num_rows for p in paths[:len(paths) // 2])
    before = {v[1] for v in views[:first_half]}
    return sum(1 for v in views[first_half:] if v[1] in before)


# -- the two runtimes ------------------------------------------------------------------------


def job_config(directory: str) -> JobConfig:
    return JobConfig(checkpoint_dir=os.path.join(directory, "checkpoints"), parallelism=2,
                     backend="rocksdb", local_dir=os.path.join(directory, "local"))


def _generate(directory: str, views: int, users: int, files: int
              ) -> tuple[list[View], list[str]]:
    prepare_directory(directory)
    generated = list(generate_views(views, users))
    paths = write_parquet_files(os.path.join(directory, "generated"), as_table(generated), files)
    return generated, paths


def run_local(directory: str, views: int = 20_000, users: int = 300, files: int = 6) -> Report:
    """The job with :class:`~keyedstate.runtime.local.LocalJob` (steps in the module
    docstring), in ``directory`` (new, empty or an earlier
    run's: :func:`~harness.prepare_directory`)."""
    generated, paths = _generate(directory, views, users, files)
    report = Report(example="page_views", runtime="local", events=views)
    outputs: dict[str, list[pa.Table]] = {"main": [], "duplicates": []}
    started = time.perf_counter()
    for phase in (paths[:files // 2], paths[files // 2:]):
        # The second job recovers the first one's latest checkpoint (the same directory).
        with LocalJob(PageVisits(), key_columns=["user_id"], input_schema=INPUT_DDL,
                      output_schema=VISITS_DDL, side_outputs={"duplicates": DUPLICATES_DDL},
                      config=job_config(directory)) as job:
            for path in phase:
                out = job.process_batch(pq.read_table(path))
                for tag in outputs:
                    outputs[tag].append(out[tag])
                report.batches += 1
            job.stop()
    report.seconds = time.perf_counter() - started
    visits, duplicates = (pa.concat_tables(outputs[t]) for t in ("main", "duplicates"))
    _finish(report, generated, paths, visits, duplicates)
    return report


def run_spark(spark: Any, directory: str, views: int = 20_000, users: int = 300,
              files: int = 6) -> Report:
    """The job on Spark (steps in the module docstring): a file source over
    ``directory/input`` (one file per micro-batch), current rows to the
    :class:`~keyedstate.spark.sinks.ParquetSink` ``directory/output/visits``, redeliveries to
    ``directory/output/duplicates``; ``directory`` is new, empty or an
    earlier run's (:func:`~harness.prepare_directory`)."""
    from keyedstate.spark import ParquetSink, key_by

    generated, paths = _generate(directory, views, users, files)
    report = Report(example="page_views", runtime="spark", events=views)
    input_dir = os.path.join(directory, "input")
    out = os.path.join(directory, "output")
    started = time.perf_counter()
    resumed_at = []
    for phase in (paths[:files // 2], paths[files // 2:]):
        publish(phase, input_dir)
        source = (spark.readStream.schema(INPUT_DDL).option("maxFilesPerTrigger", 1)
                  .parquet(input_dir))
        job = (key_by(source, "user_id")
               .process(PageVisits(), output_schema=VISITS_DDL,
                        side_outputs={"duplicates": DUPLICATES_DDL})
               .sink(ParquetSink(os.path.join(out, "visits")))
               .sink(ParquetSink(os.path.join(out, "duplicates")), output="duplicates"))
        # A batch a second while there is input; the same checkpoint directory (and its Spark
        # checkpoint location, <checkpoint dir>/spark) each time: the second start resumes.
        query = job.start(job_config(directory), trigger={"processingTime": "1 second"},
                          query_name="page-views")
        query.process_all_available()
        query.stop()
        resumed_at.append(query.stats[0].batch_id)
        report.batches += len(query.stats)
    report.seconds = time.perf_counter() - started
    report.details["first_batch_of_each_start"] = resumed_at
    # pyarrow reads every batch directory and skips _SUCCESS and _temporary/ (names
    # starting with "_"): docs/spark.md, "ParquetSink files".
    visits, duplicates = (ds.dataset(os.path.join(out, name), format="parquet").to_table()
                          for name in ("visits", "duplicates"))
    _finish(report, generated, paths, visits, duplicates)
    return report


def _finish(report: Report, generated: list[View], paths: list[str], visits: pa.Table,
            duplicates: pa.Table) -> None:
    report.outputs = {"visits": visits.num_rows, "duplicates": duplicates.num_rows}
    report.details["redelivered_across_the_restart"] = redelivered_across_the_restart(
        generated, paths)
    report.checks = verify(generated, visits, duplicates)


def main(argv: list[str] | None = None) -> int:
    """``python examples/page_views.py --runtime local|spark``: run the job, print the report
    as JSON; exit status 1 if the outputs differ from the oracle."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runtime", choices=["local", "spark"], default="local")
    add_directory_option(parser, "./page-views")
    parser.add_argument("--views", type=int, default=20_000)
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--files", type=int, default=6, help="input files, one batch each")
    args = parser.parse_args(argv)
    if args.runtime == "local":
        report = run_local(args.dir, args.views, args.users, args.files)
    else:
        from keyedstate.spark.session import local_session

        spark = local_session("local[2]", "page-views")
        try:
            report = run_spark(spark, args.dir, args.views, args.users, args.files)
        finally:
            spark.stop()
    return report.print_json()


if __name__ == "__main__":
    raise SystemExit(main())
