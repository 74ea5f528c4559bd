"""What the latency-shaping filesystem counts: requests by kind and area with their bytes and
seconds, summed per process (:func:`process_counts`) or read back from a request log
(:func:`read_request_log`)."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

#: Request kinds, as the wrapper counts them (``mkdir``: passed through, free, not in totals).
KINDS = ("read", "write", "copy", "list", "head", "delete", "mkdir")
#: The kinds a store sees: what totals sum.
STORE_KINDS = KINDS[:-1]


@dataclass(frozen=True)
class Cell:
    """Requests of one kind to one area: how many, the bytes they moved, the seconds the
    model charged and the wall seconds they took."""

    requests: int = 0
    bytes: int = 0
    modeled_s: float = 0.0
    wall_s: float = 0.0

    def __add__(self, other: Cell) -> Cell:
        return Cell(self.requests + other.requests, self.bytes + other.bytes,
                    self.modeled_s + other.modeled_s, self.wall_s + other.wall_s)

    def __sub__(self, other: Cell) -> Cell:
        return Cell(self.requests - other.requests, self.bytes - other.bytes,
                    self.modeled_s - other.modeled_s, self.wall_s - other.wall_s)

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "bytes": self.bytes,
                "modeled_s": round(self.modeled_s, 6), "wall_s": round(self.wall_s, 6)}


@dataclass(frozen=True)
class RequestCounts:
    """Counted requests, by ``(kind, area)``. Totals (no ``kind`` given) sum
    :data:`STORE_KINDS` only. ``later - earlier`` is what happened in between, ``a + b``
    both."""

    cells: Mapping[tuple[str, str], Cell] = field(default_factory=dict)

    def cell(self, kind: str | None = None, area: str | None = None) -> Cell:
        """The sum of the cells of ``kind`` (every store kind: None) in ``area`` (any: None)."""
        total = Cell()
        for (k, a), c in self.cells.items():
            if (k == kind if kind is not None else k in STORE_KINDS) and area in (None, a):
                total = total + c
        return total

    def requests(self, kind: str | None = None, area: str | None = None) -> int:
        return self.cell(kind, area).requests

    def bytes(self, kind: str | None = None, area: str | None = None) -> int:
        return self.cell(kind, area).bytes

    def modeled_s(self, kind: str | None = None, area: str | None = None) -> float:
        return self.cell(kind, area).modeled_s

    def wall_s(self, kind: str | None = None, area: str | None = None) -> float:
        return self.cell(kind, area).wall_s

    def __add__(self, other: RequestCounts) -> RequestCounts:
        keys = set(self.cells) | set(other.cells)
        return RequestCounts({k: self.cells.get(k, Cell()) + other.cells.get(k, Cell())
                              for k in keys})

    def __sub__(self, other: RequestCounts) -> RequestCounts:
        keys = set(self.cells) | set(other.cells)
        diff = {k: self.cells.get(k, Cell()) - other.cells.get(k, Cell()) for k in keys}
        return RequestCounts({k: c for k, c in diff.items() if c != Cell()})

    def as_dict(self) -> dict[str, Any]:
        """``total``, ``by_kind`` and ``by_area`` (store kinds; ``mkdir`` apart), as JSON."""
        kinds = sorted({k for k, _ in self.cells}, key=KINDS.index)
        areas = sorted({a for k, a in self.cells if k in STORE_KINDS})
        return {"total": self.cell().as_dict(),
                "by_kind": {k: self.cell(k).as_dict() for k in kinds},
                "by_area": {a: self.cell(area=a).as_dict() for a in areas}}


class _Meter:
    """A process's counts (every ``kslatency`` filesystem of the process adds to it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cells: dict[tuple[str, str], Cell] = {}

    def add(self, kind: str, area: str, cell: Cell) -> None:
        with self._lock:
            self._cells[(kind, area)] = self._cells.get((kind, area), Cell()) + cell

    def snapshot(self) -> RequestCounts:
        with self._lock:
            return RequestCounts(dict(self._cells))


_METER = _Meter()


def count_request(kind: str, area: str, cell: Cell) -> None:
    """Add one shaped request (or a streamed read's bytes) to this process's counts."""
    _METER.add(kind, area, cell)


def process_counts() -> RequestCounts:
    """Everything every ``kslatency`` filesystem of this process counted so far (subtract an
    earlier snapshot for what happened in between)."""
    return _METER.snapshot()


@dataclass(frozen=True)
class RequestRecord:
    """One request as ``log_dir`` records it: when it started (epoch seconds), which
    process, its kind and area, and its figures (``requests`` 0: bytes of a streamed read
    after its request)."""

    t: float
    pid: int
    kind: str
    area: str
    requests: int
    bytes: int
    modeled_s: float
    wall_s: float


def read_request_log(log_dir: str) -> list[RequestRecord]:
    """Every request the processes logged in ``log_dir``, in start order."""
    records: list[RequestRecord] = []
    if not os.path.isdir(log_dir):
        return records
    for name in sorted(os.listdir(log_dir)):
        if not (name.startswith("requests-") and name.endswith(".jsonl")):
            continue
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                if line.strip():
                    records.append(RequestRecord(**json.loads(line)))
    return sorted(records, key=lambda r: r.t)


def round_trips(records: Iterable[RequestRecord], slack_s: float = 1e-3) -> int:
    """The requests on the critical path of ``records``: the longest run of them in which each
    starts after the one before it ended (the most pairwise disjoint ones, each request
    spanning ``[t, t + wall_s]``; chosen greedily by end). N requests one after another are N
    round trips; N at once are 1; N through a pool of T threads about N / T. ``slack_s``:
    a request starting this much before the previous one's end still follows it (the start
    is a wall clock, the duration a monotonic one). Records of a streamed read's bytes
    (``requests`` 0) are no request."""
    spans = sorted(((r.t, r.t + r.wall_s) for r in records if r.requests),
                   key=lambda span: span[1])
    count, last_end = 0, float("-inf")
    for start, end in spans:
        if start >= last_end - slack_s:
            count += 1
            last_end = end
    return count


def peak_in_flight(records: Iterable[RequestRecord]) -> int:
    """The most of ``records``' requests in flight at one instant (each from ``t`` for
    ``wall_s``; one ending as another starts is not both)."""
    events = sorted([(r.t, 1) for r in records if r.requests]
                    + [(r.t + r.wall_s, -1) for r in records if r.requests])
    peak = current = 0
    for _, step in events:  # at one instant, ends (-1) sort before starts
        current += step
        peak = max(peak, current)
    return peak


def counts_of(records: Iterator[RequestRecord] | list[RequestRecord]) -> RequestCounts:
    """The :class:`RequestCounts` of logged requests."""
    cells: dict[tuple[str, str], Cell] = {}
    for r in records:
        cells[(r.kind, r.area)] = cells.get((r.kind, r.area), Cell()) + Cell(
            r.requests, r.bytes, r.modeled_s, r.wall_s)
    return RequestCounts(cells)
