"""``keyedstate storage check``: can a job use this checkpoint location? (credentials, bucket,
write and delete permission; whether inlining, merging and the file cache apply;
``docs/object-storage.md``)."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from keyedstate.cli.output import (
    echo_json,
    json_option,
    parse_storage_options,
    reported_errors,
    storage_options_option,
)


@click.group()
def storage() -> None:
    """Check checkpoint storage (object stores, local disks)."""


@storage.command("check")
@click.argument("url")
@storage_options_option("fsspec options as a JSON object (credentials, endpoint).")
@json_option("Print JSON.")
def check(url: str, storage_options: str | None, as_json: bool) -> None:
    """Check that a job can checkpoint to URL: the location exists, the credentials are
    accepted, an object can be written and deleted (a probe, removed again). On a local disk
    URL must be an existing directory (nothing is written there); on an object store its
    bucket must exist (a prefix needs no creating)."""
    import os

    from keyedstate.errors import StorageLocationError
    from keyedstate.storage.checkpoint_storage import CheckpointStorage
    from keyedstate.storage.filesystem import is_object_store

    with reported_errors():
        target = CheckpointStorage(url, parse_storage_options(storage_options))
        parent = target.root
        while (target.is_local and not os.path.exists(parent)
               and os.path.dirname(parent) != parent):
            parent = os.path.dirname(parent)
        if target.is_local and parent != target.root and os.path.isdir(parent):
            # A job would create it, but "ok" for a path that is not there misleads (a typo
            # checks fine); the nearest existing parent is what a job would write into. (A
            # file in the way is check_access's StorageLocationError.)
            raise StorageLocationError(
                f"{url} does not exist (its nearest existing parent is {parent}); create it "
                f"first, or check the parent a job would create it in: keyedstate storage "
                f"check {parent}")
        target.check_access()
        result = {"url": url, "access": "ok", "local_disk": target.is_local,
                  "object_store": is_object_store(target.fs),
                  "inline_threshold": target.inline_threshold,
                  "merge_file_size": target.merge_file_size,
                  "file_cache": not target.is_local and target.transfer.cache_bytes > 0,
                  "retried_calls": target.stats.retries}
    if as_json:
        echo_json(result)
        return
    table = Table(title=f"storage {url}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    for key, value in result.items():
        table.add_row(key, str(value))
    Console().print(table)
