"""Prometheus metrics of a job read from its checkpoints (keyedstate.processor.metrics): a real
HTTP endpoint on loopback, scraped and parsed with prometheus_client's own parser, against
the statistics the checkpoints record; a scrape never fails; a wrong path fails at start."""

from __future__ import annotations

import socket
import sys
import urllib.request
from typing import Any

import pytest
from click.testing import CliRunner

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.stats import stats_of
from keyedstate.cli import main
from keyedstate.errors import MissingDependencyError, NoCheckpointError
from keyedstate.processor.metrics import metrics_text, serve_metrics
from tests.runtime.test_local_job import batches, config, new_job

parser = pytest.importorskip("prometheus_client.parser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for family in parser.text_string_to_metric_families(text)
            for s in family.samples}


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return _samples(response.read().decode())


def test_a_scrape_reports_the_latest_checkpoints_statistics(tmp_path: Any) -> None:
    directory = str(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    port = _free_port()
    server = serve_metrics(directory, port)
    try:
        assert _scrape(port) == {"keyedstate_up": 0.0}  # no checkpoint yet: still a scrape
        with new_job(config(tmp_path)) as job:
            for table in batches(3, users=50):
                job.process_batch(table)
        samples = _scrape(port)
    finally:
        server.shutdown()
    metadata = resolve_snapshot(directory).metadata
    row = stats_of(metadata)
    assert samples["keyedstate_up"] == 1.0
    assert samples["keyedstate_last_checkpoint_id"] == metadata.checkpoint_id
    assert samples["keyedstate_last_checkpoint_batch_id"] == row.batch_id == 2
    assert samples["keyedstate_last_checkpoint_rows_in"] == row.rows_in
    assert samples["keyedstate_last_checkpoint_rows_out"] == row.rows_out
    assert samples["keyedstate_last_checkpoint_full_size_bytes"] == row.full_bytes > 0
    assert samples["keyedstate_last_checkpoint_parallelism"] == 2
    assert samples["keyedstate_last_checkpoint_reused_subtasks"] == row.reused_subtasks
    assert row.end_to_end_ms is not None
    assert samples["keyedstate_last_checkpoint_end_to_end_seconds"] == pytest.approx(
        row.end_to_end_ms / 1000)
    assert samples["keyedstate_watermark_seconds"] == int(
        metadata.properties["watermark"]) / 1000
    assert samples["keyedstate_last_checkpoint_age_seconds"] >= 0


def test_an_unreadable_checkpoint_is_up_0_not_a_failed_scrape(tmp_path: Any) -> None:
    with new_job(config(tmp_path)) as job:
        job.process_batch(batches(1, users=20)[0])
    metadata = tmp_path / "ckpt" / "chk-1" / "_metadata"
    metadata.write_bytes(metadata.read_bytes()[:10])
    port = _free_port()
    server = serve_metrics(str(tmp_path / "ckpt"), port)
    try:
        assert _scrape(port) == {"keyedstate_up": 0.0}
    finally:
        server.shutdown()


def test_show_prints_the_metrics_and_a_wrong_path_fails_at_start(tmp_path: Any) -> None:
    with new_job(config(tmp_path)) as job:
        job.process_batch(batches(1, users=20)[0])
    result = CliRunner().invoke(main, ["metrics", "show", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    assert _samples(result.output)["keyedstate_last_checkpoint_batch_id"] == 0
    again = _samples(metrics_text(str(tmp_path / "ckpt")))
    shown = _samples(result.output)
    age = "keyedstate_last_checkpoint_age_seconds"  # the one figure that moves with the clock
    assert again.pop(age) >= shown.pop(age) and again == shown
    with pytest.raises(NoCheckpointError, match="no-such-dir"):
        serve_metrics(str(tmp_path / "no-such-dir"), _free_port())
    result = CliRunner().invoke(main, ["metrics", "serve", str(tmp_path / "no-such-dir")])
    assert result.exit_code != 0 and "NoCheckpointError" in result.output


def test_without_prometheus_client_the_error_names_the_extra(tmp_path: Any,
                                                             monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r"keyedstate\[metrics\]"):
        metrics_text(str(tmp_path))
