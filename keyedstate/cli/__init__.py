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

from keyedstate.cli.output import human_bytes, parse_storage_options

console = Console(stderr=True)

BENCHMARKS = {
    "checkpoint": "benchmarks.checkpoint",
    "backend-rescale": "benchmarks.backend_rescale",
    "access": "benchmarks.access",
    "throughput": "benchmarks.throughput",
    "remote": "benchmarks.remote",
    "rescale": "benchmarks.rescale",
}


@click.group()
@click.version_option(package_name="keyedstate")
def main() -> None:
    """keyedstate: Flink-grade keyed state for stateful stream processing on PySpark."""


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
    from rich.progress import Progress

    sessions = _click_sessions()
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


def _click_sessions() -> Any:
    """The click-sessions example job: installed as ``keyedstate_examples`` (``examples/``);
    a source checkout installed before ``examples/`` was a package has it as ``examples``
    when run from the checkout's root (its cwd is on ``sys.path``)."""
    try:
        return importlib.import_module("keyedstate_examples.click_sessions")
    except ModuleNotFoundError as exc:
        if exc.name not in ("keyedstate_examples", "keyedstate_examples.click_sessions"):
            raise
        return importlib.import_module("examples.click_sessions")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def _load_benchmark(name: str) -> Any:
    # Benchmarks live in the source tree's benchmarks/ folder, beside the package.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


# -- snapshots: checkpoints list|show, savepoint create, gc ------------------------------------------

_STORAGE_OPTIONS = click.option(
    "--storage-options", "storage_options", default=None, metavar="JSON",
    help='fsspec options as a JSON object, e.g. \'{"endpoint_url": "http://localhost:9000"}\'.')
_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(f"{type(exc).__name__}: {exc}")


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


@main.group()
def checkpoints() -> None:
    """Inspect a job's checkpoints and savepoints."""


@checkpoints.command("list")
@click.argument("directory")
@_JSON
@_STORAGE_OPTIONS
def checkpoints_list(directory: str, as_json: bool, storage_options: str | None) -> None:
    """List the retained checkpoints of a job's checkpoint DIRECTORY (any fsspec URL; for a
    savepoint directory, the savepoint)."""
    from keyedstate.errors import KeyedStateError
    from keyedstate.processor.inspection import list_checkpoints

    try:
        listing = list_checkpoints(directory, parse_storage_options(storage_options))
    except (KeyedStateError, OSError) as exc:
        raise _fail(exc) from exc
    if as_json:
        _echo_json(listing)
        return
    table = Table(title=f"checkpoints in {directory}")
    for column in ("id", "kind", "batch", "p", "max p", "backend", "incremental", "full",
                   "files"):
        table.add_column(column, justify="left" if column in ("kind", "backend") else "right",
                         no_wrap=True)
    for c in listing:
        if "error" in c:
            table.add_row(str(c["id"]), "[red]unreadable[/red]", "", "", "", c["error"], "", "",
                          "")
            continue
        table.add_row(str(c["id"]), c["kind"], "" if c["batch_id"] is None else str(c["batch_id"]),
                      str(c["parallelism"]), str(c["max_parallelism"]), c["backend"],
                      human_bytes(c["incremental_bytes"]), human_bytes(c["full_bytes"]),
                      str(len(c["files"])))
    Console().print(table)


@checkpoints.command("show")
@click.argument("path")
@_JSON
@click.option("--no-state-sizes", is_flag=True,
              help="Skip computing per-state sizes (they read the snapshot's files).")
@_STORAGE_OPTIONS
def checkpoints_show(path: str, as_json: bool, no_state_sizes: bool,
                     storage_options: str | None) -> None:
    """Show one checkpoint or savepoint: PATH is a checkpoint directory (its latest
    checkpoint), a chk-N folder, a savepoint folder or a _metadata file."""
    from keyedstate.errors import KeyedStateError
    from keyedstate.processor.inspection import show

    try:
        with console.status("reading the snapshot"):
            detail = show(path, parse_storage_options(storage_options),
                          state_sizes=not no_state_sizes)
    except (KeyedStateError, OSError) as exc:
        raise _fail(exc) from exc
    if as_json:
        _echo_json(detail)
        return
    out = Console()
    summary = Table(title=f"{detail['kind']} {detail['id']} ({detail['format']})",
                    show_header=False)
    summary.add_column("field")
    summary.add_column("value")
    for key in ("metadata", "batch_id", "backend", "parallelism", "max_parallelism",
                "key_types"):
        summary.add_row(key, str(detail[key]))
    summary.add_row("incremental / full", f"{human_bytes(detail['incremental_bytes'])} / "
                                          f"{human_bytes(detail['full_bytes'])}")
    summary.add_row("files", str(len(detail["files"])))
    out.print(summary)
    subtasks = Table(title="subtasks")
    for column in ("subtask", "key groups", "shared files", "private files", "incremental",
                   "full"):
        subtasks.add_column(column, justify="right")
    for s in detail["subtasks"]:
        subtasks.add_row(str(s["index"]), f"{s['key_group_start']}-{s['key_group_end']}",
                         str(len(s["shared"])), str(len(s["private"])),
                         human_bytes(s["incremental_bytes"]), human_bytes(s["full_bytes"]))
    out.print(subtasks)
    states = Table(title=f"states (sizes {detail['state_sizes']})")
    for column in ("state", "kind", "value type", "bytes"):
        states.add_column(column, justify="right" if column == "bytes" else "left")
    for s in detail["states"]:
        states.add_row(s["name"], s["kind"] or "", s["value_type"] or "",
                       "" if s["bytes"] is None else human_bytes(s["bytes"]))
    out.print(states)


@main.group()
def savepoint() -> None:
    """Create savepoints (user-owned, self-contained snapshots)."""


@savepoint.command("create")
@click.argument("checkpoint_dir")
@click.argument("target")
@click.option("--format", "fmt", type=click.Choice(["native", "canonical"]), default="native",
              show_default=True,
              help="native: the backend's files, duplicated; canonical: Parquet per state, "
                   "readable by any backend and tool.")
@_JSON
@_STORAGE_OPTIONS
def savepoint_create(checkpoint_dir: str, target: str, fmt: str, as_json: bool,
                     storage_options: str | None) -> None:
    """Write a savepoint of a retained checkpoint to TARGET. CHECKPOINT_DIR is a job's
    checkpoint directory (its latest checkpoint), a chk-N folder, or a savepoint. A Spark
    job's savepoint carries its source positions and any output of its batch the sinks had
    not committed (a job restored from it commits that output first)."""
    import time

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from keyedstate.checkpoint.resolve import resolve_snapshot
    from keyedstate.checkpoint.savepoint import write_native_savepoint
    from keyedstate.errors import KeyedStateError
    from keyedstate.spark.carry import carry

    options = parse_storage_options(storage_options)
    started = time.perf_counter()
    try:
        source = resolve_snapshot(checkpoint_dir, options)
        attach = carry(source, options)
        if fmt == "native":
            with Progress(TextColumn("duplicating files"), BarColumn(), DownloadColumn(),
                          console=console, transient=True) as bar:
                task = bar.add_task("files", total=None)
                url = write_native_savepoint(
                    source, target, options, attach=attach,
                    progress=lambda done, total: bar.update(task, completed=done, total=total))
        else:
            from keyedstate.processor.canonical import write_canonical_savepoint

            with console.status("writing a canonical savepoint (Parquet per state)"):
                url = write_canonical_savepoint(source, target, options, attach=attach)
    except (KeyedStateError, OSError) as exc:
        raise _fail(exc) from exc
    result = {"savepoint": url, "format": fmt, "source": source.storage.url_of(
        source.metadata_path), "seconds": round(time.perf_counter() - started, 3)}
    if as_json:
        _echo_json(result)
    else:
        Console().print(f"{fmt} savepoint of {result['source']} written: {url}")


@main.command()
@click.argument("directory")
@click.option("--apply", "apply", is_flag=True,
              help="Delete the files listed (without it, gc only lists them).")
@_JSON
@_STORAGE_OPTIONS
def gc(directory: str, apply: bool, as_json: bool, storage_options: str | None) -> None:
    """List files under a job's checkpoint DIRECTORY that no committed checkpoint references
    (and no work in flight may need); delete them with --apply. Safe on a running job."""
    from rich.progress import Progress

    from keyedstate.errors import KeyedStateError
    from keyedstate.processor.inspection import delete_garbage, find_garbage

    try:
        report = find_garbage(directory, parse_storage_options(storage_options))
        deleted = 0
        if apply and report.files:
            with Progress(console=console, transient=True) as bar:
                task = bar.add_task("deleting", total=len(report.files))
                deleted = delete_garbage(
                    report, progress=lambda done, total: bar.update(task, completed=done))
    except (KeyedStateError, OSError) as exc:
        raise _fail(exc) from exc
    if as_json:
        _echo_json({**report.to_json(), "deleted": deleted, "applied": apply})
        return
    out = Console()
    if report.latest_checkpoint_id is None:
        out.print(f"{directory} holds no committed checkpoint: nothing is known to be garbage")
        return
    table = Table(title=f"unreferenced files in {directory} (latest checkpoint "
                        f"{report.latest_checkpoint_id})")
    table.add_column("file")
    table.add_column("size", justify="right")
    for entry in report.to_json()["files"]:
        table.add_row(entry["path"], human_bytes(entry["size"]))
    out.print(table)
    verb = "deleted" if apply else "found"
    out.print(f"{verb} {deleted if apply else len(report.files)} files, "
              f"{human_bytes(report.bytes)}"
              + ("" if apply or not report.files else "; run with --apply to delete them"))


def _register_commands() -> None:
    """Commands that live in their own modules: ``state`` (the state processor API),
    ``storage`` and ``checkpoints transfer`` (object storage), ``chaos`` (the soak)."""
    from keyedstate.cli import chaos, remote, state

    for module in (state, remote, chaos):
        module.register(main)


_register_commands()
