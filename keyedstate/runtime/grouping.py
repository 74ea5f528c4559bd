"""Key grouping: a subtask's rows sorted by key and cut into key runs (:class:`KeyedBatch`),
the one preparation both the per-key and the vectorized path of a subtask use, and which
subtasks one Spark task runs. No per-row Python loop: key runs are found with Arrow compute
and keys encoded in one pass."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from keyedstate.keys import KeySerializer
from keyedstate.runtime.function import KeyedBatch
from keyedstate.runtime.wire import KG_COLUMN, SUBTASK_COLUMN
from keyedstate.state.batch_keys import BatchKeys


def sort_by_key(table: pa.Table, key_columns: list[str]) -> pa.Table:
    """``table`` sorted by its key columns, ascending, stable (a key's rows keep their arrival
    order). One string or binary key column is sorted through its dictionary: the distinct
    keys are ranked, then the rows by their key's rank (an integer sort), the same order in
    about half the time of a string sort over every row."""
    if len(key_columns) == 1:
        column = table.column(key_columns[0])
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type) \
                or pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            encoded = pc.dictionary_encode(column.combine_chunks())
            # Nulls: index null, rank null, sorted last as sort_indices puts null keys.
            ranks = pc.rank(encoded.dictionary, sort_keys="ascending", tiebreaker="first")
            return table.take(pc.sort_indices(pc.take(ranks, encoded.indices)))
    return table.take(pc.sort_indices(table, [(c, "ascending") for c in key_columns]))


def keyed_batch(table: pa.Table, key_columns: list[str], key_serializer: KeySerializer
                ) -> KeyedBatch:
    """The :class:`KeyedBatch` of ``table``: rows sorted by key (stable, :func:`sort_by_key`)
    with their key group column, as step 4 prepares them for both paths. Key runs are where
    any key column changes between neighbouring rows (nulls equal to nulls); the keys' bytes
    are :meth:`KeySerializer.serialize_many` of the same Python values."""
    n = table.num_rows
    changed = None
    for name in key_columns:
        column = table.column(name)
        before, after = column.slice(0, n - 1), column.slice(1)
        differs = pc.or_(pc.fill_null(pc.not_equal(before, after), False),
                         pc.xor(pc.is_null(before), pc.is_null(after)))
        changed = differs if changed is None else pc.or_(changed, differs)
    starts = pa.concat_arrays([
        pa.array([0], pa.int64()),
        pc.add(pc.indices_nonzero(changed), 1).cast(pa.int64()) if changed is not None
        else pa.array([], pa.int64())])
    offsets = pa.concat_arrays([starts, pa.array([n], pa.int64())])
    key_table = table.select(key_columns).take(starts)
    columns = [key_table.column(c).to_pylist() for c in key_columns]
    keys: list[Any] = columns[0] if len(columns) == 1 else list(zip(*columns))
    key_groups = table.column(KG_COLUMN).take(starts).to_pylist()
    batch_keys = BatchKeys(keys, key_serializer.serialize_many(keys), key_groups)
    rows = table.drop_columns([c for c in (KG_COLUMN, SUBTASK_COLUMN) if c in table.column_names])
    return KeyedBatch(batch_keys, key_table, rows, offsets)


def subtasks_of_task(task: int, spark_tasks: int, parallelism: int) -> range:
    """The subtasks Spark task ``task`` of ``spark_tasks`` runs: those routed to it, subtask
    ``i`` going to task ``i * spark_tasks // parallelism`` (a contiguous, balanced group)."""
    return range(-(-task * parallelism // spark_tasks),
                 -(-(task + 1) * parallelism // spark_tasks))
