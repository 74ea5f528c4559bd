"""``keyedstate gc``: list, and with ``--apply`` delete, the files under a job's checkpoint
directory that no committed checkpoint references and no work in flight may need
(:func:`keyedstate.processor.inspection.find_garbage` decides; safe on a running job)."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from keyedstate.cli.output import (
    echo_json,
    human_bytes,
    json_option,
    parse_storage_options,
    reported_errors,
    stderr,
    storage_options_option,
)


@click.command()
@click.argument("directory")
@click.option("--apply", "apply", is_flag=True,
              help="Delete the files listed (without it, gc only lists them).")
@json_option()
@storage_options_option()
def gc(directory: str, apply: bool, as_json: bool, storage_options: str | None) -> None:
    """List files under a job's checkpoint DIRECTORY that no committed checkpoint references
    (and no work in flight may need); delete them with --apply. Safe on a running job. A path
    that is not a job's checkpoint directory (missing, a file, a savepoint) is an error."""
    from rich.progress import Progress

    from keyedstate.processor.inspection import delete_garbage, find_garbage, job_directory

    with reported_errors():
        # A path that is no job's checkpoint directory (missing, a file, its parent) is an
        # error, not "nothing is known to be garbage".
        storage = job_directory(directory, parse_storage_options(storage_options),
                                what="nothing to collect")
        report = find_garbage(storage)
        deleted = 0
        if apply and report.files:
            with Progress(console=stderr, transient=True) as bar:
                task = bar.add_task("deleting", total=len(report.files))
                deleted = delete_garbage(
                    report, progress=lambda done, total: bar.update(task, completed=done))
    if as_json:
        echo_json({**report.to_json(), "deleted": deleted, "applied": apply})
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
