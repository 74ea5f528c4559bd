"""The examples run on the local runtime (no Java) from their own command lines and match their
oracles; the oracles' checks fail on a wrong output. Their Spark runs are in
tests/spark/test_examples.py; click_sessions is run by tests/cli/test_cli.py and
tests/spark/test_job.py."""

from __future__ import annotations

import glob
import importlib
import json
import os

import pyarrow as pa
import pytest

from examples import card_alerts, page_views
from examples.harness import Check
from keyedstate.serde import to_arrow_schema

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: each example's command-line options for a small run (a few batches)
SMALL = {
    "card_alerts": ["--transactions", "3000", "--cards", "100", "--files", "4"],
    "page_views": ["--views", "3000", "--users", "50", "--files", "4"],
}
TESTED_ELSEWHERE = {"click_sessions"}


def test_every_example_is_run_here():
    modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "examples", "*.py"))}
    assert modules - {"__init__", "harness"} == SMALL.keys() | TESTED_ELSEWHERE


@pytest.mark.parametrize("name", sorted(SMALL))
def test_example_runs_locally_and_matches_its_oracle(name, tmp_path, capsys):
    example = importlib.import_module(f"examples.{name}")
    status = example.main(["--runtime", "local", "--dir", str(tmp_path / name), *SMALL[name]])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["verified"], report["checks"]
    assert report["runtime"] == "local" and all(report["outputs"].values()), report["outputs"]


def test_card_alerts_closes_periods_in_batch_and_by_timer_alike(tmp_path):
    """Where batches start does not change the output: one batch (every period closed in
    it or by the drain's timers) or many (most closed by timers between batches)."""
    one = card_alerts.run_local(str(tmp_path / "one"), 2000, 80, files=1)
    many = card_alerts.run_local(str(tmp_path / "many"), 2000, 80, files=12)
    assert one.verified and many.verified, (one.checks, many.checks)
    assert one.outputs == many.outputs and many.batches == 12 + 1


def test_page_views_restart_meets_redeliveries_of_views_counted_before_it(tmp_path):
    report = page_views.run_local(str(tmp_path / "pv"), 3000, 50, files=4)
    assert report.verified, report.checks
    assert report.details["redelivered_across_the_restart"] > 0


# -- the oracles' checks fail on a wrong output ---------------------------------------------------


def _table(rows: list[tuple], ddl: str) -> pa.Table:
    """Rows of an example's output (times in ms) as the job's table of ``ddl``."""
    schema = to_arrow_schema(ddl)
    columns = list(zip(*rows)) if rows else [[] for _ in schema]
    return pa.table([pa.array([v * 1000 for v in col] if pa.types.is_timestamp(f.type)
                              else list(col)).cast(f.type)
                     for col, f in zip(columns, schema)], schema=schema)


def test_card_alerts_verify_rejects_a_missing_or_changed_row():
    transactions = list(card_alerts.generate_transactions(2000, 80))
    periods, alerts = card_alerts.oracle(transactions)
    assert alerts, "the input has no spike to alert on"

    def verdicts(p: list, a: list) -> dict[str, Check]:
        return card_alerts.verify(transactions, _table(p, card_alerts.PERIODS_DDL),
                                  _table(a, card_alerts.ALERTS_DDL))

    assert all(verdicts(periods, alerts).values())
    assert not all(verdicts(periods[1:], alerts).values())
    assert not all(verdicts(periods, alerts[:-1]).values())
    card, first, last, n, average, top = periods[0]
    assert not all(verdicts([(card, first, last, n, average, top + 1), *periods[1:]],
                            alerts).values())


def test_page_views_verify_rejects_a_missing_or_changed_row():
    views = list(page_views.generate_views(2000, 40))
    visits, duplicates = page_views.oracle(views)
    assert duplicates, "the input has no redelivery"
    current = [(user, page, n, last, 0) for (user, page), (n, last) in visits.items()]
    by_id = {v[1]: v for v in views}
    redelivered = [(user, event_id, by_id[event_id][2], by_id[event_id][3], 0)
                   for user, event_id in duplicates]

    def verdicts(v: list, d: list) -> dict[str, Check]:
        return page_views.verify(views, _table(v, page_views.VISITS_DDL),
                                 _table(d, page_views.DUPLICATES_DDL))

    assert all(verdicts(current, redelivered).values())
    assert not all(verdicts(current[1:], redelivered).values())
    assert not all(verdicts(current, redelivered[1:]).values())
    user, page, n, last, batch = current[0]
    assert not all(verdicts([(user, page, n + 1, last, batch), *current[1:]],
                            redelivered).values())
    # A row repeated within one batch is a row too many, even if its values are right.
    assert not all(verdicts([*current, current[0]], redelivered).values())
