"""Both table sinks under a worker fault (exactly once into Delta and Iceberg): a Python worker
SIGKILLed mid-batch makes Spark re-run the batch's task; the Delta table and the Iceberg table each
hold every batch exactly once (read back by delta-rs and pyiceberg, compared with pandas over the
input). The driver-side faults (a crash on either side of a sink's commit, a replayed batch) are in
test_delta_sink.py and test_iceberg_sink.py."""

from __future__ import annotations

import os

import pytest

from keyedstate.spark.delta_sink import DeltaSink
from keyedstate.spark.iceberg_sink import IcebergSink
from tests.spark.jobs import KillWorkerOnce
from tests.spark.test_delta_sink import rows as delta_rows
from tests.spark.test_iceberg_sink import TABLE, catalog_properties
from tests.spark.test_iceberg_sink import rows as iceberg_rows
from tests.spark.test_job import check_against_pandas, run_job, write_files

pytestmark = pytest.mark.spark


def test_killed_worker_mid_batch_leaves_both_tables_exactly_once(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    markers = tmp_path / "markers"
    markers.mkdir()
    delta = str(tmp_path / "delta")
    iceberg = catalog_properties(str(tmp_path / "iceberg"))
    run_job(spark, root, KillWorkerOnce(batch_id=1, marker_dir=str(markers)), parallelism=2,
            extra_sinks=(DeltaSink(delta), IcebergSink(iceberg, TABLE)))
    assert list(markers.iterdir()), "the worker was never killed: the test proved nothing"
    check_against_pandas(root)
    check_against_pandas(root, delta_rows(delta))
    check_against_pandas(root, iceberg_rows(iceberg))
