"""``keyedstate storage check`` and ``keyedstate checkpoints transfer``: object storage from the
command line (``docs/object-storage.md``).

``register(main)`` adds:

- ``keyedstate storage check URL``: can a job use this checkpoint location? (credentials,
  bucket, write and delete permission; whether inlining, merging and the file cache apply);
- ``keyedstate checkpoints transfer PATH``: what producing each checkpoint (or a savepoint)
  moved: bytes uploaded, downloaded, duplicated server-side, inlined; objects and cache hits;
- the transfer figures under the text output of ``keyedstate checkpoints show`` (its
  ``--json`` output has them as ``transfer``, from :func:`keyedstate.processor.inspection.show`).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import click
from rich.console import Console
from rich.table import Table

from keyedstate.cli.output import human_bytes, parse_storage_options

_err = Console(stderr=True)


_ROWS = (("uploaded", "uploaded_bytes", "uploaded_objects"),
         ("downloaded", "downloaded_bytes", "downloaded_objects"),
         ("duplicated server-side", "duplicated_bytes", "duplicated_objects"),
         ("inlined in _metadata", "inlined_bytes", "inlined_files"),
         ("from executors' file caches", "cache_hit_bytes", "cache_hit_files"))


def transfer_table(summary: dict[str, Any], title: str) -> Table:
    """A table of :func:`~keyedstate.processor.inspection.transfer_summary`: one row per
    kind of transfer, for the snapshot and for the restores before it."""
    table = Table(title=title)
    for column in ("transfer", "snapshot", "restore"):
        table.add_column(column, justify="left" if column == "transfer" else "right")
    for label, size_key, count_key in _ROWS:
        cells = []
        for part in ("snapshot", "restore"):
            size, count = summary[part][size_key], summary[part][count_key]
            cells.append(f"{human_bytes(size)} ({count})" if size or count else "-")
        table.add_row(label, *cells)
    retries = summary["snapshot"]["retries"] + summary["restore"]["retries"]
    table.caption = (f"{summary['objects']} objects, {summary['merged_objects']} merged, "
                     f"{summary['inline_files']} inline files; {retries} retried calls")
    return table


def register(main: click.Group) -> None:
    """Add ``storage check`` and ``checkpoints transfer`` to the CLI, and the transfer table
    to ``checkpoints show``'s text output. Idempotent."""
    if "storage" in main.commands:
        return

    @main.group()
    def storage() -> None:
        """Check checkpoint storage (object stores, local disks)."""

    @storage.command("check")
    @click.argument("url")
    @click.option("--storage-options", "storage_options", default=None, metavar="JSON",
                  help="fsspec options as a JSON object (credentials, endpoint).")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    def check(url: str, storage_options: str | None, as_json: bool) -> None:
        """Check that a job can checkpoint to URL: the location exists, the credentials are
        accepted, an object can be written and deleted (a probe, removed again)."""
        from keyedstate.errors import KeyedStateError
        from keyedstate.storage.checkpoint_storage import CheckpointStorage
        from keyedstate.storage.filesystem import is_object_store

        target = CheckpointStorage(url, parse_storage_options(storage_options))
        try:
            target.check_access()
            result = {"url": url, "access": "ok", "local_disk": target.is_local,
                      "object_store": is_object_store(target.fs),
                      "inline_threshold": target.inline_threshold,
                      "merge_file_size": target.merge_file_size,
                      "file_cache": not target.is_local and target.transfer.cache_bytes > 0,
                      "retried_calls": target.stats.retries}
        except (KeyedStateError, OSError) as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
        if as_json:
            click.echo(json.dumps(result, indent=2))
            return
        table = Table(title=f"storage {url}", show_header=False)
        table.add_column("field")
        table.add_column("value")
        for key, value in result.items():
            table.add_row(key, str(value))
        Console().print(table)

    checkpoints = main.commands.get("checkpoints")
    if not isinstance(checkpoints, click.Group):
        return

    @checkpoints.command("transfer")
    @click.argument("path")
    @click.option("--storage-options", "storage_options", default=None, metavar="JSON",
                  help="fsspec options as a JSON object.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
    def transfer(path: str, storage_options: str | None, as_json: bool) -> None:
        """Bytes uploaded, downloaded, duplicated server-side and inlined by each retained
        checkpoint of a job's checkpoint directory PATH (or one chk-N, or a savepoint), and
        by the restores before them. Reads only the _metadata files."""
        from keyedstate.checkpoint.resolve import resolve_snapshot
        from keyedstate.errors import KeyedStateError
        from keyedstate.processor.inspection import transfer_summary
        from keyedstate.storage.checkpoint_storage import CheckpointStorage
        from keyedstate.storage.layout import METADATA_FILE

        options = parse_storage_options(storage_options)
        try:
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
        except (KeyedStateError, OSError) as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
        if as_json:
            click.echo(json.dumps(out, indent=2))
            return
        console = Console()
        for entry in out:
            console.print(transfer_table(entry, f"{entry['kind']} {entry['id']}: transfers"))

    show = checkpoints.commands.get("show")
    if show is None or show.callback is None or getattr(show, "_with_transfer", False):
        return
    original: Callable[..., Any] = show.callback

    def show_with_transfer(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if not kwargs.get("as_json"):
            from keyedstate.checkpoint.resolve import resolve_snapshot
            from keyedstate.processor.inspection import transfer_summary

            try:
                snapshot = resolve_snapshot(kwargs["path"],
                                            parse_storage_options(kwargs.get("storage_options")))
            except Exception:  # the original command reported what was wrong
                return result
            Console().print(transfer_table(transfer_summary(snapshot.metadata),
                                           "transfers (bytes, objects)"))
        return result

    show.callback = show_with_transfer
    show._with_transfer = True  # type: ignore[attr-defined]


__all__ = ["register", "transfer_table"]
