"""The checkpoint report of a Spark job: the driver records the same statistics as the local
runtime (one ``complete_batch``), and the page renders them in a real browser."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from keyedstate.cli import main
from keyedstate.processor.report import read_report
from keyedstate.spark.api import key_by
from keyedstate.spark.sinks import ParquetSink
from tests.browser import Browser, require_chromium
from tests.runtime.test_local_job import INPUT, batches, config
from tests.spark.jobs import COUNT_SCHEMA, IDLE_SCHEMA, IdleCounts, file_stream

pytestmark = pytest.mark.spark


def test_report_of_a_spark_job(spark, tmp_path):
    data = batches(3)
    events = file_stream(spark, str(tmp_path / "input"), data, INPUT)
    job = key_by(events, "user_id").process(IdleCounts(), COUNT_SCHEMA,
                                            side_outputs={"idle": IDLE_SCHEMA})
    job.sink(ParquetSink(str(tmp_path / "out")))
    cfg = config(tmp_path / "spark", num_retained=2)
    query = job.start(cfg, trigger={"availableNow": True},
                      spark_checkpoint_location=str(tmp_path / "spark" / "offsets"))
    query.await_termination()
    query.stop()

    report = read_report(cfg.checkpoint_dir)
    history = report.history
    assert [r.batch_id for r in history] == [0, 1, 2]
    assert [s.checkpoint_id for s in report.retained] == [r.checkpoint_id for r in history[1:]]
    for row in history:
        assert row.sync_ms > 0 and row.async_ms > 0 and row.end_to_end_ms > row.sync_ms
        assert row.parallelism == 2 and 0 < row.incremental_bytes <= row.full_bytes
        assert row.reused_subtasks + row.restored_subtasks <= 2
    assert sum(r.rows_in for r in history) > 0
    assert report.configuration["parallelism.default"] == 2
    assert all(s.stats is not None for s in report.retained[-1].subtasks)

    out = str(tmp_path / "report.html")
    result = CliRunner().invoke(main, ["checkpoints", "report", cfg.checkpoint_dir,
                                       "--out", out])
    assert result.exit_code == 0, result.output
    with Browser(require_chromium("the page was written, not rendered")) as browser:
        browser.open(f"file://{out}")
        assert browser.errors() == []
        assert browser.evaluate("document.querySelectorAll('#history-table tbody tr').length"
                                ) == 3
        browser.screenshot(str(tmp_path / "checkpoint-report-spark.png"))
