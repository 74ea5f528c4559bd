"""Two-phase (local-global) aggregation on the local runtime: the rows aggregated per key with
pyarrow before the function, checked against pandas across batches, a restart and a rescale;
the aggregates' semantics; the start-time checks (nothing written)."""

from __future__ import annotations

import math
import os
import pickle
from typing import Any

import pyarrow as pa
import pytest

from keyedstate import Count, LocalAggregation, Max, Min, Sum
from keyedstate.checkpoint.stats import history_of
from keyedstate.config import JobConfig
from keyedstate.errors import ConfigurationError
from keyedstate.runtime.function import KeyedProcessFunction
from keyedstate.runtime.local import LocalJob
from keyedstate.runtime.local_aggregation import aggregate_table, split_aggregated
from tests.runtime.test_local_job import config
from tests.spark.jobs import (
    TWO_PHASE_INPUT,
    TWO_PHASE_SCHEMA,
    TwoPhasePerKeyTotals,
    TwoPhaseTotals,
    two_phase_batches,
    two_phase_oracle,
)

pytestmark = pytest.mark.integration


def two_phase_config(root: Any, **changes: Any) -> JobConfig:
    """``tests.runtime.test_local_job.config`` with late rows dropped (a local aggregation refuses
    them to a side output)."""
    return config(root, **{"late_events": "drop", **changes})


def new_job(cfg: JobConfig, fn: KeyedProcessFunction | None = None) -> LocalJob:
    return LocalJob(fn or TwoPhaseTotals(), key_columns=["user_id"], input_schema=TWO_PHASE_INPUT,
                    output_schema=TWO_PHASE_SCHEMA, config=cfg)


def main_rows(out: dict[str, pa.Table]) -> list[tuple]:
    return sorted(tuple(r.values()) for r in out["main"].to_pylist())


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("function", [TwoPhaseTotals, TwoPhasePerKeyTotals])
def test_two_phase_totals_match_pandas_across_a_restart_and_a_rescale(tmp_path, backend,
                                                                        function):
    data = two_phase_batches(5)
    expected, late = two_phase_oracle(data, delay_ms=1000)
    assert sum(late) > 0  # the data has late rows
    cfg = two_phase_config(tmp_path, backend=backend)
    with new_job(cfg, function()) as job:
        got = [main_rows(job.process_batch(t)) for t in data[:3]]
    # A restart from the checkpoints, at another parallelism: the state and the watermark.
    with new_job(two_phase_config(tmp_path, backend=backend, parallelism=3), function()) as job:
        got += [main_rows(job.process_batch(t)) for t in data[3:]]
        history = history_of(job.latest_checkpoint.metadata)
    assert got == expected
    # rows_in still counts the events into the function (on time), not the aggregated rows.
    assert [h.rows_in for h in history[-2:]] == [len(t) - n for t, n in zip(data[3:], late[3:])]


def test_a_batch_replayed_after_a_failure_aggregates_the_same_input(tmp_path):
    data = two_phase_batches(2)
    expected, _ = two_phase_oracle(data, delay_ms=1000)

    class FailOnce(TwoPhaseTotals):
        failed = [False]

        def process_batch(self, batch, ctx):
            if ctx.batch_id == 1 and not self.failed[0]:
                self.failed[0] = True
                raise RuntimeError("boom")
            return super().process_batch(batch, ctx)

    with new_job(two_phase_config(tmp_path), FailOnce()) as job:
        first = main_rows(job.process_batch(data[0]))
        with pytest.raises(Exception, match="boom"):
            job.process_batch(data[1])
        second = main_rows(job.process_batch(data[1]))
    assert [first, second] == expected


def test_without_a_watermark_every_row_is_aggregated(tmp_path):
    data = two_phase_batches(3)
    expected, late = two_phase_oracle(data, delay_ms=None)
    assert late == [0, 0, 0]
    with new_job(two_phase_config(tmp_path, watermark_column=None)) as job:
        assert [main_rows(job.process_batch(t)) for t in data] == expected


def test_aggregates_follow_sql_null_and_nan_rules():
    table = pa.table({
        "k": ["a", "b", "a", None, "a", "c"],
        "v": pa.array([1, 2, None, 4, 5, None], pa.int32()),
        "f": [1.0, math.nan, 2.0, 3.0, math.nan, None],
        "s": ["x", "y", "z", None, "w", None],
    })
    agg = LocalAggregation(n=Count(), c=Count("v"), total=Sum("v"), top=Max("f"), low=Min("f"),
                           first=Min("s"), ftotal=Sum("f"))
    out = aggregate_table(table, ["k"], agg, watermark=0, watermark_column=None)
    assert out.schema.field("total").type == pa.int64()
    assert out.schema.field("ftotal").type == pa.float64()
    rows = {r["k"]: r for r in out.to_pylist()}
    assert (rows["a"]["n"], rows["a"]["c"], rows["a"]["total"]) == (3, 2, 6)
    # Spark's max takes NaN as larger than any number, its min skips it unless it is all.
    assert math.isnan(rows["a"]["top"]) and rows["a"]["low"] == 1.0
    assert math.isnan(rows["b"]["low"])
    assert rows["a"]["first"] == "w"
    # Nulls are skipped; no value at all is null (a count is 0); a null key is one key.
    assert (rows["c"]["c"], rows["c"]["total"], rows["c"]["top"]) == (0, None, None)
    assert rows[None]["total"] == 4
    assert [r["_ks_rows"] for r in out.to_pylist()] == [3, 1, 1, 1]


def test_late_rows_are_split_off_before_the_aggregation():
    table = pa.table({"k": ["a", "a", "b", "c"], "ts": pa.array([5, 20, 3, None], pa.int64()),
                      "v": [1, 2, 3, 4]})
    agg = LocalAggregation(n=Count(), total=Sum("v"))
    out = aggregate_table(table, ["k"], agg, watermark=10, watermark_column="ts")
    split = split_aggregated(out)
    # "a" keeps its on-time row; "b" was all late: gone; "c" has no event time: never late.
    assert split.table.to_pylist() == [{"k": "a", "n": 1, "total": 2},
                                       {"k": "c", "n": 1, "total": 4}]
    assert (split.rows_in, split.late, split.max_event_time) == (2, 2, 20)


def test_a_local_aggregation_pickles_and_remembers_where_it_was_declared():
    agg = LocalAggregation(events=Count(), amount=Sum("amount"))
    assert pickle.loads(pickle.dumps(agg)) == agg
    assert agg.declared_at.startswith(__file__)
    assert agg.names == ["events", "amount"]


@pytest.mark.parametrize("make, match", [
    (lambda: LocalAggregation(), "at least one"),
    (lambda: LocalAggregation(n=len), "not an aggregate"),
    (lambda: LocalAggregation(_ks_n=Count()), "reserves"),
    (lambda: LocalAggregation(n=Sum(None)), "names no column"),
])
def test_a_malformed_declaration_is_refused_where_it_is_written(make, match):
    with pytest.raises(ConfigurationError, match=match):
        make()


def _declaring(aggregation: Any) -> KeyedProcessFunction:
    class Declares(TwoPhaseTotals):
        local_aggregation = aggregation

    return Declares()


@pytest.mark.parametrize("aggregation, changes, match", [
    (LocalAggregation(n=Count("amount")), {}, "does not have; its columns are"),
    (LocalAggregation(user_id=Count()), {}, "name of a key column"),
    (LocalAggregation(n=Sum("user_id")), {}, "Sum takes an integer or floating-point"),
    (LocalAggregation(n=Max("ts")), {"late_events": "side-output"}, "side-output"),
    ("count", {}, "must be a LocalAggregation"),
])
def test_the_start_refuses_what_the_input_cannot_give_and_writes_nothing(tmp_path, aggregation,
                                                                         changes, match):
    cfg = two_phase_config(tmp_path, **changes)
    with pytest.raises(ConfigurationError, match=match) as error:
        new_job(cfg, _declaring(aggregation))
    if not isinstance(aggregation, str):
        assert __file__ in str(error.value)  # the declaration's place
    assert not os.path.exists(tmp_path / "ckpt") or not os.listdir(tmp_path / "ckpt")
