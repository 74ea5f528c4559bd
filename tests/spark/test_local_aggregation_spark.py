"""Two-phase (local-global) aggregation on Spark: the rows aggregated per key in the JVM before
they are routed, checked against pandas across batches and a restart at another parallelism;
the late-row split before the aggregation; the start-time checks (nothing written)."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd
import pytest

from keyedstate import Count, LocalAggregation
from keyedstate.config import JobConfig
from keyedstate.errors import ConfigurationError
from keyedstate.spark.api import key_by
from keyedstate.spark.sinks import ParquetSink
from tests.spark.jobs import (
    TWO_PHASE_INPUT,
    TWO_PHASE_SCHEMA,
    TwoPhasePerKeyTotals,
    TwoPhaseTotals,
    file_stream,
    two_phase_batches,
    two_phase_oracle,
    write_batch_file,
)

pytestmark = pytest.mark.spark


def run(spark: Any, root: str, fn: Any, parallelism: int, backend: str, events: Any = None,
        **config: Any) -> Any:
    events = events if events is not None else (
        spark.readStream.schema(TWO_PHASE_INPUT).option("maxFilesPerTrigger", 1)
        .parquet(os.path.join(root, "input")))
    job = key_by(events, "user_id").process(fn, TWO_PHASE_SCHEMA)
    job.sink(ParquetSink(os.path.join(root, "out")))
    settings = dict(checkpoint_dir=os.path.join(root, "ckpt"), parallelism=parallelism,
                    backend=backend, watermark_column="ts", watermark_delay=1000,
                    late_events="drop")
    query = job.start(JobConfig(**{**settings, **config}), trigger={"availableNow": True},
                      spark_checkpoint_location=os.path.join(root, "spark"))
    query.await_termination()
    query.stop()
    return query


@pytest.mark.parametrize("backend, function", [("rocksdb", TwoPhaseTotals),
                                               ("heap", TwoPhasePerKeyTotals)])
def test_two_phase_totals_match_pandas_across_a_restart(spark, tmp_path, backend, function):
    root = str(tmp_path)
    data = two_phase_batches(5)
    expected, late = two_phase_oracle(data, delay_ms=1000)
    assert sum(late[:3]) > 0 and sum(late[3:]) > 0
    for n, table in enumerate(data[:3]):
        write_batch_file(os.path.join(root, "input"), n, table)
    first = run(spark, root, function(), parallelism=2, backend=backend)
    # A restart in the same locations, at another parallelism: state and watermark restored.
    for n, table in enumerate(data[3:], start=3):
        write_batch_file(os.path.join(root, "input"), n, table)
    second = run(spark, root, function(), parallelism=3, backend=backend)

    out = pd.read_parquet(os.path.join(root, "out"))
    got = [sorted(tuple(r) for r in out[out.batch_id == b][
        ["user_id", "count", "cents", "last_ms", "batch_id"]].itertuples(index=False))
        for b in range(5)]
    assert got == expected
    stats = [s for q in (first, second) for s in q.stats if s.checkpoint_id >= 0]
    assert [s.late_events for s in stats] == late
    # rows_in: the events into the function; function_rows: the aggregated rows (one per key).
    assert [s.rows_in for s in stats] == [len(t) - n for t, n in zip(data, late)]
    assert [s.function_rows for s in stats] == [len(rows) for rows in expected]


def test_the_partial_aggregate_plan_gives_the_same_totals(spark, tmp_path):
    """keyedstate.local-aggregation.plan: partial-aggregate (aggregated in every map task,
    then routed): pandas' totals and late rows, as the default plan gives them."""
    root = str(tmp_path)
    data = two_phase_batches(3, seed=7)
    expected, late = two_phase_oracle(data, delay_ms=1000)
    assert sum(late) > 0
    events = file_stream(spark, os.path.join(root, "input"), data, TWO_PHASE_INPUT)
    query = run(spark, root, TwoPhaseTotals(), parallelism=3, backend="heap", events=events,
                local_aggregation_plan="partial-aggregate")
    out = pd.read_parquet(os.path.join(root, "out"))
    got = [sorted(tuple(r) for r in out[out.batch_id == b][
        ["user_id", "count", "cents", "last_ms", "batch_id"]].itertuples(index=False))
        for b in range(3)]
    assert got == expected
    assert [s.late_events for s in query.stats if s.checkpoint_id >= 0] == late


def test_the_same_function_gives_the_same_output_on_both_runtimes(spark, tmp_path):
    """The pyarrow aggregation (local runtime) and the JVM's give one result, without a
    watermark too."""
    from tests.runtime.test_local_aggregation import main_rows, new_job, two_phase_config

    data = two_phase_batches(3, seed=5)
    events = file_stream(spark, str(tmp_path / "input"), data, TWO_PHASE_INPUT)
    run(spark, str(tmp_path), TwoPhaseTotals(), parallelism=2, backend="rocksdb",
        events=events, watermark_column=None)
    out = pd.read_parquet(str(tmp_path / "out"))
    on_spark = [sorted(tuple(r) for r in out[out.batch_id == b][
        ["user_id", "count", "cents", "last_ms", "batch_id"]].itertuples(index=False))
        for b in range(3)]
    with new_job(two_phase_config(tmp_path / "local", watermark_column=None)) as job:
        assert [main_rows(job.process_batch(t)) for t in data] == on_spark


def _declaring(aggregation: Any) -> Any:
    class Declares(TwoPhaseTotals):
        local_aggregation = aggregation

    return Declares()


def test_an_aggregate_of_a_column_the_input_lacks_is_refused_at_process(spark, tmp_path):
    events = file_stream(spark, str(tmp_path / "input"), two_phase_batches(1), TWO_PHASE_INPUT)
    with pytest.raises(ConfigurationError, match="'amount', which the input does not have"):
        key_by(events, "user_id").process(_declaring(LocalAggregation(n=Count("amount"))),
                                          TWO_PHASE_SCHEMA)


def test_the_start_refuses_late_rows_to_a_side_output_and_writes_nothing(spark, tmp_path):
    root = str(tmp_path)
    events = file_stream(spark, os.path.join(root, "input"), two_phase_batches(1),
                         TWO_PHASE_INPUT)
    with pytest.raises(ConfigurationError, match="late-events is side-output") as error:
        run(spark, root, TwoPhaseTotals(), parallelism=2, backend="rocksdb", events=events,
            late_events="side-output")
    assert "jobs.py" in str(error.value)  # where the aggregation was declared
    assert not os.path.exists(os.path.join(root, "ckpt")) \
        or not os.listdir(os.path.join(root, "ckpt"))
    assert not os.path.exists(os.path.join(root, "out"))


def test_partition_tags_land_in_their_partitions_as_spark_hashes_them(spark):
    """spark_hash_int is Spark's hash() of an int, so a row tagged partition_tags(n)[t] and
    hash-partitioned by the tag lands in partition t."""
    from keyedstate.spark.local_aggregation import partition_tags, spark_hash_int

    values = [-(1 << 31), -7, -1, 0, 1, 2, 3, 42, 1000, (1 << 31) - 1]
    got = spark.createDataFrame([(v,) for v in values], "v int").selectExpr("v", "hash(v) h")
    assert {r["v"]: r["h"] for r in got.collect()} == {v: spark_hash_int(v) for v in values}
    for n in (1, 2, 3, 8, 17):
        tags = partition_tags(n)
        placed = (spark.createDataFrame([(t, i) for i, t in enumerate(tags)], "tag int, task int")
                  .repartition(n, "tag").selectExpr("task", "spark_partition_id() p").collect())
        assert sorted((r["task"], r["p"]) for r in placed) == [(t, t) for t in range(n)]


def test_the_aggregation_runs_after_the_one_shuffle_that_routes_the_rows(spark, tmp_path):
    """The shuffle-then-aggregate plan (keyedstate.local-aggregation.plan): explain() has a
    single Exchange (hash-partitioned by the task tag) and the aggregation after it; every
    aggregated row is in its subtask's Spark task."""
    from pyspark.sql import functions as F

    from keyedstate.runtime.grouping import subtasks_of_task
    from keyedstate.runtime.wire import SUBTASK_COLUMN
    from keyedstate.spark.local_aggregation import SHUFFLE_THEN_AGGREGATE, aggregate_and_route

    data = two_phase_batches(1, events=2000, users=200)[0]
    df = spark.createDataFrame(data.to_pandas(), TWO_PHASE_INPUT)
    routed = aggregate_and_route(df, ["user_id"], TwoPhaseTotals.local_aggregation, 5, 128, 3,
                                 watermark=0, watermark_column="ts",
                                 plan=SHUFFLE_THEN_AGGREGATE)
    plan = routed._jdf.queryExecution().executedPlan().toString()
    assert plan.count("Exchange") == 1 and "HashAggregate" in plan
    placed = routed.select("user_id", SUBTASK_COLUMN,
                           F.spark_partition_id().alias("task")).collect()
    assert len(placed) == 200
    assert all(r[SUBTASK_COLUMN] in subtasks_of_task(r["task"], 3, 5) for r in placed)


def _shuffle_records(df: Any) -> list[int]:
    """The rows each shuffle of ``df``'s last run wrote (Spark's SQL metric
    ``shuffleRecordsWritten`` of every ``ShuffleExchangeExec``), sorted; through adaptive
    execution's final plan and its query stages."""
    records, nodes = [], [df._jdf.queryExecution().executedPlan()]
    while nodes:
        node = nodes.pop()
        name = node.getClass().getSimpleName()
        if name == "AdaptiveSparkPlanExec":
            nodes.append(node.executedPlan())
            continue
        if name.endswith("QueryStageExec"):
            nodes.append(node.plan())
            continue
        if name == "ShuffleExchangeExec":
            records.append(node.metrics().apply("shuffleRecordsWritten").value())
        children = node.children()
        nodes.extend(children.apply(i) for i in range(children.size()))
    return sorted(records)


def _partitioned(spark: Any, table: Any, partitions: int) -> Any:
    """``table`` as a DataFrame of ``partitions`` input partitions (no shuffle before them)."""
    rows = [tuple(r.values()) for r in table.to_pylist()]
    return spark.createDataFrame(spark.sparkContext.parallelize(rows, partitions),
                                 TWO_PHASE_INPUT)


def test_the_partial_aggregate_runs_before_the_shuffle(spark):
    """partial-aggregate aggregates in every map task before anything is shuffled: the first
    shuffle carries one row per key and input partition, the routing shuffle one row per key
    (Spark's SQL metrics), where the default shuffle-then-aggregate shuffles every row;
    explain() shows the partial aggregate below every Exchange. Every aggregated row is in its subtask's Spark
    task."""
    from pyspark.sql import functions as F

    from keyedstate.runtime.grouping import subtasks_of_task
    from keyedstate.runtime.wire import SUBTASK_COLUMN
    from keyedstate.spark.local_aggregation import (
        PARTIAL_AGGREGATE,
        SHUFFLE_THEN_AGGREGATE,
        aggregate_and_route,
    )

    data = two_phase_batches(1, events=2000, users=200)[0]
    df = _partitioned(spark, data, 3)
    pairs = df.select(F.spark_partition_id().alias("p"), "user_id").distinct().count()
    keys = df.select("user_id").distinct().count()
    assert keys < pairs < 2000

    def routed(plan: str) -> Any:
        return aggregate_and_route(df, ["user_id"], TwoPhaseTotals.local_aggregation, 5, 128,
                                   3, watermark=0, watermark_column="ts", plan=plan)

    def partial_below_every_exchange(df: Any) -> bool:
        text = df._jdf.queryExecution().executedPlan().toString()  # the root first
        return text.rfind("partial_count") > text.rindex("Exchange")

    partial = routed(PARTIAL_AGGREGATE)
    assert partial_below_every_exchange(partial)
    assert len(partial.collect()) == keys
    assert _shuffle_records(partial) == sorted([pairs, keys])
    placed = partial.select("user_id", SUBTASK_COLUMN,
                            F.spark_partition_id().alias("task")).collect()
    assert all(r[SUBTASK_COLUMN] in subtasks_of_task(r["task"], 3, 5) for r in placed)

    default = routed(SHUFFLE_THEN_AGGREGATE)
    assert not partial_below_every_exchange(default)
    assert len(default.collect()) == keys
    assert _shuffle_records(default) == [2000]
    with pytest.raises(ConfigurationError, match="unknown local aggregation plan"):
        routed("sideways")


def _pandas_aggregate(table: Any, watermark: int) -> list[tuple]:
    """Per key, with pandas: the aggregates of TwoPhaseTotals over the on-time rows (event
    time at or after ``watermark``, epoch ms), then on-time rows, late rows and the largest
    event time of all the key's rows."""
    import pyarrow as pa

    df = table.to_pandas()
    df["ms"] = table.column("ts").cast(pa.int64()).to_numpy() // 1000
    df["late"] = df["ms"] < watermark
    out = []
    for key, rows in df.groupby("user_id"):
        on = rows[~rows["late"]]
        valued = on["cents"].notna()
        out.append((key, len(on), int(on["cents"].sum()) if valued.any() else None,
                    int(on["ms"].max()) if len(on) else None, int(valued.sum()), len(on),
                    int(rows["late"].sum()), int(rows["ms"].max())))
    return sorted(out)


@pytest.mark.parametrize("plan", ["partial-aggregate", "shuffle-then-aggregate"])
def test_every_plan_aggregates_as_pandas(spark, plan):
    """Both plans give pandas' aggregates per key, late rows split off before them."""
    from keyedstate.spark.local_aggregation import PLANS, aggregate_and_route

    assert plan in PLANS
    data = two_phase_batches(1, events=3000, users=120, seed=3)[0]
    watermark = 1_700_000_000_000 + 1000  # rows span t0 - 3 s .. t0 + 4 s: some are late
    df = _partitioned(spark, data, 3)
    routed = aggregate_and_route(df, ["user_id"], TwoPhaseTotals.local_aggregation, 4, 128, 2,
                                 watermark=watermark, watermark_column="ts", plan=plan)
    got = routed.selectExpr("user_id", "events", "cents", "unix_micros(last) div 1000",
                            "valued", "_ks_rows", "_ks_late", "_ks_max_event_time").collect()
    expected = _pandas_aggregate(data, watermark)
    assert sorted(tuple(r) for r in got) == expected
    assert any(r[6] for r in expected) and any(r[5] for r in expected)


def test_a_task_refuses_rows_of_a_subtask_it_does_not_run():
    import pyarrow as pa

    from keyedstate.errors import BatchFailedError
    from keyedstate.runtime.wire import SUBTASK_COLUMN
    from keyedstate.spark.tasks import routed_to

    batch = pa.RecordBatch.from_pydict({SUBTASK_COLUMN: pa.array([2, 3, 4], pa.int32())})
    assert list(routed_to(7, range(2, 5), iter([batch]))) == [batch]
    with pytest.raises(BatchFailedError, match="got rows of subtasks 2-4"):
        list(routed_to(7, range(2, 4), iter([batch])))


def test_a_timestamp_ntz_watermark_column_is_refused_with_a_local_aggregation():
    """Its epoch milliseconds would depend on the session's time zone in the JVM."""
    from pyspark.sql.types import (
        LongType,
        StringType,
        StructField,
        StructType,
        TimestampNTZType,
        TimestampType,
    )

    from keyedstate.spark.local_aggregation import check_event_time

    schema = StructType([StructField("user_id", StringType()), StructField("ntz", TimestampNTZType()),
                         StructField("ts", TimestampType()), StructField("ms", LongType())])
    aggregation = TwoPhaseTotals.local_aggregation
    with pytest.raises(ConfigurationError, match="timestamp_ntz"):
        check_event_time(schema, "ntz", aggregation)
    for fine in ("ts", "ms"):
        check_event_time(schema, fine, aggregation)
    check_event_time(schema, "ntz", None)  # no aggregation: the subtask converts it
