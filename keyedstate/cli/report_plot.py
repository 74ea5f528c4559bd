"""Line plots as inline SVG for the checkpoint report page (:mod:`keyedstate.cli.report_page`):
drawn here, in Python, so that the page needs no plotting library, no script and no network.

A plot puts its x labels (checkpoint ids) at even steps, one line per series through its
consecutive known values (None breaks a line), a dot with a tooltip on each value, a y axis in
the unit that suits its largest value, and a legend. Every text is escaped.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Callable, Sequence

#: y-axis units: name and size in the values' own unit (largest that fits the data wins)
BYTE_UNITS = (("B", 1.0), ("KiB", 1024.0), ("MiB", 1024.0 ** 2), ("GiB", 1024.0 ** 3))
MS_UNITS = (("ms", 1.0), ("s", 1000.0))

_WIDTH, _HEIGHT = 640, 280
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 16, 34, 44


@dataclass(frozen=True)
class Series:
    """One line: its ``label`` (legend, tooltips, ``data-series``), ``color`` and one value
    per x label (None: not recorded)."""

    label: str
    color: str
    values: Sequence[float | None]


def escape(value: object) -> str:
    """``value`` as escaped HTML text (attribute-safe): every text the page takes from a
    checkpoint goes through it."""
    return html.escape(str(value), quote=True)


def nice_step(span: float, ticks: int = 5) -> float:
    """A round tick step (1, 2, 2.5 or 5 times a power of ten) giving about ``ticks`` ticks
    up to ``span`` (> 0)."""
    raw = span / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude  # pragma: no cover - factor 10 always fits


def _unit(largest: float, units: Sequence[tuple[str, float]]) -> tuple[str, float]:
    chosen = units[0]
    for unit in units:
        if largest >= unit[1]:
            chosen = unit
    return chosen


def line_plot(plot_id: str, title: str, x_labels: Sequence[object], series: Sequence[Series],
              units: Sequence[tuple[str, float]], describe: Callable[[float], str],
              x_title: str = "checkpoint") -> str:
    """A ``<figure>`` holding an SVG line plot (``id`` ``plot_id``) of ``series`` over
    ``x_labels``; ``describe`` formats a value for its tooltip. Without a single known value
    the figure says "not recorded"."""
    inner_w, inner_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM
    known = [v for s in series for v in s.values if v is not None]
    out = [f'<figure class="plot"><svg id="{escape(plot_id)}" viewBox="0 0 {_WIDTH} {_HEIGHT}" '
           f'role="img" aria-labelledby="{escape(plot_id)}-title">'
           f'<title id="{escape(plot_id)}-title">{escape(title)}</title>']
    if not known or not x_labels:
        out.append(f'<text x="{_WIDTH / 2}" y="{_HEIGHT / 2}" text-anchor="middle" '
                   f'class="empty">not recorded</text></svg>'
                   f'<figcaption>{escape(title)}</figcaption></figure>')
        return "".join(out)
    unit, scale = _unit(max(known), units)
    top_value = max(max(known) / scale, 1e-9)  # all zero: still a y axis
    step = nice_step(top_value)
    y_max = step * math.ceil(top_value / step)
    n = len(x_labels)

    def x(i: int) -> float:
        return _LEFT + (inner_w / 2 if n == 1 else inner_w * i / (n - 1))

    def y(v: float) -> float:
        return _TOP + inner_h - inner_h * (v / scale) / y_max

    # Grid, y ticks in the chosen unit, x labels (at most about ten), axes.
    for t in range(int(round(y_max / step)) + 1):
        ty = _TOP + inner_h - inner_h * step * t / y_max
        out.append(f'<line class="grid" x1="{_LEFT}" x2="{_LEFT + inner_w}" y1="{ty:.1f}" '
                   f'y2="{ty:.1f}"/><text class="tick" x="{_LEFT - 6}" y="{ty + 4:.1f}" '
                   f'text-anchor="end">{escape(f"{step * t:g} {unit}")}</text>')
    every = max(1, math.ceil(n / 10))
    for i, label in enumerate(x_labels):
        if i % every == 0 or i == n - 1:
            out.append(f'<text class="tick" x="{x(i):.1f}" y="{_TOP + inner_h + 16}" '
                       f'text-anchor="middle">{escape(label)}</text>')
    out.append(f'<line class="axis" x1="{_LEFT}" x2="{_LEFT + inner_w}" '
               f'y1="{_TOP + inner_h}" y2="{_TOP + inner_h}"/><line class="axis" x1="{_LEFT}" '
               f'x2="{_LEFT}" y1="{_TOP}" y2="{_TOP + inner_h}"/><text class="tick" '
               f'x="{_LEFT + inner_w / 2}" y="{_HEIGHT - 8}" text-anchor="middle">'
               f'{escape(x_title)}</text>')
    # Each series: lines through runs of known values, a dot with a tooltip on each value.
    legend_x = _LEFT
    for s in series:
        out.append(f'<g class="series" data-series="{escape(s.label)}">')
        runs: list[list[str]] = [[]]
        for i, value in enumerate(s.values):
            if value is None:
                runs.append([])
            else:
                runs[-1].append(f"{x(i):.1f},{y(value):.1f}")
        for points in runs:
            if len(points) > 1:
                out.append(f'<polyline fill="none" stroke="{escape(s.color)}" stroke-width="2" '
                           f'points="{" ".join(points)}"/>')
        for i, value in enumerate(s.values):
            if value is not None:
                tip = f"{x_title} {x_labels[i]}: {s.label} {describe(value)}"
                out.append(f'<circle cx="{x(i):.1f}" cy="{y(value):.1f}" r="3" '
                           f'fill="{escape(s.color)}"><title>{escape(tip)}</title></circle>')
        out.append("</g>")
        out.append(f'<rect x="{legend_x}" y="10" width="12" height="12" fill="{escape(s.color)}"/>'
                   f'<text class="legend" x="{legend_x + 16}" y="20">{escape(s.label)}</text>')
        legend_x += 40 + 8 * len(s.label)
    out.append(f'</svg><figcaption>{escape(title)}</figcaption></figure>')
    return "".join(out)


__all__ = ["BYTE_UNITS", "MS_UNITS", "Series", "line_plot", "nice_step"]
