"""``keyedstate state read``: the state of any checkpoint or savepoint, without Spark.

Reading goes through the core (:func:`keyedstate.processor.canonical.read_range_tables`): one
key-group range at a time, so memory stays bounded by one range's rows (native snapshots are
restored into a temporary backend, canonical ones read from their Parquet files).
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
import math
import os
import time
from typing import Any, Iterator

import click
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from keyedstate.checkpoint.resolve import ResolvedSnapshot, resolve_snapshot
from keyedstate.cli.output import (
    echo_json,
    json_option,
    parse_storage_options,
    reported_errors,
    stderr,
    storage_options_option,
)
from keyedstate.errors import OutputPathError, StateNotFoundError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.processor.canonical import (
    key_columns_of,
    key_types_of,
    read_range_tables,
    snapshot_states,
)
from keyedstate.processor.canonical.schema import (
    MAP_KEY,
    NAMESPACE,
    PICKLE,
    VALUE,
    state_schema,
)
from keyedstate.serde import PickleSerializer, deserialize_namespace
from keyedstate.storage.handles import StateMetaInfo

#: Rows shown when neither ``--limit`` nor ``--out`` is given.
DEFAULT_LIMIT = 20


def _ranges(snapshot: ResolvedSnapshot) -> list[KeyGroupRange]:
    metadata = snapshot.metadata
    n = max(1, metadata.parallelism)
    return [KeyGroupRange.of_operator(metadata.max_parallelism, n, i) for i in range(n)]


def iter_state_rows(snapshot: ResolvedSnapshot, state: str, *, now_ms: int
                    ) -> Iterator[dict[str, Any]]:
    """The rows of ``state`` as dicts of Python values: namespaces decoded, pickled values and
    map keys unpickled (pickle runs code: read only snapshots your own jobs wrote)."""
    meta = snapshot_states(snapshot.metadata).get(state)
    for rng in _ranges(snapshot):
        for table in read_range_tables(snapshot, rng, state, now_ms=now_ms):
            for row in table.to_pylist():
                yield _decoded(row, meta)


def _decoded(row: dict[str, Any], meta: StateMetaInfo | None) -> dict[str, Any]:
    row[NAMESPACE] = deserialize_namespace(row[NAMESPACE])
    unpickle = PickleSerializer().deserialize
    if meta is not None and meta.value_type == PICKLE and row.get(VALUE) is not None:
        row[VALUE] = unpickle(row[VALUE])
    if meta is not None and meta.user_key_type == PICKLE and row.get(MAP_KEY) is not None:
        row[MAP_KEY] = unpickle(row[MAP_KEY])
    return row


def write_state_parquet(snapshot: ResolvedSnapshot, state: str, out: str, *, now_ms: int,
                        progress: Any = None) -> tuple[list[str], int]:
    """Write ``state``'s canonical rows to ``out/part-<i>.parquet`` (one file per key-group
    range with rows); returns the files and the row count. ``out`` must be new or empty
    (:func:`check_out_dir`); ``state`` must be one of the snapshot's (else
    :class:`StateNotFoundError`, before anything is written)."""
    check_out_dir(out)
    if state not in snapshot_states(snapshot.metadata):
        raise StateNotFoundError(
            f"{snapshot.storage.url_of(snapshot.metadata_path)} holds no state {state!r}; its "
            f"states: {', '.join(sorted(snapshot_states(snapshot.metadata))) or 'none'}")
    os.makedirs(out, exist_ok=True)
    files: list[str] = []
    rows = 0
    for i, rng in enumerate(_ranges(snapshot)):
        writer: pq.ParquetWriter | None = None
        path = os.path.join(out, f"part-{i:05d}.parquet")
        for table in read_range_tables(snapshot, rng, state, now_ms=now_ms):
            if table.num_rows == 0:
                continue
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
            rows += table.num_rows
        if writer is not None:
            writer.close()
            files.append(path)
        if progress is not None:
            progress()
    return files, rows


def check_out_dir(out: str) -> None:
    """Refuse an ``--out`` that is a file or a non-empty directory (:class:`OutputPathError`):
    the Parquet files go into a directory of their own."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputPathError(f"--out {out} is a file; name a new or empty directory")
    if os.path.isdir(out) and os.listdir(out):
        raise OutputPathError(f"--out {out} is not empty; name a new or empty directory")


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN or infinity
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (_dt.datetime, _dt.date)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def _cell(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(_jsonable(value))
    if isinstance(value, (_dt.datetime, _dt.date)):
        return value.isoformat()
    return repr(value) if isinstance(value, bytes) else str(value)


@click.group("state")
def state_group() -> None:
    """Read the keyed state of a checkpoint or savepoint (no Spark needed)."""


@state_group.command("read")
@click.argument("path")
@click.option("--state", "name", required=True, help="The state to read.")
@click.option("--limit", type=click.IntRange(min=0), default=None,
              help=f"Show at most N rows (default {DEFAULT_LIMIT}).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Write every row as Parquet files into this (new or empty) directory.")
@json_option("Print JSON instead of a table.")
@storage_options_option("fsspec options of PATH as a JSON object.")
def read(path: str, name: str, limit: int | None, out: str | None, as_json: bool,
         storage_options: str | None) -> None:
    """Read state NAME of the snapshot at PATH: a checkpoint directory (its latest
    checkpoint), a chk-N folder, a savepoint folder or a _metadata file; native or
    canonical. One row per value, map entry or list element; TTL-expired entries are
    left out."""
    if limit is not None and out is not None:
        raise click.UsageError("--limit and --out exclude each other")
    now = time.time_ns() // 1_000_000
    options = parse_storage_options(storage_options)
    with reported_errors():
        if out is not None:
            check_out_dir(out)  # before reading anything: the user can act at once
        snapshot = resolve_snapshot(path, options)
        if out is not None:
            ranges = len(_ranges(snapshot))
            with Progress(console=stderr, transient=True) as bar:
                task = bar.add_task(f"reading {name}", total=ranges)
                files, rows = write_state_parquet(snapshot, name, out, now_ms=now,
                                                  progress=lambda: bar.advance(task))
            summary = {"state": name, "rows": rows, "files": files}
            if as_json:
                echo_json(summary)
            else:
                stderr.print(f"wrote {rows:,} rows of state {name!r} to {len(files)} "
                             f"Parquet files in {out}")
            return
        wanted = DEFAULT_LIMIT if limit is None else limit
        rows_out: list[dict[str, Any]] = []
        if wanted:
            for row in iter_state_rows(snapshot, name, now_ms=now):
                rows_out.append(row)
                if len(rows_out) >= wanted:
                    break
    if as_json:
        echo_json([_jsonable(r) for r in rows_out])
        return
    meta = snapshot_states(snapshot.metadata)[name]
    table = Table(title=f"state {name!r} ({meta.kind}, {meta.value_type}"
                        f"{', TTL' if meta.ttl_ms is not None else ''}): "
                        f"first {len(rows_out)} rows")
    columns = list(rows_out[0]) if rows_out else state_schema(
        meta, key_columns_of(snapshot.metadata), key_types_of(snapshot.metadata)).names
    for column in columns:
        table.add_column(column, justify="right" if column == "key_group" else "left")
    for row in rows_out:
        table.add_row(*(_cell(row[c]) for c in columns))
    Console().print(table)


__all__ = ["iter_state_rows", "state_group", "write_state_parquet"]
