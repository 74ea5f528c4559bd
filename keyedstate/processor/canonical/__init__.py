"""Canonical savepoints: the state of a job as Parquet files any backend (and any tool) reads.

Layout of a canonical savepoint directory (reference: ``docs/canonical-format.md``)::

    <target>/_metadata                                   kind savepoint, format canonical
    <target>/states/<state>/kg-<start>-<end>-<id>.parquet   one file per state and split
    <target>/timers/kg-<start>-<end>-<id>.parquet          one file per split with timers

A *split* is a key-group range (subtask ``i`` of ``parallelism`` splits, Flink's formula); a
restore at any parallelism reads only the files of the splits overlapping its range, and only
their row groups of its key groups (rows are sorted by key group). ``_metadata`` has one
:class:`KeyedStateHandle` per split (backend ``canonical``) whose ``private`` files map a state
name (or ``_timers``) to its file, with size and checksum; every path is relative to the
savepoint directory, so it can be moved.

One idea a module: names and ``_metadata`` helpers (:mod:`.layout`), columns (:mod:`.schema`),
writing (:mod:`.write`: :func:`write_canonical_savepoint` converts any snapshot), restoring
(:mod:`.restore`: :func:`restore_canonical` fills an empty keyed backend of any kind, at any
parallelism) and reading one key-group range of any snapshot (:mod:`.read`:
:func:`open_snapshot_range`, :func:`read_range_tables`). No Spark needed. The names below are
the package's interface; import them from here.
"""

from __future__ import annotations

from keyedstate.processor.canonical.layout import (
    CANONICAL_BACKEND,
    PROP_KEY_COLUMNS,
    PROP_SOURCE,
    PROP_SOURCE_BACKEND,
    ROW_GROUP_ROWS,
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
    snapshot_states,
    split_file_name,
    state_dir_names,
)
from keyedstate.processor.canonical.read import (
    open_snapshot_range,
    read_as,
    read_range_tables,
)
from keyedstate.processor.canonical.restore import CanonicalRange, restore_canonical
from keyedstate.processor.canonical.write import Progress, write_canonical_savepoint, write_split

__all__ = [
    "CANONICAL_BACKEND", "carried_properties", "PROP_KEY_COLUMNS", "PROP_SOURCE",
    "PROP_SOURCE_BACKEND", "ROW_GROUP_ROWS", "STATES_DIR", "TIMERS_DIR", "TIMERS_ENTRY",
    "CanonicalRange", "ParquetFileWriter", "Progress", "canonical_handle",
    "canonical_metadata", "key_columns_of", "key_types_of", "open_snapshot_range", "read_as",
    "read_range_tables", "remove_unreferenced", "restore_canonical", "snapshot_states",
    "split_file_name", "state_dir_names", "write_canonical_savepoint", "write_split",
]
