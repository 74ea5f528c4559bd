"""Routing a batch's rows to the Spark tasks of their subtasks, as JVM expressions: each row's
key group is Spark's ``pmod(xxhash64(key columns), maxP)`` (:mod:`keyedstate.keys` computes the
same in Python), its subtask ``key_group * p div maxP``, and Spark task ``t`` of ``spark_tasks``
gets the rows of the subtasks it runs (:func:`~keyedstate.runtime.grouping.subtasks_of_task`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from keyedstate.runtime.wire import KG_COLUMN, SUBTASK_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def with_routing_columns(df: DataFrame, key_columns: list[str], parallelism: int,
                         max_parallelism: int) -> DataFrame:
    """``df`` with each row's key group and subtask columns (JVM expressions)."""
    from pyspark.sql import functions as F

    p, max_p = parallelism, max_parallelism
    cols = ", ".join(f"`{c}`" for c in key_columns)
    return (df.withColumn(KG_COLUMN, F.expr(f"cast(pmod(xxhash64({cols}), {max_p}) as int)"))
              .withColumn(SUBTASK_COLUMN, F.expr(f"cast({KG_COLUMN} * {p} div {max_p} as int)")))


def task_of_subtask(parallelism: int, spark_tasks: int) -> str:
    """The SQL expression of the Spark task that runs a row's subtask."""
    return f"cast({SUBTASK_COLUMN} * {spark_tasks} div {parallelism} as int)"


def route(df: DataFrame, key_columns: list[str], parallelism: int, max_parallelism: int,
          spark_tasks: int) -> DataFrame:
    """``df``'s rows with their key group and subtask (JVM expressions), partitioned so that
    Spark task ``t`` gets the rows of the subtasks it runs (:func:`subtasks_of_task`)."""
    from pyspark.sql import functions as F

    return (with_routing_columns(df, key_columns, parallelism, max_parallelism)
            .repartitionById(spark_tasks, F.expr(task_of_subtask(parallelism, spark_tasks))))
