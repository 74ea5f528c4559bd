"""The floor of keyedstate's own protocol in ``keyedstate bench throughput``: the keyedstate
job with no state.

The hand-off floors of :mod:`.throughput` (``spark-arrow-handoff``,
``spark-two-phase-handoff``) route a batch and hand it to Python, where nothing is done: no
job, no checkpoint, no output. What the keyed count adds on top of them is not all state: the
exactly-once protocol itself (the subtasks' bookkeeping, a snapshot per subtask, the
checkpoint's ``_metadata``, the staged output and the sink's commit) runs whether a function
keeps state or not. These two systems run that protocol with a function that keeps none, so
their batch is the least any keyedstate system on the same path can take:

- ``keyedstate-stateless``: the per-key path; :class:`StatelessCount`'s ``process_key`` emits
  ``(user_id, rows of this key in this batch)`` and registers no state;
- ``keyedstate-stateless-two-phase``: the two-phase path; :class:`StatelessTwoPhaseCount`
  declares the same local aggregation as the two-phase counts (``LocalAggregation(events=
  Count())``: Spark counts each key's rows before Python) and its ``process_batch`` emits
  each key's count of the batch as it arrives.

Both run on the heap backend (its snapshot of no state is the smaller one) and checkpoint
every batch, as the other keyedstate systems do. If ``keyedstate-stateless`` is below a
target against Spark's built-in aggregation, no per-key backend can reach it; the same for
``keyedstate-stateless-two-phase`` and the two-phase systems (the interleaved mode's
``floor_checks``, :mod:`.throughput_interleave`).

Their output is each key's count **in its batch**, not its count so far, so the cumulative
check of the other systems does not apply: :func:`check_batch_counts` compares the sink's
per-batch aggregates with :func:`batch_figures`, computed from the Parquet files the system
was given. This module imports nothing of :mod:`.throughput` (which imports it).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keyedstate.runtime.function import Context, KeyedBatch, KeyedProcessFunction
from keyedstate.runtime.local_aggregation import Count, LocalAggregation

KEYEDSTATE_STATELESS = "keyedstate-stateless"
KEYEDSTATE_STATELESS_TWO_PHASE = "keyedstate-stateless-two-phase"

#: a batch's output figures, as the benchmark's sink aggregates them: (rows, sum of counts,
#: sum of squared counts)
Figures = tuple[int, int, int]


class StatelessCount(KeyedProcessFunction):
    """Each key's rows in this batch, through ``process_key``; no state registered."""

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[tuple[Any, int]]:
        return [(key, rows.num_rows)]


class StatelessTwoPhaseCount(KeyedProcessFunction):
    """Each key's rows in this batch, counted by the runtime's local phase (one row per key
    reaches Python) and emitted as they arrive, through ``process_batch``; no state."""

    local_aggregation = LocalAggregation(events=Count())

    def process_batch(self, batch: KeyedBatch, ctx: Context) -> pa.Table:
        return pa.table({"user_id": batch.key_columns.column("user_id"),
                         "count": batch.rows.column("events").combine_chunks()})


#: the stateless systems: the state backend (heap) and the function, as
#: :data:`~benchmarks.throughput.KEYEDSTATE_SYSTEMS` declares the others
STATELESS_SYSTEMS: dict[str, tuple[str, type[KeyedProcessFunction]]] = {
    KEYEDSTATE_STATELESS: ("heap", StatelessCount),
    KEYEDSTATE_STATELESS_TWO_PHASE: ("heap", StatelessTwoPhaseCount),
}


def batch_figures(paths: Sequence[str]) -> list[Figures]:
    """Per file in ``paths``, the figures of a per-batch count's output: the distinct keys of
    its ``user_id`` column, the sum of their counts (the file's rows) and the sum of their
    squares. Read from the files, not the generator, so the check stands on the data the
    system was given."""
    out: list[Figures] = []
    for path in paths:
        keys = pq.read_table(path, columns=["user_id"]).column("user_id")
        counts = np.asarray(pc.value_counts(keys).field("counts"), dtype=np.int64)
        out.append((int(counts.size), int(counts.sum()), int((counts ** 2).sum())))
    return out


def check_batch_counts(system: str, seen: Mapping[int, Figures], paths: Sequence[str]) -> None:
    """Raise :class:`AssertionError` unless ``seen`` (batch id -> the sink's figures of that
    batch's output) holds exactly one entry per file of ``paths``, batch ``i`` equal to
    :func:`batch_figures` of file ``i``: every key of the batch once, with its count in that
    batch (a cumulative count fails from the second batch on, a missing or extra batch
    fails)."""
    expected = batch_figures(paths)
    got = [seen.get(b) for b in range(len(expected))]
    if got != expected or len(seen) != len(expected):
        raise AssertionError(
            f"{system}: per-batch (rows, sum of counts, sum of squared counts) differ from each "
            f"batch's own counts in the generated data: got {got} (batches "
            f"{sorted(seen)}), expected {expected}"
        )
