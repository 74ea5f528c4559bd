"""The layout of canonical savepoints: names, ``_metadata`` helpers, the Parquet file writer.

Shared by the core writer, restore and reads (:mod:`keyedstate.processor.canonical`) and the
Spark writer (:mod:`keyedstate.spark.processor`); the columns are in
:mod:`keyedstate.processor.canonical.schema`, the reference is ``docs/canonical-format.md``.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from typing import Any, Iterable, Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from keyedstate.checkpoint.properties import SAVEPOINT_OF, portable_properties
from keyedstate.errors import ConfigurationError, CorruptCheckpointError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.processor.canonical.schema import (
    CANONICAL_FORMAT_VERSION,
    default_key_columns,
)
from keyedstate.serde import type_from_string
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import (
    CheckpointMetadata,
    KeyedStateHandle,
    SnapshotFormat,
    SnapshotKind,
    StateMetaInfo,
    StreamHandle,
)

#: The handles' backend name: Parquet files, restored into any backend.
CANONICAL_BACKEND = "canonical"
STATES_DIR = "states"
TIMERS_DIR = "timers"
#: ``KeyedStateHandle.private`` name of a split's timer file (state names never start with _).
TIMERS_ENTRY = "_timers"
#: ``_metadata`` properties.
PROP_KEY_COLUMNS = "key_columns"
PROP_FORMAT_VERSION = "canonical.format-version"
PROP_SOURCE = "canonical.source"
PROP_SOURCE_BACKEND = "canonical.source-backend"
#: The prefix of the canonical format's own properties (not carried from a canonical source).
CANONICAL_PREFIX = "canonical."
#: Rows per Parquet row group, and per chunk converted in memory.
ROW_GROUP_ROWS = 65_536


def row_groups(items: Iterable[Any]) -> Iterator[list[Any]]:
    """``items`` in lists of at most :data:`ROW_GROUP_ROWS`: one Parquet row group each."""
    group: list[Any] = []
    for item in items:
        group.append(item)
        if len(group) == ROW_GROUP_ROWS:
            yield group
            group = []
    if group:
        yield group


# --------------------------------------------------------------------------------------------
# what a snapshot holds
# --------------------------------------------------------------------------------------------


def snapshot_states(metadata: CheckpointMetadata) -> dict[str, StateMetaInfo]:
    """Every state of a snapshot (union over its handles), by name; a state recorded with two
    different kinds or types raises :class:`CorruptCheckpointError`."""
    states: dict[str, StateMetaInfo] = {}
    for handle in metadata.handles:
        for meta in handle.states:
            known = states.setdefault(meta.name, meta)
            if (known.kind, known.value_type, known.user_key_type, known.ttl_ms is None) != \
                    (meta.kind, meta.value_type, meta.user_key_type, meta.ttl_ms is None):
                raise CorruptCheckpointError(
                    f"the snapshot records state {meta.name!r} as {known.kind} of "
                    f"{known.value_type} and as {meta.kind} of {meta.value_type}; its _metadata "
                    f"is inconsistent. Use another checkpoint or savepoint"
                )
    return dict(sorted(states.items()))


def key_types_of(metadata: CheckpointMetadata) -> list[pa.DataType]:
    """The key column types a snapshot records (Spark DDL or keyedstate type strings)."""
    if not metadata.key_types:
        raise ConfigurationError(
            "the snapshot records no key types (no key was ever processed); there is no keyed "
            "state to read"
        )
    return [type_from_string(t) for t in metadata.key_types]


def key_columns_of(metadata: CheckpointMetadata,
                   override: Sequence[str] | None = None) -> list[str]:
    """Key column names: ``override``, else the names the snapshot records (the Spark job's
    key columns), else ``key``, ``key_1`` ..."""
    if override is not None:
        return list(override)
    recorded = metadata.properties.get(PROP_KEY_COLUMNS)
    if recorded:
        names = json.loads(recorded)
        if isinstance(names, list) and len(names) == len(metadata.key_types):
            return [str(n) for n in names]
    return default_key_columns(len(metadata.key_types))


def state_dir_names(names: Iterable[str]) -> dict[str, str]:
    """A directory name per state: the name with characters other than letters, digits, ``_``,
    ``-`` and ``.`` replaced by ``_``, made unique with a numeric suffix."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for name in sorted(names):
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        if not base.strip("."):
            base = "state"
        candidate, n = base, 1
        while candidate in taken:
            candidate, n = f"{base}-{n}", n + 1
        taken.add(candidate)
        out[name] = candidate
    return out


def split_file_name(key_group_range: KeyGroupRange) -> str:
    """``kg-<start>-<end>-<unique>.parquet``: a retried writer never replaces a file."""
    return (f"kg-{key_group_range.start:05d}-{key_group_range.end:05d}-"
            f"{uuid.uuid4().hex[:12]}.parquet")


# --------------------------------------------------------------------------------------------
# writing files
# --------------------------------------------------------------------------------------------


class ParquetFileWriter:
    """Writes one canonical Parquet file through a local temporary file, in row groups, then
    uploads it; :meth:`close` returns its :class:`StreamHandle` (None if no row was written:
    no file)."""

    def __init__(self, storage: CheckpointStorage, relative: str, schema: pa.Schema,
                 work_dir: str) -> None:
        self.storage = storage
        self.relative = relative
        self.schema = schema
        self.local = os.path.join(work_dir, uuid.uuid4().hex + ".parquet")
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.local, self.schema)
        self._writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
        self.rows += table.num_rows

    def close(self) -> StreamHandle | None:
        if self._writer is None:
            return None
        self._writer.close()
        try:
            return self.storage.upload(self.local, self.relative)
        finally:
            os.remove(self.local)


def remove_unreferenced(storage: CheckpointStorage, referenced: Iterable[str]) -> list[str]:
    """Delete files under ``states/`` and ``timers/`` of a savepoint being written that it does
    not reference (a failed Spark task attempt's: the target was empty when the write began,
    so nothing else is there), so a reader of the directory sees exactly the savepoint's
    files; call it before ``_metadata`` is written."""
    keep = set(referenced)
    doomed = [p for d in (STATES_DIR, TIMERS_DIR) for p in storage.list_files(d)
              if p not in keep]
    storage.delete(doomed)
    return doomed


def canonical_handle(index: int, key_group_range: KeyGroupRange, checkpoint_id: int,
                     states: Iterable[StateMetaInfo], files: Mapping[str, StreamHandle]
                     ) -> KeyedStateHandle:
    """The handle of one split: every state's meta info (states without rows in the split
    too: a restore still knows them), and the split's files."""
    size = sum(f.size for f in files.values())
    return KeyedStateHandle(
        backend=CANONICAL_BACKEND, subtask_index=index, key_group_start=key_group_range.start,
        key_group_end=key_group_range.end, checkpoint_id=checkpoint_id, states=list(states),
        shared={}, private=dict(sorted(files.items())), full_size=size, incremental_size=size)


def canonical_metadata(*, checkpoint_id: int, max_parallelism: int, key_types: Sequence[str],
                       key_columns: Sequence[str], handles: Sequence[KeyedStateHandle],
                       properties: Mapping[str, str] | None = None) -> CheckpointMetadata:
    """The ``_metadata`` of a canonical savepoint (its ``parallelism`` is the split count)."""
    props = {k: v for k, v in (properties or {}).items()}
    props[PROP_KEY_COLUMNS] = json.dumps(list(key_columns))
    props[PROP_FORMAT_VERSION] = str(CANONICAL_FORMAT_VERSION)
    return CheckpointMetadata(
        checkpoint_id=checkpoint_id, timestamp_ms=time.time_ns() // 1_000_000,
        backend=CANONICAL_BACKEND, parallelism=len(handles), max_parallelism=max_parallelism,
        key_types=list(key_types), handles=list(handles), kind=SnapshotKind.SAVEPOINT,
        format=SnapshotFormat.CANONICAL, properties=props)


def carried_properties(properties: Mapping[str, str]) -> dict[str, str]:
    """What a canonical savepoint keeps of its source's properties: what any savepoint carries
    (:func:`~keyedstate.checkpoint.properties.portable_properties`: the job's batch, watermark,
    lineage and a runtime's own keys such as Spark's offset location), less the bookkeeping of
    the source's own format (``canonical.*``, the savepoint it was duplicated from)."""
    return {k: v for k, v in portable_properties(properties).items()
            if not k.startswith(CANONICAL_PREFIX) and k != SAVEPOINT_OF}
