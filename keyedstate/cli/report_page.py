"""The page ``keyedstate checkpoints report`` writes: one self-contained HTML file (inline CSS,
inline SVG plots, a few lines of inline JavaScript to sort tables), drawn from a
:class:`~keyedstate.processor.report.CheckpointReport`. The plots are drawn by
:mod:`keyedstate.cli.report_plot`; the style, script and policy are in
:mod:`keyedstate.cli.report_assets`.

Self-contained on purpose: the page is opened from a file, mailed, attached to a ticket. It
loads nothing (its Content-Security-Policy forbids any request, so a browser proves it), and
reads without JavaScript; scripts only make the tables sortable. The plots are SVG drawn in
Python. Every text that comes from a checkpoint (paths, property values, errors) is
escaped: paths are user-controlled.
"""

from __future__ import annotations

import datetime as dt
import json
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Sequence

from keyedstate.checkpoint.properties import (
    BATCH_ID,
    CHECKPOINT_HISTORY,
    CLAIMED_FROM,
    DRAINED,
    JOB_CONFIG,
    RESTORE_MODE,
    RESTORED_FROM,
    SAVEPOINT_OF,
    STAGED,
    SUBTASK_STATS,
    TOKENS,
    WATERMARK,
)
from keyedstate.checkpoint.stats import CompletedCheckpointStats
from keyedstate.cli.output import human_bytes
from keyedstate.cli.report_assets import CSP, CSS, JS
from keyedstate.cli.report_plot import BYTE_UNITS, MS_UNITS, Series, line_plot
from keyedstate.cli.report_plot import escape as _e
from keyedstate.processor.canonical.layout import PROP_KEY_COLUMNS
from keyedstate.processor.report import CheckpointReport, SnapshotReport
from keyedstate.storage.transfer import PROP_PREFIX, RESTORE_PREFIX

#: Properties the page shows in their own place (or not at all: bulky bookkeeping).
_SHOWN_ELSEWHERE = {TOKENS, STAGED, JOB_CONFIG, CHECKPOINT_HISTORY, SUBTASK_STATS, BATCH_ID,
                    WATERMARK, RESTORED_FROM, RESTORE_MODE, CLAIMED_FROM, SAVEPOINT_OF, DRAINED,
                    PROP_KEY_COLUMNS}
#: The plots' colours, one per series.
_COLORS = {"full": "#2f6fb0", "incremental": "#e07b24", "sync": "#2e9a4a",
           "async": "#c8413b", "restore": "#7b57b5"}
#: A watermark below this (ms) is "none yet" (the runtimes start at the smallest long).
_NO_WATERMARK = -(1 << 62)

BLANK = "\u2013"  # what a value not recorded shows


def _utc(ms: int | None) -> str:
    if ms is None:
        return BLANK
    moment = dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(ms: float | None) -> str:
    if ms is None:
        return BLANK
    if ms < 1000:
        return f"{ms:.1f} ms"
    return f"{ms / 1000:.2f} s"


def _bytes(n: int | None) -> str:
    return BLANK if n is None else human_bytes(n)


def _count(n: int | None) -> str:
    return BLANK if n is None else f"{n:,}"


# -- tables ------------------------------------------------------------------------------------

#: A column of a sortable table: header, tooltip, the value to sort by, the text to show.
Column = tuple[str, str, Callable[[Any], Any], Callable[[Any], str]]


def _sortable(table_id: str, columns: Sequence[Column], rows: Sequence[Any],
              caption: str, sort_column: int, descending: bool) -> str:
    """A table the page's script sorts by clicking a header; each cell carries its sort key
    (``data-sort``, empty when the value is blank: blanks always sort last)."""
    out = [f'<table class="sortable" id="{_e(table_id)}" data-sort-column="{sort_column}" '
           f'data-sort-order="{"desc" if descending else "asc"}"><caption>{_e(caption)}'
           f'</caption><thead><tr>']
    for n, (title, tip, _, _) in enumerate(columns):
        out.append(f'<th scope="col" title="{_e(tip)}"><button type="button" data-column="{n}">'
                   f'{_e(title)}</button></th>')
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>")
        for _, _, key, text in columns:
            value = key(row)
            sort = "" if value is None else value
            out.append(f'<td data-sort="{_e(sort)}">{text(row)}</td>')
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _history_columns() -> list[Column]:
    def col(title: str, tip: str, field: str, fmt: Callable[[Any], str]) -> Column:
        return (title, tip, lambda r: getattr(r, field),
                lambda r: _e(fmt(getattr(r, field))))

    def ratio(r: CompletedCheckpointStats) -> str:
        if r.reused_subtasks is None and r.restored_subtasks is None:
            return BLANK
        return f"{_count(r.reused_subtasks)} / {_count(r.restored_subtasks)}"

    return [
        col("checkpoint", "checkpoint id (chk-N)", "checkpoint_id", str),
        col("batch", "the micro-batch the checkpoint covers", "batch_id", _count),
        col("triggered", "when the checkpoint was triggered (UTC)", "trigger_ms", _utc),
        col("end to end", "trigger to the last subtask's acknowledgement (includes the "
            "batch's processing)", "end_to_end_ms", _duration),
        col("sync", "synchronous part of the snapshot, slowest subtask", "sync_ms", _duration),
        col("async", "asynchronous part (writing files), slowest subtask", "async_ms",
            _duration),
        col("incremental", "bytes this checkpoint wrote", "incremental_bytes", _bytes),
        col("full", "bytes of all files the checkpoint references", "full_bytes", _bytes),
        col("subtask min", "smallest subtask's full state size", "min_subtask_bytes", _bytes),
        col("subtask max", "largest subtask's full state size", "max_subtask_bytes", _bytes),
        col("uploaded", "bytes sent to checkpoint storage", "uploaded_bytes", _bytes),
        col("duplicated", "bytes the store copied itself (no transfer)", "duplicated_bytes",
            _bytes),
        col("inlined", "bytes stored inside _metadata", "inlined_bytes", _bytes),
        col("downloaded", "bytes restores downloaded before the batch", "downloaded_bytes",
            _bytes),
        col("cache hits", "bytes restores took from executors' file caches",
            "cache_hit_bytes", _bytes),
        col("restore", "restoring or opening state before the batch, slowest subtask",
            "restore_ms", _duration),
        ("reused / restored", "subtasks that reused their live state / restored it from a "
         "snapshot", lambda r: r.restored_subtasks, lambda r: _e(ratio(r))),
        col("p", "parallelism", "parallelism", _count),
        col("rows in", "rows the batch processed", "rows_in", _count),
        col("rows out", "rows the batch emitted (main output)", "rows_out", _count),
    ]


def _subtask_columns(largest: int) -> list[Column]:
    def stat(field: str) -> Callable[[Any], Any]:
        return lambda s: None if s.stats is None else getattr(s.stats, field)

    def state(s: Any) -> str | None:
        if s.stats is None or s.stats.reused is None:
            return None
        return "reused" if s.stats.reused else "restored" if s.stats.restored else "new"

    def full(s: Any) -> str:
        share = 0 if largest <= 0 else 100 * s.full_bytes / largest
        return (f'<span class="bar" style="width:{share:.1f}%"></span>'
                f'<span class="barlabel">{_e(human_bytes(s.full_bytes))}</span>')

    return [
        ("subtask", "subtask index", lambda s: s.index, lambda s: _e(s.index)),
        ("key groups", "the key groups the subtask owns", lambda s: s.key_group_start,
         lambda s: _e(f"{s.key_group_start}-{s.key_group_end}")),
        ("full", "bytes of all files of the subtask's state (bar: share of the largest)",
         lambda s: s.full_bytes, full),
        ("incremental", "bytes the subtask wrote for this checkpoint",
         lambda s: s.incremental_bytes, lambda s: _e(human_bytes(s.incremental_bytes))),
        ("files", "files referenced (inline ones included)", lambda s: s.files,
         lambda s: _e(s.files)),
        ("sync", "synchronous part of the snapshot", stat("sync_ms"),
         lambda s: _e(_duration(stat("sync_ms")(s)))),
        ("async", "asynchronous part (writing files)", stat("async_ms"),
         lambda s: _e(_duration(stat("async_ms")(s)))),
        ("restore", "restoring or opening state before the batch", stat("restore_ms"),
         lambda s: _e(_duration(stat("restore_ms")(s)))),
        ("state", "reused the live state, restored it from a snapshot, or new (empty)",
         state, lambda s: _e(state(s) or BLANK)),
        ("uploaded", "bytes sent to checkpoint storage", lambda s: s.uploaded_bytes,
         lambda s: _e(human_bytes(s.uploaded_bytes))),
        ("duplicated", "bytes the store copied itself", lambda s: s.duplicated_bytes,
         lambda s: _e(human_bytes(s.duplicated_bytes))),
        ("downloaded", "bytes the restore before the batch downloaded",
         lambda s: s.downloaded_bytes, lambda s: _e(human_bytes(s.downloaded_bytes))),
        ("rows in", "rows the subtask processed", stat("rows_in"),
         lambda s: _e(_count(stat("rows_in")(s)))),
    ]


def _pairs(rows: Sequence[tuple[str, str]], caption: str) -> str:
    """A two-column table of already escaped (name, value) cells."""
    body = "".join(f'<tr><th scope="row">{name}</th><td>{value}</td></tr>'
                   for name, value in rows)
    return f'<table class="pairs"><caption>{_e(caption)}</caption><tbody>{body}</tbody></table>'


# -- the page ----------------------------------------------------------------------------------

def _keyedstate_version() -> str:
    try:
        return version("keyedstate")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "(source)"


def _restore_mode(report: CheckpointReport) -> str | None:
    """How the job's lineage started from a snapshot: recorded by a claim, else the
    configured mode (None: started from empty state, or not known)."""
    props = report.latest.properties
    if not props.get(RESTORED_FROM) and RESTORE_MODE not in props:
        return None
    return props.get(RESTORE_MODE) or report.configuration.get(
        "execution.state-recovery.claim-mode")


def _job_rows(report: CheckpointReport) -> list[tuple[str, str]]:
    meta, props = report.latest, report.latest.properties
    watermark = props.get(WATERMARK)
    if watermark is not None:
        try:
            ms = int(watermark)
            watermark = "none yet" if ms < _NO_WATERMARK else f"{ms} ({_utc(ms)})"
        except ValueError:
            pass
    rows: list[tuple[str, Any]] = [
        ("latest snapshot", report.latest_url),
        ("kind / format", f"{meta.kind} / {meta.format}"),
        ("checkpoint id", meta.checkpoint_id),
        ("batch", props.get(BATCH_ID, BLANK)),
        ("backend", meta.backend),
        ("parallelism", meta.parallelism),
        ("max parallelism", meta.max_parallelism),
        ("key types", ", ".join(meta.key_types)),
        ("key columns", ", ".join(json.loads(props[PROP_KEY_COLUMNS]))
         if PROP_KEY_COLUMNS in props else BLANK),
        ("watermark", watermark if watermark is not None else BLANK),
        ("restored from", props.get(RESTORED_FROM) or ("empty state" if RESTORED_FROM in props
                                                        else BLANK)),
        ("restore mode", _restore_mode(report) or BLANK),
        ("claimed from", props.get(CLAIMED_FROM, BLANK)),
        ("savepoint of", props.get(SAVEPOINT_OF, BLANK)),
        ("drained", props.get(DRAINED, BLANK)),
    ]
    for key in sorted(props):
        if key in _SHOWN_ELSEWHERE or key.startswith((PROP_PREFIX, RESTORE_PREFIX)):
            continue
        rows.append((key, props[key]))
    return [(_e(k), f"<code>{_e(v)}</code>") for k, v in rows]


def _config_rows(report: CheckpointReport) -> list[tuple[str, str]]:
    rows = []
    for key, value in sorted(report.configuration.items()):
        text = BLANK if value is None else (json.dumps(value) if isinstance(value, (dict, list))
                                            else value)
        rows.append((_e(key), f"<code>{_e(text)}</code>"))
    return rows


def _summary(history: Sequence[CompletedCheckpointStats]) -> str:
    """Flink's summary: minimum, average and maximum over the history."""
    measures = [("end to end", "end_to_end_ms", _duration), ("sync", "sync_ms", _duration),
                ("async", "async_ms", _duration), ("restore", "restore_ms", _duration),
                ("incremental", "incremental_bytes", _bytes), ("full", "full_bytes", _bytes)]
    body = []
    for label, field, fmt in measures:
        values = [getattr(r, field) for r in history if getattr(r, field) is not None]
        if values:
            cells = (fmt(min(values)), fmt(sum(values) / len(values)), fmt(max(values)))
        else:
            cells = (BLANK, BLANK, BLANK)
        body.append(f'<tr><th scope="row">{_e(label)}</th>'
                    + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    return ('<table class="summary" id="summary"><caption>over the history</caption><thead>'
            '<tr><th></th><th scope="col">minimum</th><th scope="col">average</th>'
            '<th scope="col">maximum</th></tr></thead><tbody>' + "".join(body)
            + "</tbody></table>")


def _cards(report: CheckpointReport) -> str:
    history = report.history
    last = history[-1]
    restores = [r for r in history if r.restored_subtasks]
    props = report.latest.properties
    cards = [
        ("checkpoints", f'<div class="big">{len(history)}</div>in the history, '
                        f'{len(report.retained)} retained'
                        + (f', <span class="error">{len(report.unreadable)} unreadable</span>'
                           if report.unreadable else "")),
        (f"latest {report.retained[-1].kind}",
         f'<div class="big">{_e(last.checkpoint_id)}</div>batch '
         f'{_e(_count(last.batch_id))}, {_e(_utc(last.trigger_ms))}<br>'
         f'full {_e(_bytes(last.full_bytes))}, incremental {_e(_bytes(last.incremental_bytes))}'),
    ]
    if restores:
        r = restores[-1]
        cards.append(("latest restore", f'<div class="big">{_e(_duration(r.restore_ms))}</div>'
                      f'before checkpoint {_e(r.checkpoint_id)}: {_e(r.restored_subtasks)} of '
                      f'{_e(_count(r.parallelism))} subtasks restored, '
                      f'{_e(_bytes(r.downloaded_bytes))} downloaded'))
    else:
        cards.append(("latest restore", '<div class="big">' + BLANK + '</div>no restore in '
                      'the history'))
    origin = props.get(RESTORED_FROM)
    if origin is None:
        started = f'<div class="big">{BLANK}</div>not recorded'
    elif origin:
        started = (f'<div class="big">{_e(_restore_mode(report) or "a snapshot")}</div>'
                   f'<code>{_e(origin)}</code>')
    else:
        started = '<div class="big">empty state</div>a new job, no snapshot'
    cards.append(("job started from", started))
    return '<div class="cards">' + "".join(
        f'<div class="card"><h3>{_e(title)}</h3>{body}</div>' for title, body in cards) + "</div>"


def _details(snapshot: SnapshotReport, is_latest: bool) -> str:
    largest = max((s.full_bytes for s in snapshot.subtasks), default=0)
    s = snapshot.stats
    title = (f"{snapshot.kind} {snapshot.checkpoint_id}"
             + (f", batch {s.batch_id}" if s.batch_id is not None else "")
             + f": {human_bytes(s.full_bytes or 0)} full over {len(snapshot.subtasks)} subtasks")
    table = _sortable(f"subtasks-{snapshot.checkpoint_id}", _subtask_columns(largest),
                      snapshot.subtasks, "subtasks", sort_column=0, descending=False)
    return (f'<details id="chk-{_e(snapshot.checkpoint_id)}"{" open" if is_latest else ""}>'
            f'<summary>{_e(title)}</summary><p class="note"><code>{_e(snapshot.metadata_url)}'
            f'</code></p><div class="scroll">{table}</div></details>')


def render_report(report: CheckpointReport, generated: dt.datetime | None = None) -> str:
    """The report page of ``report`` as one HTML document (see the module docstring)."""
    generated = generated or dt.datetime.now(dt.timezone.utc)
    history = report.history
    ids = [r.checkpoint_id for r in history]

    def series(label: str, field: str) -> Series:
        return Series(label, _COLORS[label], [getattr(r, field) for r in history])

    size_plot = line_plot(
        "plot-size", "State size per checkpoint (full: all referenced files; incremental: "
        "written by the checkpoint)", ids,
        [series("full", "full_bytes"), series("incremental", "incremental_bytes")],
        BYTE_UNITS, human_bytes)
    duration_plot = line_plot(
        "plot-duration", "Snapshot and restore durations per checkpoint (slowest subtask)",
        ids, [series("sync", "sync_ms"), series("async", "async_ms"),
              series("restore", "restore_ms")], MS_UNITS, _duration)
    retained_ids = {s.checkpoint_id for s in report.retained}
    columns = _history_columns()
    # The checkpoint id links to its details when it is retained.
    columns[0] = (columns[0][0], columns[0][1], columns[0][2],
                  lambda r: (f'<a href="#chk-{_e(r.checkpoint_id)}">{_e(r.checkpoint_id)}</a>'
                             if r.checkpoint_id in retained_ids else _e(r.checkpoint_id)))
    history_table = _sortable("history-table", columns, history,
                              f"{len(history)} checkpoint{'s' if len(history) != 1 else ''} "
                              f"(newest first; click a header to sort)", sort_column=0,
                              descending=True)
    unreadable = ""
    if report.unreadable:
        items = "".join(f'<li><code>{_e(u.metadata_url)}</code>: <span class="error">'
                        f'{_e(u.error)}</span></li>' for u in report.unreadable)
        unreadable = f'<h2 id="unreadable">Unreadable checkpoints</h2><ul>{items}</ul>'
    config_rows = _config_rows(report)
    config = (_pairs(config_rows, "configuration (as recorded)") if config_rows else
              '<p class="note">The configuration was not recorded (a snapshot written before '
              'keyedstate recorded it, or a savepoint).</p>')
    details = "".join(_details(s, s is report.retained[-1]) for s in reversed(report.retained))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_e(CSP)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="keyedstate {_e(_keyedstate_version())}">
<title>Checkpoint history: {_e(report.directory)}</title>
<style>{CSS}</style>
</head>
<body>
<header>
<h1>Checkpoint history</h1>
<div class="where">{_e(report.directory)}</div>
<div class="meta">generated {_e(_utc(int(generated.timestamp() * 1000)))} by keyedstate
{_e(_keyedstate_version())} from the checkpoints' <code>_metadata</code> files</div>
</header>
<nav><a href="#overview">Overview</a><a href="#plots">Plots</a><a href="#history">History</a>
<a href="#details">Checkpoint details</a><a href="#job">Job and configuration</a></nav>
<main>
<h2 id="overview">Overview</h2>
{_cards(report)}
<div class="scroll" style="display:inline-block;margin-top:12px">{_summary(history)}</div>
<h2 id="plots">Plots</h2>
<div class="plots">{size_plot}{duration_plot}</div>
<h2 id="history">History</h2>
<div class="scroll">{history_table}</div>
<p class="note">A blank ({BLANK}) is a figure the checkpoint did not record: one written
before keyedstate recorded statistics, a claimed snapshot, or a savepoint. Durations are the
slowest subtask's. The history is what the latest checkpoint carries (the job's last
checkpoints), plus every retained checkpoint.</p>
{unreadable}
<h2 id="details">Checkpoint details (retained)</h2>
{details}
<h2 id="job">Job and configuration</h2>
{_pairs(_job_rows(report), "job (latest snapshot)")}{config}
</main>
<script>{JS}</script>
</body>
</html>
"""


__all__ = ["render_report"]
