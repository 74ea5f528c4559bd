"""The user-facing processing API: a keyed process function and its context.

Flink users know it as ``KeyedProcessFunction``; PySpark users get Arrow / pandas batches per
key. Output rows are dicts (column name -> value) or tuples in the declared schema's order,
*yielded* by the methods (``return`` of a list works too). A vectorized function
(:meth:`KeyedProcessFunction.process_batch`) gets all keys of its subtask's batch at once
(:class:`KeyedBatch`) and may return an Arrow table instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, TypeAlias

import pyarrow as pa
import pyarrow.compute as pc

from keyedstate.runtime.local_aggregation import LocalAggregation
from keyedstate.state.batch_keys import BatchKeys
from keyedstate.state.descriptors import S, StateDescriptor
from keyedstate.state.timers import TimeDomain

if TYPE_CHECKING:
    from keyedstate.backends.base.backend import KeyedStateBackend

Row = dict[str, Any] | tuple[Any, ...]

#: What a function may return: rows (an iterable of dicts or tuples), None, or (from
#: :meth:`KeyedProcessFunction.process_batch`) an Arrow table or record batch.
Output: TypeAlias = "Iterable[Row] | pa.Table | pa.RecordBatch | None"


@dataclass(frozen=True)
class KeyedBatch:
    """One subtask's rows of one batch, grouped by key, as Arrow: what
    :meth:`KeyedProcessFunction.process_batch` receives.

    - ``keys``: the distinct keys (:class:`~keyedstate.state.batch_keys.BatchKeys`: the key
      values, their canonical bytes and key groups), in the order of ``key_columns``; pass it
      to the bulk state calls (``state.get_many(batch.keys)``, ...).
    - ``key_columns``: the distinct keys as Arrow columns (the job's key columns), one row per
      key, sorted ascending by the key columns.
    - ``rows``: every row of the batch (late rows already split off), the input columns
      only, sorted by key; a key's rows keep their arrival order. With a local aggregation
      (:attr:`KeyedProcessFunction.local_aggregation`): one row per key, the key columns and
      the aggregate columns (``counts`` are then all 1; count with ``Count()``).
    - ``offsets``: ``len(keys) + 1`` row offsets: key ``i``'s rows are
      ``rows[offsets[i]:offsets[i + 1]]`` (:meth:`rows_of`).
    """

    keys: BatchKeys
    key_columns: pa.Table
    rows: pa.Table
    offsets: pa.Int64Array

    def __len__(self) -> int:
        """The number of distinct keys."""
        return len(self.keys)

    @property
    def counts(self) -> pa.Int64Array:
        """Rows per key, in the keys' order."""
        return pc.subtract(self.offsets[1:], self.offsets[:-1])

    def rows_of(self, index: int) -> pa.Table:
        """The rows of key ``index`` (what ``process_key`` gets for it)."""
        start = self.offsets[index].as_py()
        return self.rows.slice(start, self.offsets[index + 1].as_py() - start)

    def key_index(self) -> pa.Int64Array:
        """For each row, the index of its key (for ``pyarrow`` / pandas group-bys)."""
        if not len(self.keys):
            return pa.array([], pa.int64())
        # Every key has at least one row: the offsets after the first are strict run ends.
        runs = pa.RunEndEncodedArray.from_arrays(self.offsets[1:],
                                                 pa.array(range(len(self.keys)), pa.int64()))
        return pc.run_end_decode(runs)


class TimerService:
    """Timers of the current key (Flink's ``TimerService``); times in epoch milliseconds."""

    def __init__(self, context: Context) -> None:
        self._context = context

    def current_watermark(self) -> int:
        """The event-time watermark the batch runs at (epoch ms): the largest event time of the
        batches before, minus ``keyedstate.watermark.delay``."""
        return self._context.watermark

    def current_processing_time(self) -> int:
        """The processing time of this batch (epoch ms)."""
        return self._context.processing_time

    def register_event_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        """Fire ``on_timer`` for the current key (and ``namespace``) once the watermark reaches
        ``timestamp`` (ms); registering the same timer twice keeps one."""
        self._context.backend.timer_service.register_event_time_timer(timestamp, namespace)

    def delete_event_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        """Delete the current key's event-time timer at ``timestamp`` (and ``namespace``), if any."""
        self._context.backend.timer_service.delete_event_time_timer(timestamp, namespace)

    def register_processing_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        """Fire ``on_timer`` for the current key (and ``namespace``) at the first batch whose
        processing time reaches ``timestamp`` (ms); registering the same timer twice keeps one."""
        self._context.backend.timer_service.register_processing_time_timer(timestamp, namespace)

    def delete_processing_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        """Delete the current key's processing-time timer at ``timestamp`` (and ``namespace``), if
        any."""
        self._context.backend.timer_service.delete_processing_time_timer(timestamp, namespace)


class Context:
    """What a function sees: its state, the current key, timers, time, side outputs.

    One context per subtask and batch; ``current_key`` changes as keys are processed.
    """

    def __init__(self, backend: KeyedStateBackend, *, subtask_index: int, parallelism: int,
                 batch_id: int, watermark: int, processing_time: int) -> None:
        self.backend = backend
        self.subtask_index = subtask_index
        self.parallelism = parallelism
        self.batch_id = batch_id
        self.watermark = watermark
        self.processing_time = processing_time
        self.timer_service = TimerService(self)
        self.time_domain: TimeDomain | None = None
        self.side_outputs: dict[str, list[Row]] = {}

    @property
    def current_key(self) -> Any:
        """The current key: a scalar for one key column, a tuple for several."""
        return self.backend.get_current_key()

    @property
    def current_watermark(self) -> int:
        """The event-time watermark the batch runs at (epoch ms); ``timer_service`` has it too."""
        return self.watermark

    def get_state(self, descriptor: StateDescriptor[S]) -> S:
        """The state for ``descriptor``, scoped to the current key (call it in ``open``), of the
        descriptor's state class (``ValueStateDescriptor`` -> ``ValueState``)."""
        return self.backend.get_state(descriptor)

    def set_current_key(self, key: Any) -> None:
        """Make ``key`` (a key of this subtask's batch) current for the per-key state calls and
        the timer service, in :meth:`KeyedProcessFunction.process_batch` (where no key is
        current); the runtime sets the key itself before ``process_key`` and ``on_timer``.
        Raises ``KeyGroupRangeError`` for a key another subtask owns."""
        self.backend.set_current_key(key)

    def output(self, tag: str, row: Row) -> None:
        """Emit ``row`` to the side output ``tag`` (declared on the job)."""
        self.side_outputs.setdefault(tag, []).append(row)


class KeyedProcessFunction:
    """Subclass it and override :meth:`process_element` (per row), :meth:`process_key` (all of
    a key's rows of the batch at once) or :meth:`process_batch` (all keys of the subtask's
    batch at once, vectorized), and :meth:`on_timer` if you register timers.

    Contract: ``open`` is called once per subtask and batch before any other method, with the
    state registered there valid for the whole batch; ``close`` after the last one. Instances
    are pickled to the executors (with cloudpickle), so keep them small: state belongs in
    descriptors, not attributes. Exceptions stop the query with a ``BatchFailedError`` naming
    the batch, subtask and key, with the traceback from the method's frame down; the last
    committed checkpoint stays intact. Output rows have exactly the declared fields (``None``
    for a null), see docs/spark.md.
    """

    #: The local phase of a two-phase aggregation (:mod:`keyedstate.runtime.local_aggregation`):
    #: when set, e.g. ``LocalAggregation(events=Count(), amount=Sum("amount"))``, the runtime
    #: aggregates each batch's rows per key before they reach the function (in Spark's JVM, or
    #: with pyarrow in the local runtime), late rows split off first, and every method below
    #: receives one row per key and batch (the key columns, then the aggregate columns)
    #: instead of the raw rows. Checked at job start (``ConfigurationError``).
    local_aggregation: LocalAggregation | None = None

    def open(self, ctx: Context) -> None:
        """Register states here (``ctx.get_state``)."""

    def process_element(self, row: dict[str, Any], ctx: Context) -> Iterable[Row] | None:
        """One input row (a dict) of the current key; yield output rows."""
        raise NotImplementedError(
            f"{type(self).__name__} must override process_element or process_key"
        )

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> Iterable[Row] | None:
        """All rows of ``key`` in this batch (``rows.to_pandas()`` for pandas), in arrival
        order. The default calls :meth:`process_element` for each row."""
        out: list[Row] = []
        for row in rows.to_pylist():
            result = self.process_element(row, ctx)
            if result is not None:
                out.extend(result)
        return out

    def process_batch(self, batch: KeyedBatch, ctx: Context) -> Output:
        """All keys of this subtask's batch at once: the vectorized path, for functions that
        can be written over columns (counts, sums, feature aggregates).

        Contract: a function that overrides it is called once per subtask and batch that has
        rows, after ``open`` and the timers due (``on_timer``, per key as always) and after the
        late rows were split off, instead of ``process_key`` per key; a batch without rows
        (after late rows) does not call it. ``batch`` (:class:`KeyedBatch`) holds the
        distinct keys (``batch.keys``, ``batch.key_columns``), the rows sorted by key
        (``batch.rows``) and per-key offsets. Read and write state with the bulk calls over
        ``batch.keys`` (``ValueState.get_many`` / ``update_many``, ``ReducingState.add_many``,
        ``AggregatingState.add_many``, ``ListState.add_many``, ``MapState.get_many`` /
        ``put_many``, ``clear_many``; see :mod:`keyedstate.state.api`): they store exactly what
        the per-key calls store. No key is current here: a per-key state call or a timer
        registration needs ``ctx.set_current_key(key)`` first. Return an Arrow table (or
        record batch) with the output schema's columns (cast to its types; columns may come in
        any order, no other columns), or rows as ``process_key`` does; side outputs go through
        ``ctx.output``. An exception fails the batch (no key is named).

        The default runs :meth:`process_key` for each key in order (the runtime does the same
        itself for a function that doesn't override this method)."""
        out: list[Row] = []
        for index, key in enumerate(batch.keys.keys):
            ctx.set_current_key(key)
            result = self.process_key(key, batch.rows_of(index), ctx)
            if result is not None:
                out.extend(result)
        return out

    def on_timer(self, timestamp: int, ctx: Context) -> Iterable[Row] | None:
        """A timer of the current key fired (``ctx.time_domain`` tells which kind)."""
        return None

    def close(self) -> None:
        """Called after the batch; release what ``open`` acquired."""
