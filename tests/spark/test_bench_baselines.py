"""The Spark baselines of ``keyedstate bench throughput`` run after ``make install`` (first run:
``transformWithStateInPandas`` needs protobuf and grpcio in Spark's Python workers; the
``bench`` extra installs them)."""

from __future__ import annotations

from typing import Any

import pytest

from keyedstate_benchmarks import throughput

pytestmark = pytest.mark.spark


def test_transform_with_state_in_pandas_baseline_runs_small(spark: Any) -> None:
    figures = throughput.run(keys=50, events_per_batch=400, batches=2, baseline_batches=2,
                             parallelism=2, systems=[throughput.TRANSFORM_WITH_STATE_IN_PANDAS],
                             spark=spark)
    # run() fails when a system's counts differ from the generated data's.
    [result] = figures["results"]
    assert result["system"] == throughput.TRANSFORM_WITH_STATE_IN_PANDAS
    assert result["batches"] == 2
