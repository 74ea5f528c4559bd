"""What runs in executors for the state processor API (:mod:`keyedstate.spark.processor`):
one task per key-group range reads a snapshot's rows, one task per split writes a canonical
savepoint's file. The plans are pickled into the task closures (tested)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from keyedstate import errors as _errors
from keyedstate.backends.base.working_dirs import worker_dir
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.errors import ConfigurationError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.processor.canonical import (
    ROW_GROUP_ROWS,
    ParquetFileWriter,
    read_range_tables,
    split_file_name,
)
from keyedstate.processor.canonical.schema import (
    DOMAIN,
    KEY_GROUP,
    MAP_KEY,
    NAMESPACE,
    POSITION,
    TIMESTAMP,
    VALUE,
)
from keyedstate.serde import PickleSerializer
from keyedstate.state.descriptors import StateDescriptor, StateKind
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import StateMetaInfo

#: Schema of the one row a write task returns per file.
WRITE_RESULT = "split int, entry string, path string, size bigint, checksum string, rows bigint"
_WRITE_RESULT_SCHEMA = pa.schema([("split", pa.int32()), ("entry", pa.string()),
                                  ("path", pa.string()), ("size", pa.int64()),
                                  ("checksum", pa.string()), ("rows", pa.int64())])
_VALUE_KINDS = (StateKind.VALUE, StateKind.REDUCING, StateKind.AGGREGATING)


@dataclass(frozen=True)
class ReadPlan:
    """What a read task needs; pickled into the task closure."""

    snapshot: ResolvedSnapshot
    splits: int
    #: a state's name, or a descriptor: values read in its type
    #: (``SavepointReader.state(descriptor)``); None: timers
    state: str | StateDescriptor | None
    key_columns: list[str]
    output_schema: pa.Schema
    now_ms: int


def read_task(plan: ReadPlan, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` function: each input row is a split index; emits that range's rows."""
    snapshot = plan.snapshot
    for batch in batches:
        for index in batch.column(0).to_pylist():
            rng = KeyGroupRange.of_operator(snapshot.metadata.max_parallelism, plan.splits,
                                            index)
            for table in read_range_tables(snapshot, rng, plan.state, now_ms=plan.now_ms,
                                           key_columns=plan.key_columns):
                yield from table.cast(plan.output_schema).to_batches()


@dataclass(frozen=True)
class WritePlan:
    """What a write task needs; pickled into the task closure."""

    storage: CheckpointStorage
    relative_dir: str
    entry: str  # state name or TIMERS_ENTRY
    meta: StateMetaInfo | None  # None: timers
    splits: int
    max_parallelism: int
    key_columns: list[str]
    schema: pa.Schema
    pickle_value: bool
    pickle_map_key: bool
    has_position: bool


def write_task(plan: WritePlan, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` function over one split's rows (sorted within the partition): writes one
    Parquet file and returns its handle as one row."""
    from pyspark import TaskContext

    context = TaskContext.get()
    assert context is not None  # always set inside a Spark task
    index = context.partitionId()
    rng = KeyGroupRange.of_operator(plan.max_parallelism, plan.splits, index)
    # In this worker's own directory: a killed worker's is removed by the next (working_dirs).
    work = tempfile.mkdtemp(prefix="keyedstate-write-", dir=worker_dir(None))
    try:
        writer = ParquetFileWriter(plan.storage,
                                   f"{plan.relative_dir}/{split_file_name(rng)}", plan.schema,
                                   work)
        shaper = RowShaper(plan)
        buffer: list[pa.Table] = []
        buffered = 0
        for batch in batches:
            if batch.num_rows == 0:
                continue
            table = shaper.shape(pa.Table.from_batches([batch]), rng)
            buffer.append(table)
            buffered += table.num_rows
            if buffered >= ROW_GROUP_ROWS:
                writer.write(pa.concat_tables(buffer))
                buffer, buffered = [], 0
        if buffer:
            writer.write(pa.concat_tables(buffer))
        handle = writer.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if handle is None:
        return
    yield pa.RecordBatch.from_pylist([{
        "split": index, "entry": plan.entry, "path": handle.path, "size": handle.size,
        "checksum": handle.checksum, "rows": writer.rows}], schema=_WRITE_RESULT_SCHEMA)


class RowShaper:
    """Turns a Spark batch of one split into canonical rows: pickles untyped columns, numbers
    list positions, refuses duplicate entries and rows of other key groups. Rows arrive sorted
    by key group, key, namespace (and position or map key); state carries across batches."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan
        self.last_ident: tuple[Any, ...] | None = None
        self.next_position = 0
        self._pickle = PickleSerializer().serialize

    def _pickled(self, column: pa.ChunkedArray) -> pa.Array:
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            return column.cast(pa.binary())
        return pa.array([self._pickle(v) for v in column.to_pylist()], pa.binary())

    def shape(self, table: pa.Table, rng: KeyGroupRange) -> pa.Table:
        plan = self.plan
        meta = plan.meta
        kgs = table.column(KEY_GROUP)
        if pc.any(pc.or_(pc.less(kgs, rng.start), pc.greater(kgs, rng.end))).as_py():
            raise _errors.KeyGroupRangeError(
                f"rows of key groups outside {rng} reached split {rng}; the DataFrame was "
                f"repartitioned after routing")
        if meta is not None and meta.kind in _VALUE_KINDS:
            table = table.filter(pc.is_valid(table.column(VALUE)))  # null: no entry
        columns: dict[str, Any] = {n: table.column(n) for n in table.column_names}
        if meta is not None:
            if plan.pickle_value:
                columns[VALUE] = self._pickled(columns[VALUE])
            if meta.kind == StateKind.MAP and plan.pickle_map_key:
                columns[MAP_KEY] = self._pickled(columns[MAP_KEY])
        idents = list(zip(*(columns[c].to_pylist() for c in self._ident_columns())))
        if meta is not None and meta.kind == StateKind.LIST:
            positions = []
            for ident in idents:
                if ident != self.last_ident:
                    self.last_ident, self.next_position = ident, 0
                positions.append(self.next_position)
                self.next_position += 1
            columns[POSITION] = pa.array(positions, pa.int32())
        else:
            for ident in idents:
                if ident == self.last_ident:
                    what = "timer" if meta is None else f"entry of state {meta.name!r}"
                    raise ConfigurationError(
                        f"the DataFrame holds the same {what} twice (key group, key, "
                        f"namespace{', map key' if meta is not None and meta.kind == StateKind.MAP else ''}"
                        f" = {ident!r}); deduplicate it before writing")
                self.last_ident = ident
        return pa.Table.from_arrays(
            [columns[f.name].cast(f.type) for f in plan.schema], schema=plan.schema)

    def _ident_columns(self) -> list[str]:
        meta = self.plan.meta
        if meta is None:
            return [DOMAIN, TIMESTAMP, KEY_GROUP, *self.plan.key_columns, NAMESPACE]
        cols = [KEY_GROUP, *self.plan.key_columns, NAMESPACE]
        if meta.kind == StateKind.MAP:
            cols.append(MAP_KEY)
        return cols
