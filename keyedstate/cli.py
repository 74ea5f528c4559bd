"""The ``keyedstate`` command line."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from typing import Any, Callable

import click
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)

BENCHMARKS = {
    "checkpoint": "benchmarks.checkpoint",
    "backend-rescale": "benchmarks.backend_rescale",
    "access": "benchmarks.access",
    "throughput": "benchmarks.throughput",
}


@click.group()
@click.version_option(package_name="keyedstate")
def main() -> None:
    """keyedstate: Flink-grade keyed state for stateful stream processing on PySpark."""


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@main.command()
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
            ("checkpoint written, median", _human_bytes(incr[len(incr) // 2])),
            ("checkpoint full size, last", _human_bytes(committed[-1]["full_bytes"])),
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
            ("checkpoint written, median", _human_bytes(incr[len(incr) // 2])),
            ("checkpoint full size, last", _human_bytes(report.checkpoints[-1]["full_bytes"])),
            ("sessions emitted", f"{report.sessions:,}"),
            ("matches the oracle", "yes" if report.verified else "NO"),
        ]:
            table.add_row(name, value)
        Console().print(table)
    if not report.verified:
        raise SystemExit("the demo's results differ from the oracle")


def _load_benchmark(name: str) -> Any:
    # Benchmarks live in the source tree's benchmarks/ folder, beside the package.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        return importlib.import_module(BENCHMARKS[name])
    except ModuleNotFoundError as exc:
        raise click.ClickException(
            f"benchmark {name!r} needs a source checkout of keyedstate (benchmarks/): {exc}"
        ) from exc


@main.command()
@click.argument("name", type=click.Choice(sorted(BENCHMARKS)))
@click.option("--keys", type=int, default=None, help="Override the benchmark's key count.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON result to this file.")
def bench(name: str, keys: int | None, as_json: bool, out: str | None) -> None:
    """Run a benchmark (figures belong in docs/benchmarks.md)."""
    module = _load_benchmark(name)
    kwargs: dict[str, Any] = {}
    if keys is not None:
        kwargs["keys"] = keys
    with console.status(f"bench {name}") as status:
        progress: Callable[[str], None] = lambda msg: status.update(f"bench {name}: {msg}")
        result = module.run(progress=progress, **kwargs)
    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    if as_json:
        click.echo(text)
    else:
        console.print_json(text)
