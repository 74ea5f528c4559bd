"""The static parts of the checkpoint report page (:mod:`keyedstate.cli.report_page`): its
style sheet, its one script, and its Content-Security-Policy. Inline in the page, which
loads nothing (the policy forbids every request)."""

from __future__ import annotations

#: The page's style sheet (system fonts, nothing fetched).
CSS = """
:root { --fg: #1d2330; --muted: #5f6b7a; --line: #d9dee5; --head: #f3f5f8; --accent: #2f6fb0; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: var(--fg); background: #fff; }
header { padding: 18px 28px 12px; border-bottom: 1px solid var(--line); background: #fafbfc; }
header h1 { margin: 0 0 4px; font-size: 20px; }
header .where { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 13px;
                word-break: break-all; }
header .meta, .note { color: var(--muted); font-size: 12px; }
nav { padding: 8px 28px; border-bottom: 1px solid var(--line); }
nav a { color: var(--accent); margin-right: 18px; text-decoration: none; }
main { padding: 8px 28px 40px; }
h2 { font-size: 16px; margin: 26px 0 10px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 10px 14px; min-width: 210px;
        flex: 1 1 210px; }
.card h3 { margin: 0 0 6px; font-size: 12px; text-transform: uppercase; letter-spacing: .04em;
           color: var(--muted); }
.card .big { font-size: 20px; font-weight: 600; }
.plots { display: flex; flex-wrap: wrap; gap: 16px; }
figure.plot { margin: 0; flex: 1 1 520px; max-width: 720px; border: 1px solid var(--line);
              border-radius: 6px; padding: 6px; }
figure.plot svg { width: 100%; height: auto; display: block; }
figure.plot figcaption { font-size: 12px; color: var(--muted); padding: 0 6px 4px; }
svg .grid { stroke: #eceff3; } svg .axis { stroke: #9aa4b1; }
svg .tick, svg .legend { font-size: 11px; fill: #4a5563; } svg .empty { fill: var(--muted); }
.scroll { overflow-x: auto; border: 1px solid var(--line); border-radius: 6px; }
table { border-collapse: collapse; font-size: 13px; }
caption { text-align: left; font-weight: 600; padding: 8px 10px; }
th, td { padding: 4px 10px; border-top: 1px solid var(--line); white-space: nowrap; }
td { text-align: right; font-variant-numeric: tabular-nums; }
table.pairs td { text-align: left; white-space: normal; word-break: break-all;
                 font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
table.pairs th { text-align: left; font-weight: 500; color: var(--muted); }
table.pairs { margin: 0 16px 16px 0; vertical-align: top; display: inline-table;
              min-width: 360px; max-width: 100%; border: 1px solid var(--line); }
thead th { background: var(--head); position: sticky; top: 0; }
thead th button { all: unset; cursor: pointer; font-weight: 600; }
thead th button:focus-visible { outline: 2px solid var(--accent); }
thead th[aria-sort="ascending"] button::after { content: " \\25B2"; font-size: 10px; }
thead th[aria-sort="descending"] button::after { content: " \\25BC"; font-size: 10px; }
tbody tr:nth-child(even) { background: #fbfcfd; }
tbody tr:hover { background: #eef4fb; }
td:first-child { text-align: left; }
td { position: relative; }
.bar { position: absolute; left: 0; top: 3px; bottom: 3px; background: #dbe8f6; z-index: 0; }
.barlabel { position: relative; z-index: 1; }
details { margin: 10px 0; border: 1px solid var(--line); border-radius: 6px; padding: 6px 10px; }
summary { cursor: pointer; font-weight: 600; }
.error { color: #b3261e; }
code { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px;
       word-break: break-all; }
"""

# Sorting: a click on a header sorts its table by that column (again: the other way). Cells
# carry their sort key in data-sort; numbers compare as numbers, blanks sort last both ways.
# Once set up, <html data-ready="true"> (what the browser tests wait for).
JS = """
(function () {
  "use strict";
  function sortKey(cell) {
    var raw = cell.getAttribute("data-sort");
    if (raw === null || raw === "") { return null; }
    var n = Number(raw);
    return isNaN(n) ? raw : n;
  }
  function sortTable(table, column, order) {
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var keyed = rows.map(function (row, i) {
      return { row: row, key: sortKey(row.cells[column]), i: i };
    });
    keyed.sort(function (a, b) {
      if (a.key === null || b.key === null) {
        return a.key === b.key ? a.i - b.i : (a.key === null ? 1 : -1);
      }
      var c = a.key < b.key ? -1 : a.key > b.key ? 1 : 0;
      return (order === "desc" ? -c : c) || a.i - b.i;
    });
    keyed.forEach(function (k) { body.appendChild(k.row); });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
      if (i === column) {
        th.setAttribute("aria-sort", order === "desc" ? "descending" : "ascending");
      } else {
        th.removeAttribute("aria-sort");
      }
    });
    table.setAttribute("data-sort-column", String(column));
    table.setAttribute("data-sort-order", order);
  }
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    sortTable(table, Number(table.getAttribute("data-sort-column")),
              table.getAttribute("data-sort-order"));
    table.tHead.addEventListener("click", function (event) {
      var button = event.target.closest("button[data-column]");
      if (!button) { return; }
      var column = Number(button.getAttribute("data-column"));
      var same = Number(table.getAttribute("data-sort-column")) === column;
      var order = same && table.getAttribute("data-sort-order") === "asc" ? "desc" : "asc";
      sortTable(table, column, order);
    });
  });
  document.documentElement.setAttribute("data-ready", "true");
})();
"""

#: Nothing may be loaded: no script, style, image, font or connection from anywhere.
CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
        "img-src data:; base-uri 'none'; form-action 'none'")


__all__ = ["CSP", "CSS", "JS"]
