"""``keyedstate demo``: the main job (``examples/click_sessions.py``: a click stream with
running totals and session windows), on Spark or on the local runtime, checked against its one
oracle."""

from __future__ import annotations

import dataclasses
import json

import click
from rich.console import Console
from rich.table import Table

from keyedstate.cli.output import human_bytes

console = Console(stderr=True)


@click.command()
@click.option("--dir", "directory", default="./keyedstate-demo", show_default=True,
              type=click.Path(file_okay=False), help="Where input, outputs and checkpoints go.")
@click.option("--events", default=2_000_000, show_default=True, help="Events to generate.")
@click.option("--users", default=100_000, show_default=True, help="Distinct users (keys).")
@click.option("--files", default=20, show_default=True,
              help="Input files (one micro-batch each).")
@click.option("--local", "in_process", is_flag=True,
              help="Run the in-process runtime instead of Spark (no Java needed).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def demo(directory: str, events: int, users: int, files: int, in_process: bool,
         as_json: bool) -> None:
    """Run the main job: a click stream with running totals and session windows."""
    from rich.progress import Progress

    from keyedstate_examples import click_sessions as sessions

    spark = None
    if not in_process:
        from keyedstate.spark.session import local_session

        with console.status("starting Spark (local[2])"):
            spark = local_session("local[2]", "keyedstate-demo")
    try:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("batches", total=files + 1)
            if spark is None:
                report = sessions.run_local(directory, events, users, files,
                                            on_batch=lambda s: bar.advance(task))
            else:
                report = sessions.run_spark(spark, directory, events, users, files,
                                            on_batch=lambda s: bar.advance(task))
    finally:
        if spark is not None:
            spark.stop()
    title = (f"keyedstate demo ({'local runtime' if spark is None else 'Spark local[2]'}, "
             f"RocksDB state)")
    summary = {**dataclasses.asdict(report), "verified": report.verified,
               "events_per_s": report.events / report.seconds}
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        table = Table(title=title)
        table.add_column("metric")
        table.add_column("value", justify="right")
        stats = report.stats
        incr = sorted(s["incremental_bytes"] for s in stats)
        rows = [
            ("events", f"{report.events:,}"),
            ("batches (checkpoints)", str(report.batches)),
            ("parallelism", " -> savepoint -> ".join(map(str, report.parallelism))),
            ("events/s", f"{summary['events_per_s']:,.0f}"),
            ("checkpoint written, median", human_bytes(incr[len(incr) // 2])),
            ("checkpoint full size, last", human_bytes(stats[-1]["full_bytes"])),
        ]
        if "sync_duration_s" in stats[-1]:
            rows.append(("checkpoint sync / async, median",
                         f"{_median([s['sync_duration_s'] for s in stats]) * 1000:.0f} ms / "
                         f"{_median([s['async_duration_s'] for s in stats]) * 1000:.0f} ms"))
        rows += [("sessions emitted", f"{report.sessions:,}"), ("savepoint", report.savepoint)]
        rows += [(name, "yes" if ok else "NO") for name, ok in report.checks.items()]
        for name, value in rows:
            table.add_row(name, value)
        Console().print(table)
    if not report.verified:
        raise SystemExit("the demo's results differ from the oracle over the input")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0
