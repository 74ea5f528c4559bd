"""The local phase of a two-phase aggregation in Spark's JVM (the driver's side of
:mod:`keyedstate.runtime.local_aggregation`): a batch's rows aggregated per key with DataFrame
operations before they are routed, so that one row per key, not every row, crosses into Python.

Spark plans ``groupBy(keys).agg(...)`` as its own streaming aggregation is planned: a partial
aggregate per key in each map task, a shuffle of the partial aggregates, the final aggregate;
routing the result (:func:`~keyedstate.spark.routing.route`) shuffles the aggregated rows once
more, one per key. Why this order and not the routing columns first: docs/spark.md, "Local
aggregation".
"""

from __future__ import annotations

from typing import Any, Sequence

from keyedstate.errors import ConfigurationError
from keyedstate.runtime.local_aggregation import (
    LATE_COLUMN,
    MAX_EVENT_TIME_COLUMN,
    ROWS_COLUMN,
    Count,
    LocalAggregation,
    Max,
    Min,
    Sum,
)


def check_event_time(schema: Any, watermark_column: str | None,
                     aggregation: LocalAggregation | None) -> None:
    """Refuse, at job start, a watermark column whose event time the JVM can't compute as the
    subtask does (``ConfigurationError``): with a local aggregation the late rows are split off
    in the JVM; a ``timestamp_ntz`` column's epoch milliseconds depend on the session's time
    zone there."""
    if aggregation is None or not watermark_column:
        return
    from pyspark.sql.types import IntegralType, TimestampType

    data_type = schema[watermark_column].dataType
    if not isinstance(data_type, (TimestampType, IntegralType)):
        raise ConfigurationError(
            f"the watermark column {watermark_column!r} is {data_type.simpleString()}; with a "
            f"local aggregation ({aggregation.declared_at}) it must be a timestamp or an "
            f"integer of epoch milliseconds")


def aggregate(df: Any, key_columns: Sequence[str], aggregation: LocalAggregation, *,
              watermark: int, watermark_column: str | None) -> Any:
    """``df``'s rows aggregated per key: the key columns, the aggregates over the on-time rows,
    then the hidden columns (on-time rows, and with a watermark column late rows and the
    largest event time), exactly as
    :func:`~keyedstate.runtime.local_aggregation.aggregate_table` computes them with pyarrow."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegralType, TimestampType

    on_time: Any = None
    event_ms: Any = None
    late: Any = None
    if watermark_column:
        column = f"`{watermark_column}`"
        is_timestamp = isinstance(df.schema[watermark_column].dataType, TimestampType)
        # Epoch ms as the subtask computes them (runtime/event_time.py: truncating division).
        event_ms = F.expr(f"unix_micros({column}) div 1000" if is_timestamp
                          else f"cast({column} as bigint)")
        mark = F.lit(watermark).cast("bigint")
        # A row without an event time is never late.
        on_time = F.coalesce(event_ms >= mark, F.lit(True))
        late = F.coalesce(event_ms < mark, F.lit(False))

    def on_time_only(value: Any) -> Any:
        return value if on_time is None else F.when(on_time, value)

    columns = []
    for name, agg in aggregation.aggregates:
        if agg.column is None:
            columns.append(F.count(on_time_only(F.lit(1))).alias(name))
            continue
        value = on_time_only(F.col(f"`{agg.column}`"))
        if isinstance(agg, Count):
            columns.append(F.count(value).alias(name))
        elif isinstance(agg, Sum):
            # Sum.result_type: bigint over integers, double over floating point.
            integral = isinstance(df.schema[agg.column].dataType, IntegralType)
            columns.append(F.sum(value).cast("bigint" if integral else "double").alias(name))
        elif isinstance(agg, Min):
            columns.append(F.min(value).alias(name))
        elif isinstance(agg, Max):
            columns.append(F.max(value).alias(name))
        else:  # the closed set: check_local_aggregation refused anything else
            raise ConfigurationError(f"unknown aggregate {agg!r}")
    columns.append(F.count(on_time_only(F.lit(1))).alias(ROWS_COLUMN))
    if watermark_column:
        columns.append(F.count(F.when(late, F.lit(1))).alias(LATE_COLUMN))
        columns.append(F.max(event_ms).alias(MAX_EVENT_TIME_COLUMN))
    return df.groupBy(*[F.col(f"`{c}`") for c in key_columns]).agg(*columns)

