"""Writing a canonical savepoint: any snapshot, one key-group range (split) at a time, into
one Parquet file per state and split plus one for timers (:func:`write_canonical_savepoint`).
The format is described in :mod:`keyedstate.processor.canonical`."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, Callable, Mapping, Sequence

import pyarrow as pa

from keyedstate.backends.base.backend import (
    KeyedStateBackend,
)
from keyedstate.backends.base.working_dirs import worker_dir
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.checkpoint.savepoint import (
    Attach,
    attach_context,
    check_outside_source,
    new_snapshot_target,
)
from keyedstate.keygroups import KeyGroupRange, check_parallelism
from keyedstate.processor.canonical.layout import (
    PROP_SOURCE,
    PROP_SOURCE_BACKEND,
    STATES_DIR,
    TIMERS_DIR,
    TIMERS_ENTRY,
    ParquetFileWriter,
    canonical_handle,
    canonical_metadata,
    carried_properties,
    key_columns_of,
    key_types_of,
    remove_unreferenced,
    row_groups,
    snapshot_states,
    split_file_name,
    state_dir_names,
)
from keyedstate.processor.canonical.read import open_snapshot_range
from keyedstate.processor.canonical.schema import (
    KeyColumns,
    records_table,
    state_schema,
    timer_schema,
    timers_table,
)
from keyedstate.state.descriptors import StateKind
from keyedstate.state.timers import TimeDomain
from keyedstate.state.ttl import SystemTimeProvider, TtlTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import (
    KeyedStateHandle,
    StateMetaInfo,
    StreamHandle,
)
from keyedstate.storage.layout import METADATA_FILE

#: ``progress(splits_done, splits_total)``.
Progress = Callable[[int, int], None]


def write_split(backend: KeyedStateBackend, storage: CheckpointStorage,
                states: Mapping[str, StateMetaInfo], dirs: Mapping[str, str],
                key_columns: Sequence[str], key_types: Sequence[pa.DataType],
                work_dir: str) -> dict[str, StreamHandle]:
    """Write the Parquet files of one split from ``backend`` (holding exactly that split's
    key groups); returns ``{state name or TIMERS_ENTRY: file}`` for the files written."""
    files: dict[str, StreamHandle] = {}
    keys = KeyColumns(backend.key_serializer)
    fname = split_file_name(backend.key_group_range)
    known = {m.name for m in backend.state_meta_infos()}
    for name, meta in states.items():
        if name not in known:
            continue
        schema = state_schema(meta, key_columns, key_types)
        writer = ParquetFileWriter(storage, f"{STATES_DIR}/{dirs[name]}/{fname}", schema,
                                   work_dir)
        positions: dict[tuple[int, bytes, bytes], int] | None = \
            {} if meta.kind == StateKind.LIST else None
        for chunk in row_groups(backend.iter_records(name)):
            writer.write(records_table(chunk, meta, schema, keys, positions))
            if positions is not None:  # keep only the list that may continue in the next chunk
                last = chunk[-1]
                ident = (last.key_group, last.key_bytes, last.namespace_bytes)
                positions = {ident: positions[ident]}
        handle = writer.close()
        if handle is not None:
            files[name] = handle
    schema = timer_schema(key_columns, key_types)
    writer = ParquetFileWriter(storage, f"{TIMERS_DIR}/{fname}", schema, work_dir)
    # Sorted by key group (as state rows), so a restore skips other key groups' row groups.
    timers = sorted(((domain, t) for domain in TimeDomain
                     for t in backend.timer_service.timers(domain)),
                    key=lambda dt: dt[1].key_group)
    for chunk in row_groups(timers):
        writer.write(timers_table(chunk, schema, keys))
    handle = writer.close()
    if handle is not None:
        files[TIMERS_ENTRY] = handle
    return files


def write_canonical_savepoint(source: ResolvedSnapshot, target: str,
                              storage_options: Mapping[str, Any] | None = None, *,
                              splits: int | None = None,
                              key_columns: Sequence[str] | None = None,
                              time_provider: TtlTimeProvider | None = None,
                              local_dir: str | None = None,
                              progress: Progress | None = None,
                              attach: Attach | None = None) -> str:
    """Write a canonical savepoint of ``source`` (any checkpoint or savepoint, native or
    canonical) into the directory ``target``; returns the path or URL of its ``_metadata``.

    ``splits`` key-group ranges get a file each (default: the source's parallelism, so every
    split is one source subtask restored without rescaling); ``key_columns`` names the key
    columns (default: the names the source records, else ``key``, ``key_1`` ...). Entries
    whose TTL ran out by ``time_provider``'s clock (default: wall clock) are left out.

    Step 1. Refuse, before anything is written: a ``target`` inside the source's directory,
        bad key column names, and a ``target`` that is neither new nor empty
        (:func:`~keyedstate.checkpoint.savepoint.check_savepoint_target`).
    Step 2. Per split: restore the source's key groups of the split into a temporary backend
        (the source's own for a native snapshot, heap for a canonical one; files verified as
        they are read) and write one Parquet file per state and one for timers.
    Step 3. Let ``attach`` add the job context it carries, then write ``_metadata``
        atomically: the savepoint exists exactly when this returns. On any failure everything
        written under ``target`` is deleted, and the directories the write created
        (:func:`~keyedstate.checkpoint.savepoint.new_snapshot_target`).
    """
    storage = CheckpointStorage(target, storage_options)
    metadata = source.metadata
    # Step 1. Refusals.
    check_outside_source(source, storage)
    parallelism = splits or metadata.parallelism
    check_parallelism(parallelism, metadata.max_parallelism)
    key_types = key_types_of(metadata)
    names = key_columns_of(metadata, key_columns)
    states = snapshot_states(metadata)
    for meta in states.values():  # checks the names and that every type can be rebuilt
        state_schema(meta, names, key_types)
    dirs = state_dir_names(states)
    handles: list[KeyedStateHandle] = []
    clock = time_provider or SystemTimeProvider()
    with new_snapshot_target(storage):
        work = tempfile.mkdtemp(prefix="keyedstate-canonical-", dir=worker_dir(local_dir))
        try:
            written: list[str] = []
            # Step 2. One split at a time.
            for index in range(parallelism):
                rng = KeyGroupRange.of_operator(metadata.max_parallelism, parallelism, index)
                with open_snapshot_range(source, rng, subtask_index=index, time_provider=clock,
                                         local_dir=work) as backend:
                    files = write_split(backend, storage, states, dirs, names, key_types, work)
                written.extend(f.path for f in files.values())
                handles.append(canonical_handle(index, rng, metadata.checkpoint_id,
                                                states.values(), files))
                if progress is not None:
                    progress(index + 1, parallelism)
            # Step 3. Commit.
            remove_unreferenced(storage, written)
            properties = carried_properties(metadata.properties)
            properties[PROP_SOURCE] = source.storage.url_of(source.metadata_path)
            properties[PROP_SOURCE_BACKEND] = metadata.properties.get(PROP_SOURCE_BACKEND,
                                                                      metadata.backend)
            properties.update(attach_context(attach, storage))
            savepoint = canonical_metadata(
                checkpoint_id=metadata.checkpoint_id, max_parallelism=metadata.max_parallelism,
                key_types=[str(t) for t in key_types], key_columns=names, handles=handles,
                properties=properties)
            return storage.url_of(storage.write_metadata(savepoint, METADATA_FILE))
        finally:
            shutil.rmtree(work, ignore_errors=True)
