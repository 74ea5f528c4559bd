"""The local phase of a two-phase aggregation in Spark's JVM (the driver's side of
:mod:`keyedstate.runtime.local_aggregation`): a batch's rows aggregated per key with DataFrame
operations as they are routed (:func:`aggregate_and_route`), so that one row per key, not
every row, crosses into Python. Its plans (:data:`PLANS`), and why the runtime runs Spark's
partial aggregate before the shuffle: docs/spark.md, "Two-phase aggregation".
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Sequence

from keyedstate.config import LocalAggregationPlan
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
from keyedstate.runtime.wire import KG_COLUMN, SUBTASK_COLUMN
from keyedstate.spark.routing import route, task_of_subtask, with_routing_columns

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import StructType


def check_event_time(schema: StructType, watermark_column: str | None,
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


def _aggregate_columns(df: DataFrame, aggregation: LocalAggregation, *, watermark: int,
                       watermark_column: str | None) -> list[Column]:
    """The aggregate columns over ``df``'s rows of one key: the declared aggregates over the
    on-time rows, then the hidden columns (on-time rows, and with a watermark column late rows
    and the largest event time), exactly as
    :func:`~keyedstate.runtime.local_aggregation.aggregate_table` computes them with pyarrow."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegralType, TimestampType

    on_time: Column | None = None
    # With a watermark column, after the on-time rows: late rows, the largest event time.
    event_time_columns: list[Column] = []
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
        event_time_columns = [F.count(F.when(late, F.lit(1))).alias(LATE_COLUMN),
                              F.max(event_ms).alias(MAX_EVENT_TIME_COLUMN)]

    def on_time_only(value: Column) -> Column:
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
    return columns + event_time_columns


#: the hidden column that hash-partitions a row into its Spark task (:func:`partition_tags`)
TASK_TAG_COLUMN = "_ks_task_tag"


def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF


def spark_hash_int(value: int, seed: int = 42) -> int:
    """Spark's ``hash()`` of an int (``Murmur3Hash``, seed 42: Murmur3 x86_32 of 4 bytes), the
    hash a ``HashPartitioning`` puts a row in partition ``pmod(hash, partitions)`` with."""
    k1 = _rotl32((value & 0xFFFFFFFF) * 0xCC9E2D51 & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
    h1 = (_rotl32(seed ^ k1, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & 0xFFFFFFFF
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & 0xFFFFFFFF
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


@lru_cache(maxsize=64)
def partition_tags(partitions: int) -> tuple[int, ...]:
    """For each partition ``t`` of ``partitions``, the least int whose Spark hash lands in
    ``t``: rows tagged with ``tags[t]`` and hash-partitioned by the tag go to partition ``t``."""
    tags: dict[int, int] = {}
    value = 0
    while len(tags) < partitions:
        tags.setdefault(spark_hash_int(value) % partitions, value)
        value += 1
    return tuple(tags[t] for t in range(partitions))


#: ``groupBy(keys).agg(...)``, which Spark splits around its shuffle as it
#: splits its own aggregation (a partial aggregate in every map task, the shuffle of one row
#: per key and map task, the final aggregate), then :func:`route` of the aggregated rows (a
#: second shuffle, of one row per key).
PARTIAL_AGGREGATE = LocalAggregationPlan.PARTIAL_AGGREGATE.value
#: The default plan: the raw rows shuffled once into their Spark tasks
#: (:func:`partition_by_task`) and aggregated after the shuffle.
SHUFFLE_THEN_AGGREGATE = LocalAggregationPlan.SHUFFLE_THEN_AGGREGATE.value
#: :func:`aggregate_and_route`'s plans (``keyedstate.local-aggregation.plan``)
PLANS = tuple(plan.value for plan in LocalAggregationPlan)


def partition_by_task(df: DataFrame, key_columns: Sequence[str], parallelism: int,
                      max_parallelism: int, spark_tasks: int) -> DataFrame:
    """``df``'s rows with their routing columns and task tag, hash-partitioned by the tag
    (``repartition(n, tag)``, one shuffle): partition ``t`` holds the rows of Spark task
    ``t``'s subtasks, and a ``groupBy`` that includes the tag is satisfied by this partitioning
    (no second shuffle). Each row is tagged with the int whose Spark hash puts it in its Spark
    task's partition (:func:`partition_tags`)."""
    from pyspark.sql import functions as F

    tags = ", ".join(str(t) for t in partition_tags(spark_tasks))
    task = task_of_subtask(parallelism, spark_tasks)
    return (with_routing_columns(df, list(key_columns), parallelism, max_parallelism)
            .withColumn(TASK_TAG_COLUMN, F.expr(f"element_at(array({tags}), {task} + 1)"))
            .repartition(spark_tasks, TASK_TAG_COLUMN))


def aggregate_and_route(df: DataFrame, key_columns: Sequence[str], aggregation: LocalAggregation,
                        parallelism: int, max_parallelism: int, spark_tasks: int, *,
                        watermark: int, watermark_column: str | None,
                        plan: str = SHUFFLE_THEN_AGGREGATE) -> DataFrame:
    """``df``'s rows aggregated per key and routed: the key columns, the key group and subtask
    columns and :func:`_aggregate_columns` (in an order that depends on the plan: read them by
    name), partitioned as :func:`~keyedstate.spark.routing.route` partitions rows. The tasks
    check that every row they get is of their subtasks (:mod:`keyedstate.spark.tasks`).

    ``plan`` :data:`PARTIAL_AGGREGATE`: ``groupBy(keys).agg(...)``, then the
    routing columns of the aggregated rows and ``route()``. ``explain()``: a
    ``HashAggregate`` of ``partial_`` functions in the stage that reads the rows, an
    ``Exchange hashpartitioning(keys)`` of one row per key and map task, the final
    ``HashAggregate``, the routing ``Exchange`` of one row per key. The first shuffle has
    ``spark.sql.shuffle.partitions`` partitions, as Spark's own aggregation (adaptive
    execution coalesces them); the routing shuffle has one per Spark task.

    ``plan`` :data:`SHUFFLE_THEN_AGGREGATE` (the default): :func:`partition_by_task`, then a ``groupBy``
    that includes the tag, which that partitioning satisfies: one ``Exchange
    hashpartitioning(tag)`` of the raw rows, the ``HashAggregate`` after it. Another plan
    raises :class:`ConfigurationError`.
    """
    from pyspark.sql import functions as F

    keys = list(key_columns)
    columns = _aggregate_columns(df, aggregation, watermark=watermark,
                                 watermark_column=watermark_column)
    key_cols = [F.col(f"`{c}`") for c in keys]
    if plan == PARTIAL_AGGREGATE:
        return route(df.groupBy(*key_cols).agg(*columns), keys, parallelism, max_parallelism,
                     spark_tasks)
    if plan == SHUFFLE_THEN_AGGREGATE:
        grouping = [F.col(TASK_TAG_COLUMN), *key_cols, F.col(KG_COLUMN), F.col(SUBTASK_COLUMN)]
        return (partition_by_task(df, keys, parallelism, max_parallelism, spark_tasks)
                .groupBy(*grouping).agg(*columns).drop(TASK_TAG_COLUMN))
    raise ConfigurationError(f"unknown local aggregation plan {plan!r}; the plans are {PLANS}")
