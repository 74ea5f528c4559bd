"""``keyedstate checkpoints list|show|transfer|report``: look into a job's checkpoints and
savepoints (read only; :mod:`keyedstate.processor.inspection`, :mod:`keyedstate.processor.report`
and its page, :mod:`keyedstate.cli.report_page`)."""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Mapping

import click
import msgspec
from rich.console import Console
from rich.table import Table

from keyedstate.checkpoint import properties as props
from keyedstate.checkpoint.stats import CompletedCheckpointStats, SubtaskStateStats
from keyedstate.cli.output import (
    echo_json,
    human_bytes,
    json_option,
    parse_storage_options,
    partial_result,
    reported_errors,
    stderr,
    storage_options_option,
)
from keyedstate.errors import OutputPathError
from keyedstate.storage.transfer import PROP_PREFIX, RESTORE_PREFIX

#: The rows of :func:`transfer_table`: label, bytes key, count key of a transfer summary.
_TRANSFER_ROWS = (("uploaded", "uploaded_bytes", "uploaded_objects"),
                  ("downloaded", "downloaded_bytes", "downloaded_objects"),
                  ("duplicated server-side", "duplicated_bytes", "duplicated_objects"),
                  ("inlined in _metadata", "inlined_bytes", "inlined_files"),
                  ("from executors' file caches", "cache_hit_bytes", "cache_hit_files"))


@click.group()
def checkpoints() -> None:
    """Inspect a job's checkpoints and savepoints."""


@checkpoints.command("list")
@click.argument("directory")
@json_option()
@storage_options_option()
def checkpoints_list(directory: str, as_json: bool, storage_options: str | None) -> None:
    """List the retained checkpoints of a job's checkpoint DIRECTORY (any fsspec URL; for a
    savepoint or chk-N folder or a _metadata file, that snapshot). A checkpoint that can't be
    read is listed with its error, and the command then exits with status 1."""
    from keyedstate.processor.inspection import list_checkpoints

    with reported_errors():
        listing = list_checkpoints(directory, parse_storage_options(storage_options))
    if as_json:
        echo_json(listing)
    else:
        _print_listing(directory, listing)
    unreadable = [c for c in listing if c["error"] is not None]
    if unreadable:
        # The listing is complete (each unreadable entry says why); the status says it is
        # not all well, for a script that checks only that.
        raise partial_result(
            f"{len(unreadable)} of {len(listing)} checkpoints in {directory} can't be read: "
            + "; ".join(str(c["error"]) for c in unreadable)
            + " (keyedstate checkpoints show names the damage; a job's recovery sets a corrupt "
              "checkpoint aside and starts from the latest readable one)")


def _print_listing(directory: str, listing: list[dict[str, Any]]) -> None:
    table = Table(title=f"checkpoints in {directory}")
    for column in ("id", "kind", "batch", "p", "max p", "backend", "incremental", "full",
                   "files"):
        table.add_column(column, justify="left" if column in ("kind", "backend") else "right",
                         no_wrap=True)
    for c in listing:
        if c["error"] is not None:
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
@json_option()
@click.option("--no-state-sizes", is_flag=True,
              help="Skip computing per-state sizes (they read the snapshot's files).")
@storage_options_option()
def checkpoints_show(path: str, as_json: bool, no_state_sizes: bool,
                     storage_options: str | None) -> None:
    """Show one checkpoint or savepoint: PATH is a checkpoint directory (its latest
    checkpoint), a chk-N folder, a savepoint folder or a _metadata file."""
    from keyedstate.processor.inspection import show

    with reported_errors():
        with stderr.status("reading the snapshot"):
            detail = show(path, parse_storage_options(storage_options),
                          state_sizes=not no_state_sizes)
    if as_json:
        echo_json(show_json(detail))
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
    out.print(transfer_table(detail["transfer"], "transfers (bytes, objects)"))


@checkpoints.command("transfer")
@click.argument("path")
@storage_options_option("fsspec options as a JSON object.")
@json_option()
def checkpoints_transfer(path: str, storage_options: str | None, as_json: bool) -> None:
    """Bytes uploaded, downloaded, duplicated server-side and inlined by each retained
    checkpoint of a job's checkpoint directory PATH (or one chk-N, or a savepoint), and
    by the restores before them. Reads only the _metadata files."""
    from keyedstate.checkpoint.resolve import resolve_snapshot
    from keyedstate.processor.inspection import transfer_summary
    from keyedstate.storage.checkpoint_storage import CheckpointStorage
    from keyedstate.storage.layout import METADATA_FILE

    options = parse_storage_options(storage_options)
    with reported_errors():
        root = CheckpointStorage(path, options)
        ids = [] if root.exists(METADATA_FILE) else root.checkpoint_ids()
        targets = [f"{path.rstrip('/')}/chk-{i}" for i in ids] or [path]
        out = []
        for target in targets:
            snapshot = resolve_snapshot(target, options)
            out.append({"id": snapshot.metadata.checkpoint_id,
                        "kind": str(snapshot.metadata.kind),
                        "metadata": snapshot.storage.url_of(snapshot.metadata_path),
                        **transfer_summary(snapshot.metadata)})
    if as_json:
        echo_json(out)
        return
    console = Console()
    for entry in out:
        console.print(transfer_table(entry, f"{entry['kind']} {entry['id']}: transfers"))


@checkpoints.command("report")
@click.argument("directory")
@click.option("--out", "out", default="checkpoint-report.html", show_default=True,
              metavar="FILE", help="Where to write the page: a new local file, or a page this "
                                   "command wrote before (replaced); anything else is refused.")
@storage_options_option()
def checkpoints_report(directory: str, out: str, storage_options: str | None) -> None:
    """Write the checkpoint history of a job's checkpoint DIRECTORY (or of one savepoint,
    chk-N or _metadata) as one self-contained HTML page: the job's configuration, per
    checkpoint its durations, sizes, transfers and restores, plots over time, sortable tables.
    Reads only the _metadata files; the page loads nothing from anywhere. Prints the page's
    path."""
    from keyedstate.cli.report_page import render_report
    from keyedstate.processor.report import read_report

    with reported_errors():
        check_report_out(out)  # before reading anything: the user can act at once
        with stderr.status("reading the checkpoints"):
            report = read_report(directory, parse_storage_options(storage_options))
        write_report_page(out, render_report(report))
    stderr.print(f"{len(report.history)} checkpoints in the history, {len(report.retained)} "
                 f"retained" + (f", {len(report.unreadable)} unreadable"
                                if report.unreadable else ""), highlight=False)
    click.echo(os.path.abspath(out))
    if report.unreadable:
        raise partial_result(
            f"{len(report.unreadable)} retained checkpoints of {directory} can't be read "
            f"(the page lists them): " + "; ".join(u.error for u in report.unreadable))


#: What the first bytes of a page :func:`render_report` wrote hold (its generator tag): the
#: one kind of existing file ``checkpoints report --out`` replaces.
REPORT_PAGE_MARK = b'<meta name="generator" content="keyedstate'


def check_report_out(out: str) -> None:
    """Refuse an ``--out`` that holds what ``checkpoints report`` did not write: a directory,
    or a file that is not a report page (:data:`REPORT_PAGE_MARK` in its first 4 KiB). Raises
    :class:`OutputPathError`; a missing parent directory is an ``OSError`` naming it."""
    if os.path.isdir(out):
        raise OutputPathError(f"--out {out} is a directory; name the page's file, e.g. "
                              f"{os.path.join(out, 'checkpoint-report.html')}")
    if os.path.exists(out):
        with open(out, "rb") as f:
            head = f.read(4096)
        if REPORT_PAGE_MARK not in head:
            raise OutputPathError(f"--out {out} exists and is not a checkpoint report page; "
                                  f"keyedstate replaces only its own pages: choose another "
                                  f"file or delete it yourself")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"--out {out}: its directory {parent} does not exist")


def write_report_page(out: str, page: str) -> None:
    """Write ``page`` to ``out`` atomically (a temporary file beside it, then a rename): a
    failure leaves the previous page, or nothing, never half a page."""
    tmp = f"{out}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def transfer_table(summary: dict[str, Any], title: str) -> Table:
    """A table of :func:`~keyedstate.processor.inspection.transfer_summary`: one row per
    kind of transfer, for the snapshot and for the restores before it."""
    table = Table(title=title)
    for column in ("transfer", "snapshot", "restore"):
        table.add_column(column, justify="left" if column == "transfer" else "right")
    for label, size_key, count_key in _TRANSFER_ROWS:
        cells = []
        for part in ("snapshot", "restore"):
            size, count = summary[part][size_key], summary[part][count_key]
            cells.append(f"{human_bytes(size)} ({count})" if size or count else "-")
        table.add_row(label, *cells)
    retries = summary["snapshot"]["retries"] + summary["restore"]["retries"]
    table.caption = (f"{summary['objects']} objects, {summary['merged_objects']} merged, "
                     f"{summary['inline_files']} inline files; {retries} retried calls")
    return table


# -- JSON of ``checkpoints show`` ----------------------------------------------------------------

def _int(value: str) -> int:
    return int(value)


def _bool(value: str) -> bool:
    if value not in ("true", "false"):
        raise ValueError(f"not true or false: {value!r}")
    return value == "true"


def _history(value: str) -> list[dict[str, Any]]:
    rows = msgspec.json.decode(value, type=list[CompletedCheckpointStats])
    return [msgspec.structs.asdict(r) for r in rows]


def _subtask_stats(value: str) -> list[dict[str, Any]]:
    rows = msgspec.json.decode(value, type=list[SubtaskStateStats])
    return [msgspec.structs.asdict(r) for r in rows]


def _json_of(kind: type) -> Callable[[str], Any]:
    def decode(value: str) -> Any:
        return msgspec.json.decode(value, type=kind)
    return decode


#: The properties the checkpoint protocol defines (checkpoint/properties.py) and how each is
#: typed in ``checkpoints show --json``'s ``properties`` (docs/cli.md, "JSON output").
TYPED_PROPERTIES: Mapping[str, Callable[[str], Any]] = {
    props.BATCH_ID: _int,
    props.WATERMARK: _int,
    props.TOKENS: _json_of(list[str]),
    props.STAGED: _json_of(dict[str, list[str]]),
    props.DRAINED: _bool,
    props.RESTORED_FROM: lambda v: v or None,  # "": the lineage started from empty state
    props.JOB_FUNCTION: str,
    props.JOB_CONFIG: _json_of(dict[str, Any]),
    props.CHECKPOINT_HISTORY: _history,
    props.SUBTASK_STATS: _subtask_stats,
    props.CLAIMED_FROM: str,
    props.RESTORE_MODE: str,
    props.SAVEPOINT_OF: str,
    props.CONTEXT: _json_of(list[str]),
    "key_columns": _json_of(list[str]),
}


def typed_properties(properties: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """``properties`` split in two for JSON: the typed ones (:data:`TYPED_PROPERTIES`, and
    transfer counts as integers) and the rest, verbatim strings (a backend's or a runtime's
    own properties, whose format is theirs). A typed property whose value can't be decoded is
    None among the typed ones and keeps its string among the rest."""
    typed: dict[str, Any] = {}
    other: dict[str, str] = {}
    for key, value in sorted(properties.items()):
        decode = TYPED_PROPERTIES.get(key)
        if decode is None and key.startswith((PROP_PREFIX, RESTORE_PREFIX + PROP_PREFIX)):
            decode = _int
        if decode is None:
            other[key] = value
            continue
        try:
            typed[key] = decode(value)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
            typed[key] = None
            other[key] = value
    return typed, other


def show_json(detail: dict[str, Any]) -> dict[str, Any]:
    """:func:`~keyedstate.processor.inspection.show`'s object as ``checkpoints show --json``
    writes it: ``properties`` typed and ``other_properties`` verbatim
    (:func:`typed_properties`), at the top and per subtask."""
    out = dict(detail)
    out["properties"], out["other_properties"] = typed_properties(detail["properties"])
    subtasks = []
    for subtask in detail["subtasks"]:
        typed, other = typed_properties(subtask["properties"])
        subtasks.append({**subtask, "properties": typed, "other_properties": other})
    out["subtasks"] = subtasks
    return out
