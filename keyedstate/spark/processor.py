"""The state processor API on Spark: read any snapshot's state as DataFrames, write canonical
savepoints from DataFrames (Flink's ``SavepointReader`` / ``SavepointWriter``).

Reading (``docs/state-processor.md``)::

    reader = SavepointReader.read(spark, "/ckpt")        # a checkpoint dir, chk-N, savepoint
    totals = reader.state("totals")                      # one DataFrame per state
    timers = reader.timers()

Every DataFrame is read by executors in parallel, one Spark task per key-group range: the task
restores its range of the snapshot (native: the snapshot's own backend; canonical: its Parquet
files) and emits the canonical rows (:mod:`keyedstate.processor.canonical.schema`): key
group, the typed key columns, namespace, map key (map states), position (list states: one row
per element), value, TTL timestamp (TTL states). Entries whose TTL ran out when ``state()``
was called are left out.

Writing::

    (SavepointWriter.new_savepoint(128, key_columns=["user_id"], key_types=["string"])
        .with_state(ValueStateDescriptor("totals", "count bigint, total double"), df,
                    value_column=F.struct("count", "total"))
        .write("/savepoints/bootstrap"))

``SavepointWriter.from_existing(spark, path)`` starts from a snapshot's states and timers;
``with_state`` replaces a state, ``remove_state`` drops one, ``write`` writes a canonical
savepoint (at any max parallelism: key groups are recomputed from the keys).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Sequence

import pyarrow as pa

from keyedstate.backends.base.backend import meta_info_of
from keyedstate.checkpoint.resolve import ResolvedSnapshot, resolve_snapshot
from keyedstate.checkpoint.savepoint import check_savepoint_target, new_snapshot_target
from keyedstate.errors import ConfigurationError, KeyedStateError, StateNotFoundError
from keyedstate.keygroups import KeyGroupRange, check_max_parallelism, check_parallelism
from keyedstate.processor.canonical import (
    PROP_SOURCE,
    STATES_DIR,
    TIMERS_DIR,
    TIMERS_ENTRY,
    canonical_handle,
    canonical_metadata,
    carried_properties,
    key_columns_of,
    key_types_of,
    read_as,
    remove_unreferenced,
    snapshot_states,
    state_dir_names,
)
from keyedstate.processor.canonical.schema import (
    DOMAIN,
    KEY_GROUP,
    MAP_KEY,
    NAMESPACE,
    PICKLE,
    POSITION,
    TIMESTAMP,
    TTL_TIMESTAMP,
    VALUE,
    check_key_columns,
    column_type,
    state_schema,
    timer_schema,
)
from keyedstate.runtime.failures import processor_task_error
from keyedstate.serde import VOID_NAMESPACE, type_from_string
from keyedstate.spark.processor_tasks import (
    WRITE_RESULT,
    ReadPlan,
    WritePlan,
    read_task,
    write_task,
)
from keyedstate.state.descriptors import StateDescriptor, StateKind
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import StateMetaInfo, StreamHandle
from keyedstate.storage.layout import METADATA_FILE

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, Row, SparkSession
    from pyspark.sql.types import DataType, StructType

_SPLIT = "_ks_split"


def _spark_type(arrow_type: pa.DataType) -> DataType:
    from pyspark.sql.pandas.types import from_arrow_type

    return from_arrow_type(arrow_type)


def _spark_schema(schema: pa.Schema) -> StructType:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def _conform(df: DataFrame, column: Column, target: DataType) -> Column:
    """``column`` cast to ``target``. Spark casts structs field by position; a struct with the
    target's field names in another order is reordered by name first."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType

    source = df.select(column.alias("_ks_v")).schema["_ks_v"].dataType
    if isinstance(source, StructType) and isinstance(target, StructType):
        names, wanted = source.fieldNames(), target.fieldNames()
        if names != wanted and sorted(names) == sorted(wanted):
            column = F.struct(*(column.getField(n).alias(n) for n in wanted))
    return column.cast(target)


def _raise_task_error(exc: Exception) -> None:
    """Re-raise the keyedstate error inside a Spark task failure as its own type
    (:func:`~keyedstate.runtime.failures.processor_task_error` reads Spark's text)."""
    error = processor_task_error(exc)
    if error is not None:
        raise error from exc


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


class SavepointReader:
    """The state of one checkpoint or savepoint (native or canonical), as DataFrames.

    ``key_columns`` names the key columns of every DataFrame (default: the names the snapshot
    records, else ``key``, ``key_1`` ...). Nothing is read until a DataFrame is evaluated.
    """

    def __init__(self, spark: SparkSession, snapshot: ResolvedSnapshot,
                 key_columns: Sequence[str] | None = None) -> None:
        self.spark = spark
        self.snapshot = snapshot
        self.metadata = snapshot.metadata
        self.key_types = key_types_of(self.metadata)
        self.key_columns = key_columns_of(self.metadata, key_columns)
        check_key_columns(self.key_columns, self.key_types)
        self.states: dict[str, StateMetaInfo] = snapshot_states(self.metadata)

    @classmethod
    def read(cls, spark: SparkSession, path: str, *, storage_options: dict[str, Any] | None = None,
             key_columns: Sequence[str] | None = None) -> SavepointReader:
        """A reader of the snapshot at ``path``: a job's checkpoint directory (its latest
        checkpoint), a ``chk-N`` folder, a savepoint folder or a ``_metadata`` file."""
        return cls(spark, resolve_snapshot(path, storage_options), key_columns)

    @property
    def max_parallelism(self) -> int:
        """The snapshot's max parallelism (its number of key groups)."""
        return self.metadata.max_parallelism

    @property
    def state_names(self) -> list[str]:
        """Names of the states the snapshot holds."""
        return list(self.states)

    def _splits(self, splits: int | None) -> int:
        n = splits or max(1, self.metadata.parallelism)
        check_parallelism(n, self.max_parallelism)
        return n

    def _frame(self, state: str | StateDescriptor | None, schema: pa.Schema,
               splits: int | None) -> DataFrame:
        from pyspark.sql.pandas.types import to_arrow_schema

        n = self._splits(splits)
        spark_schema = _spark_schema(schema)
        plan = ReadPlan(
            snapshot=self.snapshot, splits=n, state=state,
            key_columns=self.key_columns,
            output_schema=to_arrow_schema(spark_schema, timezone="UTC"),
            now_ms=time.time_ns() // 1_000_000)
        return self.spark.range(0, n, 1, n).mapInArrow(partial(read_task, plan), spark_schema)

    def state(self, state: str | StateDescriptor, *, splits: int | None = None) -> DataFrame:
        """The DataFrame of a state: one row per value, map entry or list element (columns in
        the module docstring), one Spark task per key-group range (``splits`` ranges; default:
        the snapshot's parallelism). ``state`` is its name (values in the recorded type) or a
        descriptor: values are then read in the descriptor's type, migrated by the rules of
        docs/schema-evolution.md (:class:`StateTypeMismatchError` when they can't be); the
        ``ttl_timestamp`` column is there exactly when the snapshot records TTL for the state,
        whatever the descriptor's TTL. Raises :class:`StateNotFoundError` for a state the
        snapshot doesn't hold."""
        name = state if isinstance(state, str) else state.name
        meta = self.states.get(name)
        if meta is None:
            raise StateNotFoundError(
                f"{self.snapshot.storage.url_of(self.snapshot.metadata_path)} holds no state "
                f"{name!r}; its states are {self.state_names}"
            )
        if not isinstance(state, str):  # checked here, before any Spark job
            meta, _ = read_as(state, meta)
        return self._frame(state, state_schema(meta, self.key_columns, self.key_types), splits)

    def timers(self, *, splits: int | None = None) -> DataFrame:
        """The DataFrame of every timer: ``domain`` (``event_time`` / ``processing_time``),
        ``timestamp`` (ms), ``key_group``, the key columns, ``namespace``."""
        return self._frame(None, timer_schema(self.key_columns, self.key_types), splits)


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    meta: StateMetaInfo | None
    df: DataFrame  # with the canonical columns (+ _SPLIT), not yet sorted
    plan_fields: dict[str, Any] = field(default_factory=dict)


class SavepointWriter:
    """Builds a new canonical savepoint from DataFrames (Flink's ``SavepointWriter``).

    Every state is written from one DataFrame; keys are cast to the key types and their key
    groups computed with the job's own routing expression (``pmod(xxhash64(keys), maxP)``),
    so a savepoint can be written at any max parallelism. Nothing runs until :meth:`write`.
    """

    def __init__(self, max_parallelism: int, *, key_columns: Sequence[str],
                 key_types: Sequence[str], splits: int | None = None) -> None:
        check_max_parallelism(max_parallelism)
        self.max_parallelism = max_parallelism
        self.key_columns = list(key_columns)
        self.key_type_strings = [str(t) for t in key_types]
        self.key_types = [type_from_string(t) for t in self.key_type_strings]
        check_key_columns(self.key_columns, self.key_types)
        if splits is not None:
            check_parallelism(splits, max_parallelism)
        self.splits = splits
        self._states: dict[str, _Pending] = {}
        self._timers: _Pending | None = None
        self._properties: dict[str, str] = {}
        self._spark: SparkSession | None = None

    @classmethod
    def new_savepoint(cls, max_parallelism: int, *, key_columns: Sequence[str],
                      key_types: Sequence[str], splits: int | None = None) -> SavepointWriter:
        """An empty savepoint of a job keyed by ``key_columns`` of ``key_types`` (Spark DDL,
        e.g. ``["string"]``), with ``max_parallelism`` key groups, written as ``splits``
        key-group ranges (default: Spark's default parallelism, at most max parallelism)."""
        return cls(max_parallelism, key_columns=key_columns, key_types=key_types, splits=splits)

    @classmethod
    def from_existing(cls, spark: SparkSession, path: str, *, max_parallelism: int | None = None,
                      storage_options: dict[str, Any] | None = None,
                      key_columns: Sequence[str] | None = None,
                      splits: int | None = None) -> SavepointWriter:
        """A savepoint holding the states and timers of the snapshot at ``path`` (any
        checkpoint or savepoint), to change with :meth:`with_state` / :meth:`remove_state`
        before :meth:`write`; at another ``max_parallelism`` if given (the key groups are
        recomputed). The snapshot's watermark and batch id are kept."""
        reader = SavepointReader.read(spark, path, storage_options=storage_options,
                                      key_columns=key_columns)
        writer = cls(max_parallelism or reader.max_parallelism, key_columns=reader.key_columns,
                     key_types=reader.metadata.key_types, splits=splits)
        writer._spark = spark
        for name, meta in reader.states.items():
            writer._add(meta, reader.state(name), key_columns=reader.key_columns,
                        value_column=VALUE, map_key_column=MAP_KEY, namespace_column=NAMESPACE,
                        position_column=POSITION,
                        ttl_timestamp_column=TTL_TIMESTAMP if meta.ttl_ms is not None else None)
        writer._timers = writer._timer_frame(reader.timers(), reader.key_columns, DOMAIN,
                                             TIMESTAMP, NAMESPACE)
        writer._properties = carried_properties(reader.metadata.properties)
        return writer

    # -- states --------------------------------------------------------------------------------

    def with_state(self, descriptor: StateDescriptor, df: DataFrame, *,
                   key_columns: Sequence[str] | None = None, value_column: str | Column = VALUE,
                   map_key_column: str | Column = MAP_KEY,
                   namespace_column: str | Column | None = None,
                   position_column: str | Column | None = None,
                   ttl_timestamp_column: str | Column | None = None) -> SavepointWriter:
        """Write state ``descriptor`` from ``df``, replacing a state of that name.

        One row per value (value, reducing, aggregating states: the value or accumulator;
        rows with a null value are no entry), per map entry, or per list element.
        ``key_columns`` are ``df``'s key columns (default: the writer's names); the other
        arguments name a column or pass a Spark ``Column``: ``value_column`` (default
        ``value``; cast to the descriptor's type, an untyped state pickles it unless it is
        binary, taken as already pickled), ``map_key_column`` (map states, default
        ``map_key``), ``namespace_column`` (binary ``serialize_namespace`` bytes; default the
        column ``namespace`` if ``df`` has it, else the default namespace),
        ``position_column`` (list order; default the column ``position`` if present, else no
        defined order), ``ttl_timestamp_column`` (TTL states: last access; default the column
        ``ttl_timestamp`` if present, else the write time). Two rows of one entry (same key,
        namespace, map key) fail :meth:`write` with :class:`ConfigurationError`.
        """
        columns = set(df.columns)
        if namespace_column is None and NAMESPACE in columns:
            namespace_column = NAMESPACE
        if position_column is None and POSITION in columns:
            position_column = POSITION
        if ttl_timestamp_column is None and TTL_TIMESTAMP in columns and descriptor.ttl:
            ttl_timestamp_column = TTL_TIMESTAMP
        self._spark = df.sparkSession
        self._add(meta_info_of(descriptor), df, key_columns=key_columns or self.key_columns,
                  value_column=value_column, map_key_column=map_key_column,
                  namespace_column=namespace_column, position_column=position_column,
                  ttl_timestamp_column=ttl_timestamp_column)
        return self

    def remove_state(self, name: str) -> SavepointWriter:
        """Leave state ``name`` out of the savepoint (:class:`StateNotFoundError` if absent)."""
        if self._states.pop(name, None) is None:
            raise StateNotFoundError(
                f"the savepoint being written has no state {name!r}; its states are "
                f"{sorted(self._states)}")
        return self

    def with_timers(self, df: DataFrame, *, key_columns: Sequence[str] | None = None,
                    domain_column: str | Column = DOMAIN,
                    timestamp_column: str | Column = TIMESTAMP,
                    namespace_column: str | Column | None = None) -> SavepointWriter:
        """Write the timers from ``df`` (replacing any): ``domain`` is ``event_time`` or
        ``processing_time``, ``timestamp`` in ms since the epoch, ``namespace`` as in
        :meth:`with_state`."""
        if namespace_column is None and NAMESPACE in df.columns:
            namespace_column = NAMESPACE
        self._spark = df.sparkSession
        self._timers = self._timer_frame(df, key_columns or self.key_columns, domain_column,
                                         timestamp_column, namespace_column)
        return self

    def _keys(self, df: DataFrame, key_columns: Sequence[str]) -> list[Column]:
        from pyspark.sql import functions as F

        if len(key_columns) != len(self.key_columns):
            raise ConfigurationError(
                f"key columns {list(key_columns)} don't match the savepoint's key "
                f"{self.key_columns} of types {self.key_type_strings}")
        missing = [c for c in key_columns if c not in df.columns]
        if missing:
            raise ConfigurationError(f"key columns {missing} are not in the DataFrame; its "
                                     f"columns are {df.columns}")
        return [F.col(f"`{c}`").cast(_spark_type(t)).alias(name)
                for c, t, name in zip(key_columns, self.key_types, self.key_columns)]

    def _col(self, df: DataFrame, column: str | Column, what: str) -> Column:
        from pyspark.sql import Column
        from pyspark.sql import functions as F

        if isinstance(column, Column):
            return column
        if not isinstance(column, str) or column not in df.columns:
            raise ConfigurationError(f"{what} column {column!r} is not in the DataFrame; its "
                                     f"columns are {df.columns}")
        return F.col(f"`{column}`")

    def _routed(self, df: DataFrame, key_exprs: list[Column], rest: list[Column]) -> DataFrame:
        from pyspark.sql import functions as F

        keyed = df.select(*key_exprs, *rest)
        keys = ", ".join(f"`{c}`" for c in self.key_columns)
        return keyed.withColumn(
            KEY_GROUP, F.expr(f"cast(pmod(xxhash64({keys}), {self.max_parallelism}) as int)"))

    def _add(self, meta: StateMetaInfo, df: DataFrame, *, key_columns: Sequence[str],
             value_column: str | Column, map_key_column: str | Column,
             namespace_column: str | Column | None, position_column: str | Column | None,
             ttl_timestamp_column: str | Column | None) -> None:
        from pyspark.sql import functions as F

        rest = [self._namespace(df, namespace_column)]
        pickled_key = False
        if meta.kind == StateKind.MAP:
            assert meta.user_key_type is not None
            pickled_key = meta.user_key_type == PICKLE
            mk = self._col(df, map_key_column, f"state {meta.name!r}: map key")
            rest.append((mk if pickled_key else mk.cast(_spark_type(column_type(
                meta.user_key_type)))).alias(MAP_KEY))
        if meta.kind == StateKind.LIST:
            rest.append((self._col(df, position_column, f"state {meta.name!r}: position")
                         .cast("bigint") if position_column is not None
                         else F.lit(0).cast("bigint")).alias(POSITION))
        value = self._col(df, value_column, f"state {meta.name!r}: value")
        pickled = meta.value_type == PICKLE
        rest.append((value if pickled else _conform(df, value, _spark_type(column_type(
            meta.value_type)))).alias(VALUE))
        if meta.ttl_ms is not None:
            ttl = self._col(df, ttl_timestamp_column, f"state {meta.name!r}: TTL timestamp") \
                if ttl_timestamp_column is not None else F.current_timestamp()
            rest.append(ttl.cast("timestamp").alias(TTL_TIMESTAMP))
        frame = self._routed(df, self._keys(df, key_columns), rest)
        self._states[meta.name] = _Pending(meta, frame, {
            "pickle_value": pickled, "pickle_map_key": pickled_key,
            "has_position": meta.kind == StateKind.LIST})

    def _namespace(self, df: DataFrame, namespace_column: str | Column | None) -> Column:
        from pyspark.sql import functions as F

        if namespace_column is None:
            return F.lit(bytearray(VOID_NAMESPACE)).alias(NAMESPACE)
        return self._col(df, namespace_column, "namespace").cast("binary").alias(NAMESPACE)

    def _timer_frame(self, df: DataFrame, key_columns: Sequence[str],
                     domain_column: str | Column, timestamp_column: str | Column,
                     namespace_column: str | Column | None) -> _Pending:
        rest = [self._col(df, domain_column, "timer domain").cast("string").alias(DOMAIN),
                self._col(df, timestamp_column, "timer timestamp").cast("bigint")
                .alias(TIMESTAMP),
                self._namespace(df, namespace_column)]
        return _Pending(None, self._routed(df, self._keys(df, key_columns), rest),
                        {"pickle_value": False, "pickle_map_key": False, "has_position": False})

    # -- write ---------------------------------------------------------------------------------

    def _run(self, pending: _Pending, storage: CheckpointStorage, relative_dir: str,
             entry: str, splits: int) -> list[Row]:
        from pyspark.sql import functions as F

        meta = pending.meta
        if meta is None:
            schema = timer_schema(self.key_columns, self.key_types)
            order = [KEY_GROUP, *self.key_columns, NAMESPACE, DOMAIN, TIMESTAMP]
        else:
            schema = state_schema(meta, self.key_columns, self.key_types)
            order = [KEY_GROUP, *self.key_columns, NAMESPACE]
            order += [MAP_KEY] if meta.kind == StateKind.MAP else []
            order += [POSITION] if meta.kind == StateKind.LIST else []
        plan = WritePlan(storage=storage, relative_dir=relative_dir, entry=entry, meta=meta,
                          splits=splits, max_parallelism=self.max_parallelism,
                          key_columns=self.key_columns, schema=schema, **pending.plan_fields)
        frame = pending.df.withColumn(
            _SPLIT, F.expr(f"cast({KEY_GROUP} * {splits} div {self.max_parallelism} as int)"))
        routed = (frame.repartitionById(splits, _SPLIT).drop(_SPLIT)
                  .sortWithinPartitions(*order))
        try:
            return routed.mapInArrow(partial(write_task, plan), WRITE_RESULT).collect()
        except KeyedStateError:
            raise
        except Exception as exc:
            _raise_task_error(exc)
            raise

    def write(self, path: str, *, storage_options: dict[str, Any] | None = None) -> str:
        """Write the canonical savepoint into the directory ``path``; returns the path or URL
        of its ``_metadata``. ``path`` must be new or an empty directory
        (:func:`~keyedstate.checkpoint.savepoint.check_savepoint_target`:
        :class:`SnapshotExistsError` if it holds a savepoint, :class:`TargetNotEmptyError` if
        anything else), checked before anything runs. Each state and the timers are one Spark
        job (one task per split); files no task reported (failed attempts) are deleted, then
        ``_metadata`` is written, atomically; on failure everything written under ``path`` is
        deleted, and the directories the write created."""
        storage = CheckpointStorage(path, storage_options)
        check_savepoint_target(storage)
        if self._spark is None:
            raise ConfigurationError("nothing to write: add a state with with_state() first")
        splits = self.splits or min(self.max_parallelism,
                                    max(1, self._spark.sparkContext.defaultParallelism))
        dirs = state_dir_names(self._states)
        files: dict[int, dict[str, StreamHandle]] = {i: {} for i in range(splits)}
        written: list[str] = []
        with new_snapshot_target(storage):
            jobs = [(p, f"{STATES_DIR}/{dirs[name]}", name) for name, p in self._states.items()]
            if self._timers is not None:
                jobs.append((self._timers, TIMERS_DIR, TIMERS_ENTRY))
            for pending, relative_dir, entry in jobs:
                for row in self._run(pending, storage, relative_dir, entry, splits):
                    written.append(row["path"])
                    files[row["split"]][entry] = StreamHandle(row["path"], row["size"],
                                                              row["checksum"])
            # Files of failed task attempts go, so a reader of the directory sees exactly the
            # savepoint's files.
            remove_unreferenced(storage, written)
            metas = [p.meta for p in self._states.values() if p.meta is not None]
            handles = [canonical_handle(i, KeyGroupRange.of_operator(
                self.max_parallelism, splits, i), 0, metas, files[i]) for i in range(splits)]
            metadata = canonical_metadata(
                checkpoint_id=0, max_parallelism=self.max_parallelism,
                key_types=self.key_type_strings, key_columns=self.key_columns, handles=handles,
                properties={**self._properties, PROP_SOURCE: "SavepointWriter"})
            return storage.url_of(storage.write_metadata(metadata, METADATA_FILE))


__all__ = ["SavepointReader", "SavepointWriter"]
