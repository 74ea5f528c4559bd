"""Restoring a canonical savepoint: the verified files of one key-group range
(:class:`CanonicalRange`) bulk-loaded into an empty keyed backend of any kind, at any
parallelism (:func:`restore_canonical`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keyedstate.backends.base.backend import (
    KeyedStateBackend,
    StateBackend,
    StateRecord,
)
from keyedstate.backends.base.migration import recorded_value_type, resolve_restored
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.base.working_dirs import worker_dir
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    KeyGroupRangeError,
    MaxParallelismMismatchError,
    SerializationError,
    StateNotFoundError,
    StateTypeMismatchError,
)
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.processor.canonical.layout import (
    CANONICAL_BACKEND,
    ROW_GROUP_ROWS,
    TIMERS_ENTRY,
    key_columns_of,
    key_types_of,
    snapshot_states,
)
from keyedstate.processor.canonical.schema import (
    KEY_GROUP,
    check_schema,
    drop_expired,
    state_schema,
    table_records,
    table_timers,
    timer_schema,
)
from keyedstate.serde import TypeSerializer, serializer_from_string
from keyedstate.state.descriptors import StateDescriptor
from keyedstate.state.timers import TimeDomain, Timer
from keyedstate.state.ttl import SystemTimeProvider, TtlTimeProvider
from keyedstate.storage.handles import (
    SnapshotFormat,
    StateMetaInfo,
)


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
