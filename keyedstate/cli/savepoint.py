"""``keyedstate savepoint create``: a user-owned, self-contained snapshot of a retained
checkpoint, native (the backend's files, duplicated) or canonical (Parquet per state)."""

from __future__ import annotations

import click
from rich.console import Console

from keyedstate.cli.output import (
    echo_json,
    json_option,
    parse_storage_options,
    reported_errors,
    stderr,
    storage_options_option,
)


@click.group()
def savepoint() -> None:
    """Create savepoints (user-owned, self-contained snapshots)."""


@savepoint.command("create")
@click.argument("checkpoint_dir")
@click.argument("target")
@click.option("--format", "fmt", type=click.Choice(["native", "canonical"]), default="native",
              show_default=True,
              help="native: the backend's files, duplicated; canonical: Parquet per state, "
                   "readable by any backend and tool.")
@json_option()
@storage_options_option()
def savepoint_create(checkpoint_dir: str, target: str, fmt: str, as_json: bool,
                     storage_options: str | None) -> None:
    """Write a savepoint of a retained checkpoint to TARGET. CHECKPOINT_DIR is a job's
    checkpoint directory (its latest checkpoint), a chk-N folder, or a savepoint. A Spark
    job's savepoint carries its source positions and any output of its batch the sinks had
    not committed (a job restored from it commits that output first).

    TARGET must be new or an empty directory, outside CHECKPOINT_DIR; anything else is
    refused before a file is written. The source's files are verified first (on a local disk
    against their checksums, on an object store their sizes); if the command fails, it
    deletes what it wrote under TARGET (and TARGET, if it created it)."""
    import time

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from keyedstate.checkpoint.resolve import resolve_snapshot
    from keyedstate.checkpoint.savepoint import write_native_savepoint
    from keyedstate.spark.carry import carry

    options = parse_storage_options(storage_options)
    started = time.perf_counter()
    with reported_errors():
        source = resolve_snapshot(checkpoint_dir, options)
        attach = carry(source, options)
        if fmt == "native":
            with Progress(TextColumn("verifying, then duplicating files"), BarColumn(), DownloadColumn(),
                          console=stderr, transient=True) as bar:
                task = bar.add_task("files", total=None)
                url = write_native_savepoint(
                    source, target, options, attach=attach,
                    progress=lambda done, total: bar.update(task, completed=done, total=total))
        else:
            from keyedstate.processor.canonical import write_canonical_savepoint

            with stderr.status("writing a canonical savepoint (Parquet per state)"):
                url = write_canonical_savepoint(source, target, options, attach=attach)
    result = {"savepoint": url, "format": fmt, "source": source.storage.url_of(
        source.metadata_path), "seconds": round(time.perf_counter() - started, 3)}
    if as_json:
        echo_json(result)
    else:
        Console().print(f"{fmt} savepoint of {result['source']} written: {url}")
