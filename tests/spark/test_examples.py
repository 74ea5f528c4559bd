"""The examples on Spark (local[2,4]): they match their oracles."""

from __future__ import annotations

from typing import Any

import pytest

from examples import card_alerts, page_views

pytestmark = pytest.mark.spark

FILES = 2  # batches 0 and 1, then the drain as batch 2


@pytest.fixture(scope="module")
def card_alerts_run(spark: Any, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[card_alerts.Report, str]:
    directory = str(tmp_path_factory.mktemp("card-alerts"))
    return card_alerts.run_spark(spark, directory, 3000, 100, files=FILES), directory


def test_card_alerts_on_spark_matches_its_oracle(card_alerts_run):
    report, _ = card_alerts_run
    assert report.verified, report.checks
    assert report.batches == FILES + 1 and report.outputs["alerts"] > 0
    assert report.details["query_name"] == "card-alerts"
    # Idle timers fired between batches, not only in the drain.
    assert report.details["timers_fired"] > report.details["timers_fired_in_drain"] > 0


def test_page_views_on_spark_matches_its_oracle_across_a_restart(spark, tmp_path):
    files = 4
    report = page_views.run_spark(spark, str(tmp_path / "page-views"), 3000, 50, files=files)
    assert report.verified, report.checks
    # The second start resumed after the first one's last batch, and met redeliveries of
    # views counted before the stop.
    assert report.details["first_batch_of_each_start"] == [0, files // 2]
    assert report.batches == files
    assert report.details["redelivered_across_the_restart"] > 0
