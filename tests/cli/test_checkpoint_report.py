"""``keyedstate checkpoints report``: one self-contained HTML page from stored checkpoints,
checked in a real headless browser (Chromium through the DevTools protocol,
:mod:`tests.browser`): it renders without console errors, loads nothing, its tables sort on a
real click, and a screenshot is kept under the test's temporary directory.

The browser tests need Debian's ``chromium`` (``apt-get install chromium``; ``.ci/run``
installs it); without it they are skipped with that reason, and fail under ``CI=true``
(docs/checkpoints.md, "Testing the page in a browser"). The page's data
is checked without a browser too."""

from __future__ import annotations

import dataclasses
import html
import os
import struct
import subprocess
import sys
from html.parser import HTMLParser

import msgspec
import pytest
from click.testing import CliRunner

from keyedstate.checkpoint.properties import CHECKPOINT_HISTORY, JOB_CONFIG, SUBTASK_STATS
from keyedstate.cli import main
from keyedstate.cli.report_page import render_report
from keyedstate.processor.report import read_report
from tests.browser import MISSING, Browser, require_chromium, skip_without_chromium
from tests.checkpoint.test_savepoints import run_job
from tests.runtime.test_local_job import batches, config, new_job

pytestmark = pytest.mark.integration

#: skipped at collection without Chromium, outside CI; under CI=true require_chromium() in the
#: test fails it instead
needs_chromium = pytest.mark.skipif(skip_without_chromium(), reason=MISSING)


def test_a_missing_browser_skips_outside_ci_and_fails_in_ci(monkeypatch):
    monkeypatch.setenv("PATH", "")  # no chromium on it
    monkeypatch.delenv("CI", raising=False)
    assert skip_without_chromium()
    with pytest.raises(pytest.skip.Exception, match="Chromium is not installed"):
        require_chromium()
    monkeypatch.setenv("CI", "true")
    assert not skip_without_chromium()
    with pytest.raises(pytest.fail.Exception, match="Chromium is not installed.*CI=true"):
        require_chromium()


def report(directory: str, out: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["checkpoints", "report", directory, "--out", out])
    return result.exit_code, result.output


class Tables(HTMLParser):
    """Every table's rows of cell texts, by table id (the page as written, no script run)."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._in_body = False
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = dict(attrs).get("id") or f"table-{len(self.tables)}"
            self.tables[self._table] = []
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body and self._table:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._in_body:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tbody":
            self._in_body = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def local_job_history(root) -> str:
    """A local job's checkpoint directory: 4 batches at parallelism 2, then a restart at 3
    (a restore, a rescale) and 2 more; 2 checkpoints retained."""
    with new_job(config(root, num_retained=2)) as job:
        for table in batches(4):
            job.process_batch(table)
    with new_job(config(root, num_retained=2, parallelism=3)) as job:
        for table in batches(2, seed=3):
            job.process_batch(table)
    return str(root / "ckpt")


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def history_column(browser: Browser, column: int) -> list[str]:
    return browser.evaluate(
        f"Array.from(document.querySelectorAll('#history-table tbody tr'))"
        f".map(r => r.cells[{column}].getAttribute('data-sort'))")


@needs_chromium
def test_report_of_a_local_job_renders_in_a_browser_sorts_and_is_kept_as_a_screenshot(
        tmp_path):
    directory = local_job_history(tmp_path)
    out = str(tmp_path / "report.html")
    code, output = report(directory, out)
    assert code == 0, output
    assert output.strip().splitlines()[-1] == out  # the page's path on stdout

    with Browser(require_chromium(), width=1400, height=1000) as browser:
        browser.open(f"file://{out}")
        assert browser.errors() == []
        assert browser.evaluate("document.documentElement.dataset.ready") == "true"
        # Six checkpoints, newest first; chk-5 and chk-6 retained (their details, linked).
        assert history_column(browser, 0) == ["6", "5", "4", "3", "2", "1"]
        assert browser.evaluate("document.querySelectorAll('details').length") == 2
        assert browser.evaluate(
            "Array.from(document.querySelectorAll('#history-table a')).map(a => a.hash)"
        ) == ["#chk-6", "#chk-5"]
        # Both plots drawn: full and incremental size, sync, async and restore duration.
        assert browser.evaluate(
            "Array.from(document.querySelectorAll('svg g.series')).map(g => "
            "g.dataset.series + ':' + g.querySelectorAll('circle').length)"
        ) == ["full:6", "incremental:6", "sync:6", "async:6", "restore:6"]

        # A real click on "full" sorts ascending by bytes, a second one descending.
        full = browser.evaluate(
            "Array.from(document.querySelectorAll('#history-table thead button'))"
            ".findIndex(b => b.textContent === 'full')")
        browser.click(f"#history-table thead button[data-column='{full}']")
        sizes = [int(v) for v in history_column(browser, full)]
        assert sizes == sorted(sizes) and len(set(sizes)) > 1
        assert browser.evaluate(
            f"document.querySelectorAll('#history-table th')[{full}].getAttribute('aria-sort')"
        ) == "ascending"
        browser.click(f"#history-table thead button[data-column='{full}']")
        assert [int(v) for v in history_column(browser, full)] == sorted(sizes, reverse=True)

        screenshot = browser.screenshot(str(tmp_path / "checkpoint-report.png"))
        assert browser.errors() == []
    width, height = png_size(screenshot)
    assert width >= 1000 and height >= 1000 and len(screenshot) > 50_000
    assert os.path.getsize(tmp_path / "checkpoint-report.png") == len(screenshot)


@needs_chromium
def test_blanks_sort_last_both_ways(tmp_path):
    # A real report whose history has blanks where older checkpoints recorded nothing.
    data = read_report(local_job_history(tmp_path))
    blanked = [msgspec.structs.replace(r, sync_ms=None) if r.checkpoint_id in (2, 4) else r
               for r in data.history]
    out = tmp_path / "report.html"
    out.write_text(render_report(dataclasses.replace(data, history=blanked)), encoding="utf-8")
    with Browser(require_chromium()) as browser:
        browser.open(f"file://{out}")
        sync = browser.evaluate(
            "Array.from(document.querySelectorAll('#history-table thead button'))"
            ".findIndex(b => b.textContent === 'sync')")
        for _ in ("ascending", "descending"):
            browser.click(f"#history-table thead button[data-column='{sync}']")
            keys = history_column(browser, sync)
            assert keys[-2:] == ["", ""] and "" not in keys[:-2]
            ids = history_column(browser, 0)
            assert sorted(ids[-2:]) == ["2", "4"]
        assert browser.errors() == []


@needs_chromium
def test_the_browser_check_sees_console_errors_and_blocked_requests(tmp_path):
    """The harness's negative control: "no console errors" would also hold if it saw none."""
    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><head><meta http-equiv='Content-Security-Policy' "
        "content=\"default-src 'none'; script-src 'unsafe-inline'\"></head><body>"
        "<img src='https://example.invalid/x.png'>"
        "<script>console.error('from the page'); no_such_function();</script></body></html>")
    with Browser(require_chromium()) as browser:
        browser.open(f"file://{page}")
        kinds = sorted(m.kind for m in browser.errors())
    assert kinds == ["console.error", "exception", "log.error"]


@needs_chromium
def test_paths_are_escaped_and_old_checkpoints_without_statistics_render_blank(tmp_path):
    # A directory name a browser would take for markup, and checkpoints of the low-level
    # operator, which records no statistics (as checkpoints written before them).
    directory = str(tmp_path / 'job <b id="x">&amp;\'')
    op, _ = run_job(directory, "heap", rounds=3, num_retained=2)
    op.close()
    out = str(tmp_path / "report.html")
    code, output = report(directory, out)
    assert code == 0, output
    page = open(out, encoding="utf-8").read()
    assert '<b id="x">' not in page
    with Browser(require_chromium()) as browser:
        browser.open(f"file://{out}")
        assert browser.errors() == []
        assert browser.evaluate("document.querySelectorAll('b').length") == 0
        assert browser.evaluate("document.querySelector('header .where').textContent") == \
            directory
        assert history_column(browser, 0) == ["3", "2"]  # only what is retained
        # No duration was recorded: the duration plot says so, the size plot is drawn.
        assert browser.evaluate("document.querySelector('#plot-duration .empty').textContent"
                                ) == "not recorded"
        assert browser.evaluate("document.querySelectorAll('#plot-size circle').length") == 4
        # Per subtask too: blank, and sorted as blank (an empty key), not as the dash shown.
        assert browser.evaluate(
            "Array.from(document.querySelectorAll('#subtasks-3 tbody tr')).map(r => "
            "[r.cells[8].textContent, r.cells[8].getAttribute('data-sort')])"
        ) == [["\u2013", ""], ["\u2013", ""]]


def test_report_data_matches_what_the_checkpoints_record(tmp_path):
    directory = local_job_history(tmp_path)
    data = read_report(directory)
    assert [r.checkpoint_id for r in data.history] == [1, 2, 3, 4, 5, 6]
    assert [s.checkpoint_id for s in data.retained] == [5, 6]
    assert data.configuration["parallelism.default"] == 3
    latest = data.retained[-1]
    assert [s.index for s in latest.subtasks] == [0, 1, 2]
    assert sum(s.full_bytes for s in latest.subtasks) == latest.stats.full_bytes
    assert all(s.stats is not None and s.stats.reused for s in latest.subtasks)
    assert data.history[4].restored_subtasks == 3  # the restart at parallelism 3

    out = str(tmp_path / "report.html")
    assert report(directory, out)[0] == 0
    page = open(out, encoding="utf-8").read()
    tables = Tables(page).tables
    assert [row[0] for row in tables["history-table"]] == ["1", "2", "3", "4", "5", "6"]
    assert [row[0] for row in tables["subtasks-6"]] == ["0", "1", "2"]
    # Self-contained: nothing to fetch, and a policy that forbids fetching anything.
    for marker in ("<link", " src=", "@import", "url(", "http://", "https://"):
        assert marker not in page, marker
    assert "default-src 'none'" in html.unescape(page)
    assert "3 of 3 subtasks restored" in page


def test_a_savepoint_is_reported_alone_without_the_jobs_statistics(tmp_path):
    with new_job(config(tmp_path)) as job:
        for table in batches(2):
            job.process_batch(table)
        savepoint = job.savepoint(str(tmp_path / "savepoint"))
    data = read_report(str(tmp_path / "savepoint"))
    assert [s.kind for s in data.retained] == ["savepoint"]
    assert len(data.history) == 1 and data.history[0].sync_ms is None
    assert data.configuration == {}
    for key in (CHECKPOINT_HISTORY, SUBTASK_STATS, JOB_CONFIG):
        assert key not in data.latest.properties
    assert read_report(savepoint).latest_url == savepoint  # its _metadata, named directly
    code, output = report(str(tmp_path / "savepoint"), str(tmp_path / "sp.html"))
    assert code == 0, output


def test_an_unreadable_checkpoint_is_listed_and_the_history_read_from_the_previous(tmp_path):
    directory = local_job_history(tmp_path)
    with open(os.path.join(directory, "chk-6", "_metadata"), "r+b") as f:
        f.truncate(100)
    data = read_report(directory)
    assert [u.checkpoint_id for u in data.unreadable] == [6]
    assert "CorruptCheckpointError" in data.unreadable[0].error
    assert [r.checkpoint_id for r in data.history] == [1, 2, 3, 4, 5]
    out = str(tmp_path / "report.html")
    code, output = report(directory, out)
    # The page is written in full; the status says a checkpoint can't be read.
    assert code == 1 and "chk-6" in output, output
    assert "Unreadable checkpoints" in open(out, encoding="utf-8").read()


def test_a_missing_or_empty_directory_is_a_clear_error_and_writes_nothing(tmp_path):
    out = tmp_path / "report.html"
    code, output = report(str(tmp_path / "no-such-job"), str(out))
    assert code == 1 and "NoCheckpointError" in output and "does not exist" in output
    os.makedirs(tmp_path / "empty")
    code, output = report(str(tmp_path / "empty"), str(out))
    assert code == 1 and "NoCheckpointError" in output and "holds no checkpoint" in output
    assert not out.exists()


def test_the_report_needs_no_spark(tmp_path):
    directory = local_job_history(tmp_path)
    out = str(tmp_path / "report.html")
    script = ("import sys\nfrom keyedstate.cli import main\n"
              "try:\n    main(['checkpoints', 'report', sys.argv[1], '--out', sys.argv[2]])\n"
              "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
              "assert 'pyspark' not in sys.modules and 'py4j' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", script, directory, out], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    assert os.path.getsize(out) > 0
