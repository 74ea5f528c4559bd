"""``keyedstate demo``: the main job (a click stream with running totals and session windows),
on Spark or in process, checked against its oracle."""

from __future__ import annotations

import dataclasses
import json
import os

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
    if in_process:
        _local_demo(directory, events, users, files, as_json)
        return
    from rich.progress import Progress

    from keyedstate.spark.demo import run_spark_demo
    from keyedstate.spark.session import local_session

    with console.status("starting Spark (local[2])"):
        spark = local_session("local[2]", "keyedstate-demo")
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("batches", total=files + 1)
        report = run_spark_demo(spark, directory, events, users, files,
                                on_batch=lambda s: bar.advance(task))
    spark.stop()
    summary = dataclasses.asdict(report)
    summary["events_per_s"] = report.events / report.seconds
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        committed = [s for s in report.stats if s["checkpoint_id"] >= 0]
        table = Table(title="keyedstate demo (Spark local[2], RocksDB state)")
        table.add_column("metric")
        table.add_column("value", justify="right")
        incr = sorted(s["incremental_bytes"] for s in committed)
        rows = [
            ("events", f"{report.events:,}"),
            ("batches (checkpoints)", str(report.batches)),
            ("parallelism", " -> savepoint -> ".join(map(str, report.parallelism))),
            ("events/s", f"{summary['events_per_s']:,.0f}"),
            ("checkpoint written, median", human_bytes(incr[len(incr) // 2])),
            ("checkpoint full size, last", human_bytes(committed[-1]["full_bytes"])),
            ("checkpoint sync / async, median",
             f"{_median([s['sync_duration_s'] for s in committed]) * 1000:.0f} ms / "
             f"{_median([s['async_duration_s'] for s in committed]) * 1000:.0f} ms"),
            ("savepoint", report.savepoint),
        ]
        rows += [(name, "yes" if ok else "NO") for name, ok in report.checks.items()]
        for name, value in rows:
            table.add_row(name, value)
        Console().print(table)
    if not all(report.checks.values()):
        raise SystemExit("the demo's results differ from pandas over the input")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def _local_demo(directory: str, events: int, users: int, batches: int, as_json: bool) -> None:
    import shutil

    from rich.progress import Progress

    from keyedstate.demo import run_local_demo

    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("events", total=events)
        report = run_local_demo(directory, events, users, batches, "rocksdb", 2, 3,
                                progress=lambda n: bar.advance(task, n))
    summary = dataclasses.asdict(report)
    summary["events_per_s"] = report.events / report.seconds
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        table = Table(title="keyedstate demo (in-process runtime, RocksDB state)")
        table.add_column("metric")
        table.add_column("value", justify="right")
        incr = sorted(c["incremental_bytes"] for c in report.checkpoints)
        for name, value in [
            ("events", f"{report.events:,}"),
            ("batches (checkpoints)", str(report.batches)),
            ("parallelism", " -> ".join(map(str, report.parallelism))),
            ("events/s", f"{summary['events_per_s']:,.0f}"),
            ("checkpoint written, median", human_bytes(incr[len(incr) // 2])),
            ("checkpoint full size, last", human_bytes(report.checkpoints[-1]["full_bytes"])),
            ("sessions emitted", f"{report.sessions:,}"),
            ("matches the oracle", "yes" if report.verified else "NO"),
        ]:
            table.add_row(name, value)
        Console().print(table)
    if not report.verified:
        raise SystemExit("the demo's results differ from the oracle")
