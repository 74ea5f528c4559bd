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
savepoint directory, so it can be moved. Names and ``_metadata`` helpers are in
:mod:`keyedstate.processor.canonical_layout` (re-exported here), columns in
:mod:`keyedstate.processor.canonical_schema`.

Three entry points, no Spark needed: :func:`write_canonical_savepoint` converts any snapshot,
:func:`restore_canonical` fills an empty keyed backend of any kind from one (any parallelism),
:func:`open_snapshot_range` gives a keyed backend holding one key-group range of any snapshot.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import (
    KeyedStateBackend,
    StateBackend,
    StateRecord,
    meta_info_of,
)
from keyedstate.backends.base.migration import recorded_value_type, resolve_restored
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.base.working_dirs import worker_dir
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.checkpoint.savepoint import (
    Attach,
    attach_context,
    check_outside_source,
    new_snapshot_target,
)
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    KeyGroupRangeError,
    MaxParallelismMismatchError,
    SerializationError,
    StateNotFoundError,
    StateTypeMismatchError,
)
from keyedstate.keygroups import KeyGroupRange, check_parallelism
from keyedstate.keys import KeySerializer
from keyedstate.processor.canonical_layout import (
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
from keyedstate.processor.canonical_schema import (
    KEY_GROUP,
    VALUE,
    KeyColumns,
    check_schema,
    drop_expired,
    records_table,
    state_schema,
    table_records,
    table_timers,
    timer_schema,
    timers_table,
)
from keyedstate.serde import TypeSerializer, serializer_from_string
from keyedstate.state.descriptors import StateDescriptor, StateKind
from keyedstate.state.evolution import Resolution
from keyedstate.state.timers import TimeDomain, Timer
from keyedstate.state.ttl import SystemTimeProvider, TtlTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import (
    KeyedStateHandle,
    SnapshotFormat,
    StateMetaInfo,
    StreamHandle,
)
from keyedstate.storage.layout import METADATA_FILE

#: ``progress(splits_done, splits_total)``.
Progress = Callable[[int, int], None]


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


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
        for chunk in _chunks(backend.iter_records(name), ROW_GROUP_ROWS):
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
    for chunk in _chunks(timers, ROW_GROUP_ROWS):
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


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


def _check_canonical(snapshot: ResolvedSnapshot) -> str:
    where = snapshot.storage.url_of(snapshot.metadata_path)
    if snapshot.metadata.format is not SnapshotFormat.CANONICAL:
        raise ConfigurationError(f"{where} is a {snapshot.metadata.format} snapshot, not a "
                                 f"canonical savepoint")
    for handle in snapshot.metadata.handles:
        if handle.backend != CANONICAL_BACKEND:
            raise CorruptCheckpointError(
                f"{where}: handle of split {handle.subtask_index} is a {handle.backend!r} "
                f"handle in a canonical savepoint; its _metadata is inconsistent"
            )
        if not KeyGroupRange(0, snapshot.metadata.max_parallelism - 1).contains_range(
                handle.key_group_range):
            raise KeyGroupRangeError(
                f"{where}: split {handle.subtask_index} covers {handle.key_group_range}, "
                f"outside max parallelism {snapshot.metadata.max_parallelism}"
            )
    return where


def serializers_of(meta: StateMetaInfo, where: str
                   ) -> tuple[TypeSerializer, TypeSerializer | None]:
    """The value and map-key serializers a state's recorded types name."""
    try:
        value = serializer_from_string(meta.value_type)
        user_key = serializer_from_string(meta.user_key_type)
    except SerializationError as exc:
        raise CorruptCheckpointError(f"{where}: state {meta.name!r}: {exc}") from exc
    assert value is not None
    return value, user_key


class CanonicalRange:
    """The files of one key-group range of a canonical savepoint, fetched to a local directory
    and verified (size and checksum) when opened: nothing is read from a file that was not
    checked. Use as a context manager; the local copies go on exit."""

    def __init__(self, snapshot: ResolvedSnapshot, key_group_range: KeyGroupRange,
                 local_dir: str | None = None) -> None:
        self.snapshot = snapshot
        self.where = _check_canonical(snapshot)
        self.key_group_range = key_group_range
        self.metadata = snapshot.metadata
        self.states = snapshot_states(self.metadata)
        self.key_types = key_types_of(self.metadata)
        self.key_columns = key_columns_of(self.metadata)
        self.handles = [h for h in self.metadata.handles
                        if h.key_group_range.intersection(key_group_range)]
        self._local_dir = local_dir
        self._work: str | None = None
        self.local: dict[str, list[tuple[str, str]]] = {}  # entry -> [(local path, source url)]

    def __enter__(self) -> CanonicalRange:
        self._work = tempfile.mkdtemp(prefix="keyedstate-canonical-",
                                      dir=worker_dir(self._local_dir))
        try:
            storage = self.snapshot.storage
            for handle in self.handles:
                for entry, file in handle.private.items():
                    if entry != TIMERS_ENTRY and entry not in self.states:
                        raise CorruptCheckpointError(
                            f"{self.where}: split {handle.subtask_index} has a file for state "
                            f"{entry!r}, which the savepoint does not declare"
                        )
                    path = os.path.join(self._work, uuid.uuid4().hex + ".parquet")
                    storage.download(file, path)
                    self.local.setdefault(entry, []).append((path, storage.url_of(file.path)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def _read(self, path: str, source: str, schema: pa.Schema) -> Iterator[pa.Table]:
        """The file's rows of this range, one row group at a time; row groups whose key-group
        statistics lie outside the range are skipped unread."""
        rng = self.key_group_range
        try:
            parquet = pq.ParquetFile(path)
            check_schema(parquet.schema_arrow, schema, source)
            # Every column before key_group is a primitive: its field index is its leaf index.
            leaf = parquet.schema_arrow.get_field_index(KEY_GROUP)
            for i in range(parquet.num_row_groups):
                stats = parquet.metadata.row_group(i).column(leaf).statistics
                if stats is not None and stats.has_min_max and (
                        stats.max < rng.start or stats.min > rng.end):
                    continue
                table = parquet.read_row_group(i)
                kgs = table.column(KEY_GROUP)
                table = table.filter(pc.and_(pc.greater_equal(kgs, rng.start),
                                             pc.less_equal(kgs, rng.end)))
                if table.num_rows:
                    yield table
        except (pa.ArrowException, OSError) as exc:
            raise CorruptCheckpointError(f"{source} is not a readable Parquet file ({exc}); "
                                         f"restore from another savepoint") from exc

    def state_tables(self, name: str, now_ms: int) -> Iterator[tuple[pa.Table, str]]:
        """``(rows, source url)`` of a state in this range, live at ``now_ms``, a row group at
        a time. Writers store each list's elements in position order, so rows come that way."""
        meta = self.states.get(name)
        if meta is None:
            raise StateNotFoundError(
                f"{self.where} holds no state {name!r}; its states are {sorted(self.states)}"
            )
        schema = state_schema(meta, self.key_columns, self.key_types)
        for path, source in self.local.get(name, []):
            for table in self._read(path, source, schema):
                yield drop_expired(table, meta.ttl_ms, now_ms), source

    def timer_tables(self) -> Iterator[tuple[pa.Table, str]]:
        schema = timer_schema(self.key_columns, self.key_types)
        for path, source in self.local.get(TIMERS_ENTRY, []):
            for table in self._read(path, source, schema):
                yield table, source


def restore_canonical(backend: StateBackend, snapshot: ResolvedSnapshot, *,
                      subtask_index: int, key_group_range: KeyGroupRange,
                      max_parallelism: int, key_serializer: KeySerializer,
                      time_provider: TtlTimeProvider | None = None,
                      local_dir: str | None = None,
                      descriptors: Iterable[StateDescriptor] = ()) -> KeyedStateBackend:
    """A keyed backend of ``backend``'s kind holding ``key_group_range`` of the canonical
    savepoint ``snapshot``, at any parallelism; its first snapshot references none of the
    savepoint's files.

    Step 1. Check the savepoint fits the job, touching nothing: canonical format, the same max
        parallelism (:class:`MaxParallelismMismatchError`; a canonical savepoint is rewritten
        at another one with :class:`keyedstate.spark.processor.SavepointWriter`), the same key
        types and every given descriptor compatible with its state
        (:class:`StateTypeMismatchError`).
    Step 2. Fetch and verify every file of the splits overlapping the range
        (:class:`MissingCheckpointFileError`, :class:`CorruptCheckpointError`).
    Step 3. Create an empty keyed backend and bulk-load each state's rows of the range
        (:meth:`KeyedStateBackend.load_records`; TTL-expired rows left out), then the timers.
        On failure the backend is closed.
    """
    metadata = snapshot.metadata
    where = _check_canonical(snapshot)
    # Step 1. Compatibility.
    if metadata.max_parallelism != max_parallelism:
        raise MaxParallelismMismatchError(
            f"{where} was written with max parallelism {metadata.max_parallelism}, the job runs "
            f"with {max_parallelism}; set pipeline.max-parallelism to "
            f"{metadata.max_parallelism}, or rewrite the savepoint at {max_parallelism} with "
            f"SavepointWriter (keyedstate.spark.processor)"
        )
    snapshot_key_types = key_types_of(metadata)
    if key_serializer.arrow_types is None:
        key_serializer = KeySerializer(snapshot_key_types)
    elif list(key_serializer.arrow_types) != snapshot_key_types:
        raise StateTypeMismatchError(
            f"{where} is keyed by {[str(t) for t in snapshot_key_types]}, the job by "
            f"{key_serializer.type_strings}; key the job by columns of the savepoint's types"
        )
    states = snapshot_states(metadata)
    for descriptor in descriptors:  # the backend migrates them when they are asked for
        if descriptor.name in states:
            meta = states[descriptor.name]
            resolve_restored(descriptor, meta, recorded_value_type(meta))
    serializers = {name: serializers_of(meta, where) for name, meta in states.items()}
    clock = time_provider or SystemTimeProvider()
    # Step 2. Fetch and verify.
    with CanonicalRange(snapshot, key_group_range, local_dir) as files:
        # Step 3. Load.
        keyed = backend.create_keyed_backend(KeyedStateBackendParameters(
            subtask_index=subtask_index, key_group_range=key_group_range,
            max_parallelism=max_parallelism, key_serializer=key_serializer,
            time_provider=clock, local_dir=local_dir))
        try:
            now = clock.now_ms()
            for name, meta in states.items():
                value_serializer, user_key_serializer = serializers[name]
                keyed.load_records(meta, value_serializer, user_key_serializer,
                                   _records(files, name, now, key_serializer, max_parallelism))
            for table, source in files.timer_tables():
                for domain, timer, namespace in table_timers(table, files.key_columns,
                                                             key_serializer, max_parallelism,
                                                             source):
                    _register(keyed, timer, namespace, domain)
        except BaseException:
            keyed.close()
            raise
    return keyed


def _records(files: CanonicalRange, name: str, now_ms: int, key_serializer: KeySerializer,
             max_parallelism: int) -> Iterator[StateRecord]:
    meta = files.states[name]
    for table, source in files.state_tables(name, now_ms):
        for start in range(0, table.num_rows, ROW_GROUP_ROWS):
            yield from table_records(table.slice(start, ROW_GROUP_ROWS), meta, files.key_columns,
                                     key_serializer, max_parallelism, source)


def _register(backend: KeyedStateBackend, timer: Timer, namespace: Any,
              domain: TimeDomain) -> None:
    backend.set_current_key_bytes(timer.key_bytes, timer.key_group)
    service = backend.timer_service
    if domain is TimeDomain.EVENT_TIME:
        service.register_event_time_timer(timer.timestamp, namespace)
    else:
        service.register_processing_time_timer(timer.timestamp, namespace)


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
                for chunk in _chunks(timers, ROW_GROUP_ROWS):
                    yield timers_table(chunk, schema, keys)
                return
            if state not in {m.name for m in backend.state_meta_infos()}:
                return  # no handle of this range holds the state
            meta = states[state]
            schema = state_schema(meta, names, key_types)
            positions: dict[tuple[int, bytes, bytes], int] | None = \
                {} if meta.kind == StateKind.LIST else None
            for chunk in _chunks(backend.iter_records(state), ROW_GROUP_ROWS):
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


__all__ = [
    "CANONICAL_BACKEND", "carried_properties", "PROP_KEY_COLUMNS", "PROP_SOURCE",
    "PROP_SOURCE_BACKEND", "ROW_GROUP_ROWS", "STATES_DIR", "TIMERS_DIR", "TIMERS_ENTRY",
    "CanonicalRange", "ParquetFileWriter", "canonical_handle", "canonical_metadata",
    "key_columns_of", "key_types_of", "open_snapshot_range",
    "read_as", "read_range_tables", "remove_unreferenced", "restore_canonical", "snapshot_states",
    "split_file_name", "state_dir_names", "write_canonical_savepoint",
]
