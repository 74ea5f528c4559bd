"""Reading one key-group range of any snapshot, native or canonical: as a keyed backend
(:func:`open_snapshot_range`) or as canonical Arrow tables of one state, optionally through an
evolved descriptor (:func:`read_range_tables`, :func:`read_as`). The state processor API, the
command line and the canonical writer stand on it."""

from __future__ import annotations

import shutil
import tempfile
from typing import Iterator, Sequence

import msgspec
import pyarrow as pa

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import (
    KeyedStateBackend,
    StateBackend,
    meta_info_of,
)
from keyedstate.backends.base.migration import recorded_value_type, resolve_restored
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.base.working_dirs import worker_dir
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    StateNotFoundError,
)
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.processor.canonical.layout import (
    ROW_GROUP_ROWS,
    key_columns_of,
    key_types_of,
    row_groups,
    snapshot_states,
)
from keyedstate.processor.canonical.restore import CanonicalRange, restore_canonical
from keyedstate.processor.canonical.schema import (
    VALUE,
    KeyColumns,
    records_table,
    state_schema,
    timer_schema,
    timers_table,
)
from keyedstate.state.descriptors import StateDescriptor, StateKind
from keyedstate.state.evolution import Resolution
from keyedstate.state.timers import TimeDomain
from keyedstate.state.ttl import SystemTimeProvider, TtlTimeProvider
from keyedstate.storage.handles import (
    SnapshotFormat,
    StateMetaInfo,
)


def read_as(descriptor: StateDescriptor, meta: StateMetaInfo
            ) -> tuple[StateMetaInfo, Resolution | None]:
    """How the state processor reads the recorded state ``meta`` through ``descriptor``: the
    state of the rows read (the descriptor's value type; kind, map-key type and TTL as
    recorded: the ``ttl_timestamp`` column is there exactly when the snapshot has TTL
    timestamps) and the resolution migrating the values (None: read as recorded). Raises
    :class:`StateTypeMismatchError` (and :class:`ConfigurationError`) as a restore of the
    state with ``descriptor`` would (docs/schema-evolution.md)."""
    resolution = resolve_restored(descriptor, meta, recorded_value_type(meta))
    if resolution is None:
        return meta, None
    return msgspec.structs.replace(meta_info_of(descriptor), ttl_ms=meta.ttl_ms), resolution


def _migrated(tables: Iterator[pa.Table], resolution: Resolution | None,
              schema: pa.Schema) -> Iterator[pa.Table]:
    """``tables`` with their values migrated by ``resolution``, in ``schema``."""
    for table in tables:
        if resolution is not None:
            i = table.schema.get_field_index(VALUE)
            table = table.set_column(i, VALUE, resolution.migrate_array(table.column(i)))
            table = table.cast(schema)
        yield table


def read_range_tables(snapshot: ResolvedSnapshot, key_group_range: KeyGroupRange,
                      state: str | StateDescriptor | None, *, now_ms: int,
                      key_columns: Sequence[str] | None = None,
                      local_dir: str | None = None) -> Iterator[pa.Table]:
    """The canonical rows of ``state`` (None: the timers) in ``key_group_range`` of any
    snapshot, as Arrow tables of at most :data:`ROW_GROUP_ROWS` rows, entries expired at
    ``now_ms`` left out; key columns named ``key_columns`` (default: as the snapshot records).
    ``state`` is a state's name (values in the recorded type) or a descriptor (values in its
    type, migrated by the rules of docs/schema-evolution.md; :func:`read_as`), checked when
    the first table is asked for, before anything is read. A canonical snapshot's files are
    read directly (verified first), a native one is restored into a temporary backend.
    Raises :class:`StateNotFoundError` for a state the snapshot doesn't hold,
    :class:`StateTypeMismatchError` for a descriptor that can't read it."""
    metadata = snapshot.metadata
    states = snapshot_states(metadata)
    name = state.name if isinstance(state, StateDescriptor) else state
    if name is not None and name not in states:
        raise StateNotFoundError(
            f"{snapshot.storage.url_of(snapshot.metadata_path)} holds no state {name!r}; its "
            f"states are {sorted(states)}"
        )
    resolution: Resolution | None = None
    if isinstance(state, StateDescriptor):
        read_meta, resolution = read_as(state, states[state.name])
    key_types = key_types_of(metadata)
    recorded = key_columns_of(metadata)
    names = list(key_columns) if key_columns is not None else recorded
    if resolution is None:
        yield from _range_tables(snapshot, key_group_range, name, now_ms=now_ms,
                                 names=names, local_dir=local_dir)
        return
    schema = state_schema(read_meta, names, key_types)
    yield from _migrated(_range_tables(snapshot, key_group_range, name, now_ms=now_ms,
                                       names=names, local_dir=local_dir), resolution, schema)


def _range_tables(snapshot: ResolvedSnapshot, key_group_range: KeyGroupRange,
                  state: str | None, *, now_ms: int, names: list[str],
                  local_dir: str | None) -> Iterator[pa.Table]:
    """:func:`read_range_tables` of a state's name, as recorded; key columns ``names``."""
    metadata = snapshot.metadata
    states = snapshot_states(metadata)
    key_types = key_types_of(metadata)
    rename = dict(zip(key_columns_of(metadata), names))
    work = tempfile.mkdtemp(prefix="keyedstate-read-", dir=worker_dir(local_dir))
    try:
        if metadata.format is SnapshotFormat.CANONICAL:
            with CanonicalRange(snapshot, key_group_range, work) as files:
                tables = files.state_tables(state, now_ms) if state is not None \
                    else files.timer_tables()
                for table, _ in tables:
                    table = table.rename_columns([rename.get(n, n) for n in table.column_names])
                    for start in range(0, table.num_rows, ROW_GROUP_ROWS):
                        yield table.slice(start, ROW_GROUP_ROWS)
            return
        with open_snapshot_range(snapshot, key_group_range,
                                 time_provider=_FixedClock(now_ms), local_dir=work) as backend:
            keys = KeyColumns(backend.key_serializer)
            if state is None:
                schema = timer_schema(names, key_types)
                timers = [(d, t) for d in TimeDomain for t in backend.timer_service.timers(d)]
                timers.sort(key=lambda dt: dt[1].key_group)
                for chunk in row_groups(timers):
                    yield timers_table(chunk, schema, keys)
                return
            if state not in {m.name for m in backend.state_meta_infos()}:
                return  # no handle of this range holds the state
            meta = states[state]
            schema = state_schema(meta, names, key_types)
            positions: dict[tuple[int, bytes, bytes], int] | None = \
                {} if meta.kind == StateKind.LIST else None
            for chunk in row_groups(backend.iter_records(state)):
                yield records_table(chunk, meta, schema, keys, positions)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _FixedClock:
    """The clock of a read: TTL expiry as of one instant, the same for every range."""

    def __init__(self, now_ms: int) -> None:
        self._now = now_ms

    def now_ms(self) -> int:
        return self._now


def open_snapshot_range(snapshot: ResolvedSnapshot, key_group_range: KeyGroupRange, *,
                        backend: StateBackend | None = None, subtask_index: int = 0,
                        time_provider: TtlTimeProvider | None = None,
                        local_dir: str | None = None) -> KeyedStateBackend:
    """A keyed backend holding ``key_group_range`` of any snapshot (for reading: the state
    processor API, the command line, conversions). A native snapshot is restored by its own
    backend (``backend`` overrides the configuration), a canonical one loaded into ``backend``
    (default heap). The caller closes it."""
    metadata = snapshot.metadata
    key_serializer = KeySerializer(key_types_of(metadata))
    if metadata.format is SnapshotFormat.CANONICAL:
        return restore_canonical(backend or load_backend("heap"), snapshot,
                                 subtask_index=subtask_index, key_group_range=key_group_range,
                                 max_parallelism=metadata.max_parallelism,
                                 key_serializer=key_serializer, time_provider=time_provider,
                                 local_dir=local_dir)
    try:
        native = backend or load_backend(metadata.backend)
    except ConfigurationError as exc:
        raise CorruptCheckpointError(
            f"{snapshot.storage.url_of(snapshot.metadata_path)} names backend "
            f"{metadata.backend!r}: {exc}") from exc
    return native.create_keyed_backend(KeyedStateBackendParameters(
        subtask_index=subtask_index, key_group_range=key_group_range,
        max_parallelism=metadata.max_parallelism, key_serializer=key_serializer,
        restore_handles=metadata.handles, storage=snapshot.storage,
        share_restored_files=False, time_provider=time_provider or SystemTimeProvider(),
        local_dir=local_dir))
