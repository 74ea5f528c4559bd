"""Two-phase (local-global) aggregation: a function's rows aggregated per key before it runs.

Flink SQL's ``table.optimizer.agg-phase-strategy: TWO_PHASE`` splits an aggregation into a
``LocalGroupAggregate`` before the shuffle and a ``GlobalGroupAggregate`` after it; Spark's own
streaming aggregation does the same (a partial aggregate per key and map task). A
:class:`~keyedstate.runtime.function.KeyedProcessFunction` that declares
``local_aggregation = LocalAggregation(events=Count(), amount=Sum("amount"))`` gets the local
phase from the runtime: each batch's rows are aggregated per key *before* they reach the
function, in Spark's JVM (:mod:`keyedstate.spark.local_aggregation`) or with pyarrow
(:func:`aggregate_table`, the local runtime), and the function (the global phase) receives one
row per key: the key columns, then the aggregate columns in declaration order.

The aggregates are a closed set that both runtimes compute alike: associative, commutative,
and (floating-point sums aside, whose last bits depend on the order of additions) independent
of how the rows are split: :class:`Count`, :class:`Sum`, :class:`Min`, :class:`Max`, with
SQL's null rules (nulls are skipped; a sum, min or max over no value is null).

With a watermark column the late rows (event time before the watermark) are split off *before*
the aggregation: they are counted and dropped (``keyedstate.late-events: drop``); the
aggregates cover the on-time rows only; a key whose rows were all late does not reach the
function; the watermark advances from the largest event time of all the rows, as without the
aggregation. ``keyedstate.late-events: side-output`` is refused at start: the late rows would
have to cross into Python one by one, the very thing the local phase avoids.

Per key the aggregated rows also carry hidden columns (``_ks_rows``: on-time rows; with a
watermark, ``_ks_late``: late rows, ``_ks_max_event_time``), which the subtask turns into its
statistics, late-row count and largest event time (:func:`split_aggregated`) and removes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from keyedstate.config import LateEvents
from keyedstate.errors import ConfigurationError
from keyedstate.runtime.event_time import event_time_ms

#: on-time rows per key (what the function would have received without the aggregation)
ROWS_COLUMN = "_ks_rows"
#: late rows per key (with a watermark column)
LATE_COLUMN = "_ks_late"
#: the largest event time per key, epoch ms, over all its rows (with a watermark column)
MAX_EVENT_TIME_COLUMN = "_ks_max_event_time"
HIDDEN_COLUMNS = (ROWS_COLUMN, LATE_COLUMN, MAX_EVENT_TIME_COLUMN)
RESERVED_PREFIX = "_ks_"


@dataclass(frozen=True)
class Aggregate:
    """One aggregate of a :class:`LocalAggregation` (use :class:`Count`, :class:`Sum`,
    :class:`Min` or :class:`Max`)."""

    #: the input column it reads (None: :class:`Count` of rows)
    column: str | None = None

    #: Spark's and pyarrow's name of the aggregate
    kind = ""

    def result_type(self, source: pa.DataType | None) -> pa.DataType:
        """The aggregate's type over a column of type ``source``; raises ``ValueError`` with
        the reason for a type it does not take."""
        raise NotImplementedError


@dataclass(frozen=True)
class Count(Aggregate):
    """Rows (``Count()``, SQL's ``count(*)``) or non-null values of ``column``
    (``Count("amount")``, SQL's ``count(amount)``) per key; bigint, never null."""

    kind = "count"

    def result_type(self, source: pa.DataType | None) -> pa.DataType:
        return pa.int64()


def _orderable(source: pa.DataType) -> bool:
    return (pa.types.is_integer(source) or pa.types.is_floating(source)
            or pa.types.is_timestamp(source) or pa.types.is_date(source)
            or pa.types.is_string(source) or pa.types.is_large_string(source))


@dataclass(frozen=True)
class Sum(Aggregate):
    """The sum of ``column`` per key: bigint for an integer column (as Spark's ``sum``),
    double for a floating one; null when the key has no non-null value. Integer sums beyond
    bigint fail on Spark in ANSI mode (Spark 4's default) and wrap with pyarrow: keep them in
    range. Floating sums may differ in their last bits between runs and runtimes (the order of
    additions depends on how the rows are split)."""

    kind = "sum"

    def result_type(self, source: pa.DataType | None) -> pa.DataType:
        if source is not None and pa.types.is_integer(source):
            return pa.int64()
        if source is not None and pa.types.is_floating(source):
            return pa.float64()
        raise ValueError(f"Sum takes an integer or floating-point column, not {source}")


class _Extreme(Aggregate):
    """Min and Max: of the column's type, over orderable columns only."""

    def result_type(self, source: pa.DataType | None) -> pa.DataType:
        if source is None or not _orderable(source):
            raise ValueError(f"{type(self).__name__} takes a number, timestamp, date or string "
                             f"column, not {source}")
        return source


@dataclass(frozen=True)
class Min(_Extreme):
    """The least value of ``column`` per key (numbers, timestamps, dates, strings), of the
    column's type; null when the key has no non-null value. NaN is larger than any number,
    as in Spark."""

    kind = "min"


@dataclass(frozen=True)
class Max(_Extreme):
    """The greatest value of ``column`` per key (numbers, timestamps, dates, strings), of the
    column's type; null when the key has no non-null value. NaN is larger than any number,
    as in Spark: a key with a NaN has the maximum NaN."""

    kind = "max"


class LocalAggregation:
    """What a function's rows are aggregated to, per key and batch, before it runs (the local
    phase of a two-phase aggregation; module docstring).

    ``LocalAggregation(events=Count(), amount=Sum("amount"), last=Max("ts"))``: each keyword
    names an output column and its :class:`Aggregate`. Declared as the class attribute
    ``local_aggregation`` of a :class:`~keyedstate.runtime.function.KeyedProcessFunction`,
    ``process_batch`` / ``process_key`` / ``process_element`` then receive one row per key and
    batch (the key columns, then these columns in this order) instead of the raw rows. A name
    starting with ``_ks_`` (reserved) or an aggregate of another type raises
    :class:`ConfigurationError` here; what depends on the input (unknown columns, types, names
    taken by a key column, the late-events setting) is checked at job start
    (:func:`check_local_aggregation`), before anything is restored or written. It pickles.
    """

    def __init__(self, **aggregates: Aggregate) -> None:
        if not aggregates:
            raise ConfigurationError(
                "LocalAggregation needs at least one aggregate, e.g. "
                "LocalAggregation(events=Count())")
        for name, aggregate in aggregates.items():
            if not isinstance(aggregate, Aggregate) or type(aggregate) is Aggregate:
                raise ConfigurationError(
                    f"LocalAggregation: {name}={aggregate!r} is not an aggregate; use Count(), "
                    f"Sum(column), Min(column) or Max(column)")
            if name.startswith(RESERVED_PREFIX):
                raise ConfigurationError(
                    f"LocalAggregation: the name {name!r} starts with {RESERVED_PREFIX!r}, "
                    f"which keyedstate reserves for its own columns; choose another")
            if not isinstance(aggregate, Count) and not aggregate.column:
                raise ConfigurationError(
                    f"LocalAggregation: {name}={aggregate!r} names no column")
        #: (output column, aggregate), in declaration order
        self.aggregates: tuple[tuple[str, Aggregate], ...] = tuple(aggregates.items())
        # Where it was declared, for the errors of the checks at job start (they run far
        # from the user's code).
        caller = sys._getframe(1)
        #: ``file:line`` of the declaration
        self.declared_at = f"{caller.f_code.co_filename}:{caller.f_lineno}"

    @property
    def names(self) -> list[str]:
        """The aggregate columns, in declaration order."""
        return [name for name, _ in self.aggregates]

    def output_schema(self, input_schema: pa.Schema, key_columns: Sequence[str]) -> pa.Schema:
        """The rows the function receives: the key columns, then the aggregates (unchecked:
        :func:`check_local_aggregation` first)."""
        fields = [input_schema.field(c) for c in key_columns]
        for name, aggregate in self.aggregates:
            source = (input_schema.field(aggregate.column).type
                      if aggregate.column is not None else None)
            fields.append(pa.field(name, aggregate.result_type(source)))
        return pa.schema(fields)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalAggregation) and self.aggregates == other.aggregates

    def __hash__(self) -> int:
        return hash(self.aggregates)

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={aggregate!r}" for name, aggregate in self.aggregates)
        return f"LocalAggregation({inner})"


def local_aggregation_of(function: Any) -> LocalAggregation | None:
    """The local aggregation ``function`` declares (its ``local_aggregation``), or None;
    raises :class:`ConfigurationError` for anything else there."""
    declared = getattr(function, "local_aggregation", None)
    if declared is None or isinstance(declared, LocalAggregation):
        return declared
    raise ConfigurationError(
        f"{type(function).__name__}.local_aggregation is {declared!r}; it must be a "
        f"LocalAggregation or None")


def check_local_aggregation(function: Any, input_schema: pa.Schema, key_columns: Sequence[str],
                            *, watermark_column: str | None, late_events: LateEvents
                            ) -> LocalAggregation | None:
    """The job-start check of ``function``'s local aggregation against the input (both
    runtimes call it before restoring or writing anything); returns it (None: none declared).

    Raises :class:`ConfigurationError`, naming where the aggregation was declared, for an
    aggregate column named like a key column, an aggregate over a column the input lacks or of
    a type it does not take (:meth:`Aggregate.result_type`), and for
    ``keyedstate.late-events: side-output`` with a watermark column (module docstring)."""
    aggregation = local_aggregation_of(function)
    if aggregation is None:
        return None
    where = f"{type(function).__name__}.local_aggregation (declared at {aggregation.declared_at})"
    for name, aggregate in aggregation.aggregates:
        if name in key_columns:
            raise ConfigurationError(
                f"{where}: the aggregate column {name!r} has the name of a key column; the "
                f"function receives the key columns {list(key_columns)} beside the aggregates: "
                f"choose another name")
        if aggregate.column is None:
            continue
        if aggregate.column not in input_schema.names:
            raise ConfigurationError(
                f"{where}: {name}={aggregate!r} reads the column {aggregate.column!r}, which the "
                f"input does not have; its columns are {input_schema.names}")
        try:
            aggregate.result_type(input_schema.field(aggregate.column).type)
        except ValueError as exc:
            raise ConfigurationError(f"{where}: {name}={aggregate!r}: {exc}") from None
    if watermark_column and late_events is LateEvents.SIDE_OUTPUT:
        raise ConfigurationError(
            f"{where}: keyedstate.late-events is side-output, but with a local aggregation the "
            f"late rows are counted and dropped before the aggregation (sending them to a side "
            f"output would hand every late row to Python, which the aggregation avoids); set "
            f"keyedstate.late-events: drop, or aggregate in the function")
    return aggregation


def aggregate_table(table: pa.Table, key_columns: Sequence[str], aggregation: LocalAggregation,
                    *, watermark: int, watermark_column: str | None) -> pa.Table:
    """The local phase with pyarrow (the local runtime): ``table``'s rows aggregated per key,
    one row per key (in order of first appearance): the key columns, the aggregates over the
    on-time rows, then the hidden columns (module docstring). Null keys are one key, as in
    Spark's ``groupBy``. The same as :func:`keyedstate.spark.local_aggregation.aggregate`
    computes in Spark's JVM."""
    keys = list(key_columns)
    columns: dict[str, pa.ChunkedArray] = {c: table.column(c) for c in keys}
    on_time: pa.ChunkedArray | None = None
    if watermark_column:
        event_ms = event_time_ms(table.column(watermark_column))
        mark = pa.scalar(watermark, pa.int64())
        # A row without an event time is never late (as in the raw path, which keeps it when
        # its subtask has no late rows).
        on_time = pc.fill_null(pc.greater_equal(event_ms, mark), True)
        columns["_ks_in_late"] = pc.fill_null(pc.less(event_ms, mark), False).cast(pa.int64())
        columns["_ks_in_event_ms"] = event_ms
        columns["_ks_in_rows"] = on_time.cast(pa.int64())
    specs: list[tuple[Any, ...]] = []
    # output column -> (pyarrow's result column, declared type); NaN flags of the maxima
    results: dict[str, tuple[str, pa.DataType]] = {}
    nan_flags: dict[str, str] = {}
    for i, (name, aggregate) in enumerate(aggregation.aggregates):
        source = table.column(aggregate.column) if aggregate.column is not None else None
        result_type = aggregate.result_type(None if source is None else source.type)
        if source is None:  # Count(): rows, on time
            if on_time is None:
                specs.append(([], "count_all"))
                results[name] = ("count_all", result_type)
            else:
                specs.append(("_ks_in_rows", "sum"))
                results[name] = ("_ks_in_rows_sum", result_type)
            continue
        column = f"_ks_in_{i}"
        columns[column] = source if on_time is None else pc.if_else(on_time, source, None)
        options: Any
        if isinstance(aggregate, Count):
            options = pc.CountOptions(mode="only_valid")
        else:
            options = pc.ScalarAggregateOptions(skip_nulls=True, min_count=1)
        specs.append((column, aggregate.kind, options))
        results[name] = (f"{column}_{aggregate.kind}", result_type)
        if isinstance(aggregate, Max) and pa.types.is_floating(source.type):
            # Arrow's max skips NaN; Spark's takes it as larger than any number.
            flag = f"_ks_nan_{i}"
            columns[flag] = pc.fill_null(pc.is_nan(columns[column]), False)
            specs.append((flag, "any"))
            nan_flags[name] = f"{flag}_any"
    if on_time is None:
        specs.append(([], "count_all"))
        hidden = {ROWS_COLUMN: "count_all"}
    else:
        specs += [("_ks_in_rows", "sum"), ("_ks_in_late", "sum"), ("_ks_in_event_ms", "max")]
        hidden = {ROWS_COLUMN: "_ks_in_rows_sum", LATE_COLUMN: "_ks_in_late_sum",
                  MAX_EVENT_TIME_COLUMN: "_ks_in_event_ms_max"}
    # Each spec once (Count() and the hidden row count may be the same one).
    unique = list({repr(s[:2]): s for s in specs}.values())
    grouped = pa.table(columns).group_by(keys, use_threads=False).aggregate(unique)
    out: dict[str, pa.ChunkedArray] = {c: grouped.column(c) for c in keys}
    for name, (column, result_type) in results.items():
        value = grouped.column(column)
        if name in nan_flags:
            value = pc.if_else(grouped.column(nan_flags[name]),
                               pa.scalar(float("nan"), value.type), value)
        out[name] = value.cast(result_type)
    for name, column in hidden.items():
        out[name] = grouped.column(column).cast(pa.int64())
    return pa.table(out)


@dataclass(frozen=True)
class Aggregated:
    """A subtask's aggregated rows split into what the function gets and what the subtask
    reports (:func:`split_aggregated`)."""

    #: one row per key with at least one on-time row: key and aggregate columns only
    table: pa.Table
    #: on-time events (what ``rows_in`` counts without an aggregation)
    rows_in: int
    #: late events, counted and dropped before the aggregation
    late: int
    #: the largest event time of all the rows, epoch ms (None: none, or no watermark column)
    max_event_time: int | None


def split_aggregated(table: pa.Table) -> Aggregated:
    """The hidden columns of aggregated rows (:func:`aggregate_table`, or Spark's) turned into
    the subtask's figures, and the rows the function receives: those of keys with on-time
    rows, hidden columns removed."""
    rows = table.column(ROWS_COLUMN)
    late = pc.sum(table.column(LATE_COLUMN)).as_py() if LATE_COLUMN in table.column_names \
        else 0
    max_event_time = (pc.max(table.column(MAX_EVENT_TIME_COLUMN)).as_py()
                      if MAX_EVENT_TIME_COLUMN in table.column_names else None)
    kept = table.filter(pc.greater(rows, 0))
    kept = kept.drop_columns([c for c in HIDDEN_COLUMNS if c in kept.column_names])
    return Aggregated(kept, pc.sum(rows).as_py() or 0, late or 0, max_event_time)
