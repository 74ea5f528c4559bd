"""``keyedstate demo``: the main job (``examples/click_sessions.py``: a click stream with
running totals and session windows), on Spark or on the local runtime, checked against its one
oracle."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from keyedstate.cli.output import human_bytes, reported_errors
from keyedstate_examples.harness import DIRECTORY_HELP

console = Console(stderr=True)


@click.command()
@click.option("--dir", "directory", default="./keyedstate-demo", show_default=True,
              type=click.Path(file_okay=False), help=DIRECTORY_HELP)
@click.option("--events", default=400_000, show_default=True, type=click.IntRange(min=1),
              help="Events to generate.")
@click.option("--users", default=20_000, show_default=True, type=click.IntRange(min=1),
              help="Distinct users (keys).")
@click.option("--files", default=12, show_default=True,
              help="Input files (one micro-batch each).")
@click.option("--local", "in_process", is_flag=True,
              help="Run the in-process runtime instead of Spark (no Java needed).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def demo(directory: str, events: int, users: int, files: int, in_process: bool,
         as_json: bool) -> None:
    """Run the main job: a click stream with running totals and session windows.

    Shows one progress bar per phase (generate, run p=2, savepoint, restart p=3, drain,
    verify), then a summary; ``--events`` scales it up. With ``--json``, the summary as one
    JSON object (its ``checks``: ``{"<id>": {"passed": ..., "description": ...}}``).

    ``--dir`` is refused (TargetNotEmptyError, exit status 1, before anything runs) unless it
    is new, empty, or an earlier run's (it holds ``.keyedstate-demo``, whose content is
    deleted and written anew)."""
    if files < 2:
        raise click.BadParameter("at least 2 (half before the savepoint, half after)",
                                 param_hint="--files")
    from keyedstate_examples import click_sessions as sessions
    from keyedstate_examples.harness import check_directory

    with reported_errors():
        check_directory(directory)

    spark = None
    if not in_process:
        from keyedstate.spark.session import local_session

        with console.status("starting Spark (local[2])"):
            spark = local_session("local[2]", "keyedstate-demo")
    progress = PhaseProgress(console)
    try:
        with progress.bars:
            if spark is None:
                report = sessions.run_local(directory, events, users, files, progress)
            else:
                report = sessions.run_spark(spark, directory, events, users, files, progress)
            progress.finish()
    finally:
        if spark is not None:
            spark.stop()
    title = (f"keyedstate demo ({'local runtime' if spark is None else 'Spark local[2]'}, "
             f"RocksDB state)")
    summary = {**dataclasses.asdict(report), "verified": report.verified,
               "events_per_s": report.events / report.seconds,
               "phase_seconds": progress.seconds}
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        Console().print(_summary_table(title, report, summary))
    if not report.verified:
        raise SystemExit("the demo's results differ from the oracle over the input")


class PhaseProgress:
    """The demo's :class:`~keyedstate_examples.click_sessions.RunProgress`: a rich progress
    bar per phase with batches done of planned, events/s and the last checkpoint's full
    size; keeps each phase's wall time for the summary."""

    def __init__(self, console: Console) -> None:
        self.bars = Progress(
            SpinnerColumn(finished_text="[green]done"),
            TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:>14}"), TextColumn("{task.fields[size]:>18}"),
            TimeElapsedColumn(), console=console)
        self.seconds: dict[str, float] = {}
        self._task: TaskID | None = None
        self._name = ""
        self._started = 0.0
        self._rows = 0
        self._total = 1

    def phase(self, name: str, batches: int) -> None:
        self.finish()
        self._name, self._started, self._rows = name, time.perf_counter(), 0
        # A phase without batches is one step, done when the next phase begins.
        self._total = batches or 1
        self._task = self.bars.add_task(name, total=self._total, rate="", size="")

    def batch(self, stats: dict[str, Any]) -> None:
        if self._task is None:
            return
        self._rows += int(stats.get("rows_in", 0))
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        rate = f"{self._rows / elapsed:,.0f} events/s" if self._rows else ""  # a drain reads none
        self.bars.update(self._task, advance=1, rate=rate,
                         size=f"checkpoint {human_bytes(int(stats['full_bytes']))}")

    def finish(self) -> None:
        """End the current phase (its bar shows as complete)."""
        if self._task is None:
            return
        self.bars.update(self._task, completed=self._total)
        self.seconds[self._name] = round(time.perf_counter() - self._started, 2)
        self._task = None


def _summary_table(title: str, report: Any, summary: dict[str, Any]) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    stats = report.stats
    incr = sorted(s["incremental_bytes"] for s in stats)
    rows = [
        ("events", f"{report.events:,}"),
        ("batches (checkpoints)", str(report.batches)),
        ("parallelism", " -> savepoint -> ".join(map(str, report.parallelism))),
        ("events/s (whole job)", f"{summary['events_per_s']:,.0f}"),
        ("checkpoint written, median", human_bytes(incr[len(incr) // 2])),
        ("checkpoint full size, last", human_bytes(stats[-1]["full_bytes"])),
    ]
    if "sync_duration_s" in stats[-1]:
        rows.append(("checkpoint sync / async, median",
                     f"{_median([s['sync_duration_s'] for s in stats]) * 1000:.0f} ms / "
                     f"{_median([s['async_duration_s'] for s in stats]) * 1000:.0f} ms"))
    rows += [("sessions emitted", f"{report.sessions:,}"), ("savepoint", report.savepoint)]
    rows += [(f"time: {name}", f"{seconds:.1f} s")
             for name, seconds in summary["phase_seconds"].items()]
    rows += [(check.description, "yes" if check.passed else "NO")
             for check in report.checks.values()]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0
