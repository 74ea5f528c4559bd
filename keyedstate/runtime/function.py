"""The user-facing processing API: a keyed process function and its context.

Flink users know it as ``KeyedProcessFunction``; PySpark users get Arrow / pandas batches per
key. Output rows are dicts (column name -> value) or tuples in the declared schema's order,
*yielded* by the methods (``return`` of a list works too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import pyarrow as pa

from keyedstate.state.descriptors import S, StateDescriptor
from keyedstate.state.timers import TimeDomain

if TYPE_CHECKING:
    from keyedstate.backends.base.backend import KeyedStateBackend

Row = dict[str, Any] | tuple[Any, ...]


class TimerService:
    """Timers of the current key (Flink's ``TimerService``); times in epoch milliseconds."""

    def __init__(self, context: Context) -> None:
        self._context = context

    def current_watermark(self) -> int:
        return self._context.watermark

    def current_processing_time(self) -> int:
        return self._context.processing_time

    def register_event_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self._context.backend.timer_service.register_event_time_timer(timestamp, namespace)

    def delete_event_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self._context.backend.timer_service.delete_event_time_timer(timestamp, namespace)

    def register_processing_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self._context.backend.timer_service.register_processing_time_timer(timestamp, namespace)

    def delete_processing_time_timer(self, timestamp: int, namespace: Any = None) -> None:
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
        return self.watermark

    def get_state(self, descriptor: StateDescriptor[S]) -> S:
        """The state for ``descriptor``, scoped to the current key (call it in ``open``), of the
        descriptor's state class (``ValueStateDescriptor`` -> ``ValueState``)."""
        return self.backend.get_state(descriptor)

    def output(self, tag: str, row: Row) -> None:
        """Emit ``row`` to the side output ``tag`` (declared on the job)."""
        self.side_outputs.setdefault(tag, []).append(row)


class KeyedProcessFunction:
    """Subclass it and override :meth:`process_element` (per row) or :meth:`process_key`
    (all of a key's rows of the batch at once), and :meth:`on_timer` if you register timers.

    Contract: ``open`` is called once per subtask and batch before any other method, with the
    state registered there valid for the whole batch; ``close`` after the last one. Instances
    are pickled to the executors (with cloudpickle), so keep them small: state belongs in
    descriptors, not attributes. Exceptions stop the query with a ``BatchFailedError`` naming
    the batch, subtask and key, with the traceback from the method's frame down; the last
    committed checkpoint stays intact. Output rows have exactly the declared fields (``None``
    for a null), see docs/spark.md.
    """

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

    def on_timer(self, timestamp: int, ctx: Context) -> Iterable[Row] | None:
        """A timer of the current key fired (``ctx.time_domain`` tells which kind)."""
        return None

    def close(self) -> None:
        """Called after the batch; release what ``open`` acquired."""
