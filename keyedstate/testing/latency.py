"""A latency-shaping fsspec filesystem: an object store's round trips on any filesystem.

``kslatency://<path>`` wraps any fsspec filesystem (``target_protocol``, ``target_options``:
a local directory or the local S3 server) and makes every request take what a
:class:`LatencyModel` says a real store takes: a first-byte latency per request plus, for the
bytes a request moves, ``bytes / bandwidth`` on that request's own stream (each transfer is
one stream: parallel transfers do not share a bandwidth). A request takes the model's time or
the inner filesystem's, whichever is longer: the wrapper sleeps the difference. The local S3
server answers in microseconds and a local disk in less; behind the wrapper a benchmark sees
the round trips a job pays on S3 (docs/object-storage.md, "A latency model for benchmarks")::

    model = parse_latency("s3-standard-same-region")        # or "first_byte_ms=30,mb_per_s=90"
    url, options = behind_latency("/data/ckpt", {}, model)   # or "s3://bucket/job", s3 options
    config = JobConfig(checkpoint_dir=url, storage_options=options, ...)

What it counts: every request by kind (:data:`KINDS`) and by the area of the snapshot root
its path lies in (:func:`~keyedstate.storage.layout.area_of`: ``shared``, ``metadata``,
``staging``, ``commits`` ...), with the bytes it moved, the seconds the model charged and the
wall seconds it took. Each process sums its own (:func:`process_counts`, thread-safe: uploads
run in threads); with ``log_dir`` every process also appends one JSON line per request to
``<log_dir>/requests-<pid>.jsonl`` (:func:`read_request_log`), which is how a benchmark counts
the requests of Spark's Python workers. Tests assert on counts and modeled seconds, which
are exact, never on wall time.

What is one request (as s3fs issues them, simplified): a ``pipe_file``, ``put_file``, or a
file opened for writing and closed is one PUT; ``cat_file``, ``get_file`` or a file opened
for reading is one GET (a streamed read pays the bandwidth as its bytes arrive); ``info``,
``exists``, ``size``, ``isfile``, ``isdir`` one HEAD; ``ls``, ``find``, ``glob`` one LIST per
1,000 entries found (at least one); ``copy`` one server-side copy (a first byte, no transfer:
no byte passes through the client); ``rm_file`` one DELETE; a recursive ``rm`` a LIST and one
DELETE per 1,000 objects (S3's ``DeleteObjects``). ``makedirs`` and ``mkdir`` reach the
inner filesystem unshaped and are counted apart (kind ``mkdir``, never in the totals):
keyedstate sends none to an object store (checkpoint storage skips them where the wrapped
filesystem is one), and over a local directory they are not requests S3 would see.

Test and benchmark machinery, not a production path: the protocol is registered through the
``fsspec.specs`` entry point in ``pyproject.toml`` (every process: drivers, Spark's Python
workers) and, for a process whose installed metadata predates that entry point, when this
module is imported.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, TypeVar

import fsspec
from fsspec.spec import AbstractFileSystem

from keyedstate.errors import LatencyModelError
from keyedstate.storage.layout import area_of

PROTOCOL = "kslatency"
T = TypeVar("T")

#: Request kinds, as the wrapper counts them (``mkdir``: passed through, free, not in totals).
KINDS = ("read", "write", "copy", "list", "head", "delete", "mkdir")
#: The kinds a store sees: what totals sum.
STORE_KINDS = KINDS[:-1]
#: A megabyte as transfer rates count it (10**6 bytes: 15 requests at 85 MB/s fill 10 Gb/s).
MB = 1_000_000
#: Entries one LIST or one ``DeleteObjects`` request handles on S3.
_PAGE = 1000
#: Storage options fsspec itself passes to every filesystem (accepted, unused).
_FSSPEC_OPTIONS = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths",
                             "skip_instance_cache", "asynchronous", "loop"})


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyModel:
    """What one request costs: ``first_byte_ms`` before its first byte, then its bytes at
    ``mb_per_s`` megabytes (10**6 bytes) per second on its own stream (None: no bandwidth
    limit). ``name`` says where the figures come from (``"custom"`` for figures given by
    hand); :data:`MODELS` holds the named ones. Raises :class:`LatencyModelError` naming the
    parameter for a negative latency or a bandwidth that is not positive."""

    name: str
    first_byte_ms: float
    mb_per_s: float | None = None
    #: the published figures the model takes (docs/object-storage.md cites them)
    source: str = ""

    def __post_init__(self) -> None:
        if not _finite(self.first_byte_ms) or self.first_byte_ms < 0:
            raise LatencyModelError(
                f"latency model {self.name!r}: first_byte_ms must be a number >= 0 (milliseconds "
                f"before a request's first byte), got {self.first_byte_ms!r}")
        if self.mb_per_s is not None and (not _finite(self.mb_per_s) or self.mb_per_s <= 0):
            raise LatencyModelError(
                f"latency model {self.name!r}: mb_per_s must be a number > 0 (megabytes per "
                f"second per stream; leave it out for no bandwidth limit), got "
                f"{self.mb_per_s!r}")

    @property
    def first_byte_s(self) -> float:
        return self.first_byte_ms / 1000

    def transfer_s(self, nbytes: int) -> float:
        """Seconds ``nbytes`` take on one stream (0 without a bandwidth limit)."""
        return 0.0 if self.mb_per_s is None else nbytes / (self.mb_per_s * MB)

    def request_s(self, nbytes: int = 0) -> float:
        """Seconds one request moving ``nbytes`` takes: first byte plus transfer."""
        return self.first_byte_s + self.transfer_s(nbytes)

    def parameters(self) -> dict[str, Any]:
        """The model as a benchmark's JSON records it."""
        return {"name": self.name, "first_byte_ms": self.first_byte_ms,
                "mb_per_s": self.mb_per_s, "source": self.source}

    def storage_options(self, target_protocol: str,
                        target_options: Mapping[str, Any] | None = None,
                        log_dir: str | None = None) -> dict[str, Any]:
        """The ``kslatency://`` storage options that put ``target_protocol`` (``"file"``,
        ``"s3"`` ...) with its own options behind this model (``log_dir``: see the module)."""
        options: dict[str, Any] = {"target_protocol": target_protocol,
                                   "target_options": dict(target_options or {}),
                                   "model": self.name, "first_byte_ms": self.first_byte_ms,
                                   "mb_per_s": self.mb_per_s}
        if log_dir is not None:
            options["log_dir"] = os.fspath(log_dir)
        return options


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: The named models (docs/object-storage.md, "A latency model for benchmarks", cites the
#: figures): S3 Standard from an instance in the bucket's region, from AWS's "Best practices
#: design patterns: optimizing Amazon S3 performance" (first-byte-out latency "roughly
#: 100-200 milliseconds": the low end) and its whitepaper's "one concurrent request for each
#: 85-90 MB/s" (the high end).
MODELS: dict[str, LatencyModel] = {
    "s3-standard-same-region": LatencyModel(
        "s3-standard-same-region", first_byte_ms=100.0, mb_per_s=90.0,
        source="AWS S3 User Guide, 'Best practices design patterns: optimizing Amazon S3 "
               "performance': small-object and first-byte-out latencies of roughly 100-200 ms; "
               "whitepaper 'Best Practices Design Patterns: Optimizing Amazon S3 Performance', "
               "'Horizontal Scaling and Request Parallelization for High Throughput': one "
               "concurrent request per 85-90 MB/s"),
}
DEFAULT_MODEL = "s3-standard-same-region"
#: What ``--latency none`` means: no wrapper at all.
NONE = "none"
_SPEC_KEYS = {"first_byte_ms": "first_byte_ms", "ms": "first_byte_ms", "mb_per_s": "mb_per_s"}


def parse_latency(spec: str) -> LatencyModel | None:
    """The model a benchmark's ``--latency`` names: ``none`` (None: no wrapper), a name of
    :data:`MODELS`, or comma-separated ``key=value`` figures (``first_byte_ms`` or its short
    form ``ms``, ``mb_per_s``), optionally after a name whose figures they override:
    ``ms=30,mb_per_s=90``, ``s3-standard-same-region,first_byte_ms=30``. Figures without a
    name start from no latency and no bandwidth limit. Raises :class:`LatencyModelError`
    naming the part it can't read (``mbps`` is refused as ambiguous: megabits or megabytes)."""
    text = str(spec).strip()
    if text.lower() == NONE:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise LatencyModelError(f"--latency {spec!r} is empty; give {NONE!r}, a model name "
                                f"({', '.join(MODELS)}) or figures like ms=30,mb_per_s=90")
    base: LatencyModel | None = None
    if "=" not in parts[0]:
        name = parts.pop(0)
        if name not in MODELS:
            raise LatencyModelError(f"--latency: unknown model {name!r}; known: "
                                    f"{', '.join([NONE, *MODELS])}, or figures like "
                                    f"ms=30,mb_per_s=90")
        base = MODELS[name]
    figures: dict[str, float] = {}
    for part in parts:
        key, _, value = part.partition("=")
        key = key.strip()
        if key == "mbps":
            raise LatencyModelError(
                f"--latency {spec!r}: 'mbps' is ambiguous (megabits or megabytes per second?); "
                f"write mb_per_s=<megabytes per second per stream>")
        if key not in _SPEC_KEYS or not value.strip():
            raise LatencyModelError(
                f"--latency {spec!r}: can't read {part!r}; figures are first_byte_ms (or ms) "
                f"and mb_per_s, as key=value, after an optional model name")
        try:
            figures[_SPEC_KEYS[key]] = float(value)
        except ValueError:
            raise LatencyModelError(f"--latency {spec!r}: {key} must be a number, got "
                                    f"{value.strip()!r}") from None
    if base is None:
        return LatencyModel("custom", figures.get("first_byte_ms", 0.0),
                            figures.get("mb_per_s"))
    if not figures:
        return base
    return LatencyModel(f"{base.name} (changed: {', '.join(f'{k}={v:g}' for k, v in figures.items())})",
                        figures.get("first_byte_ms", base.first_byte_ms),
                        figures.get("mb_per_s", base.mb_per_s), base.source)


def behind_latency(url: str, storage_options: Mapping[str, Any] | None,
                   model: LatencyModel | None, log_dir: str | None = None
                   ) -> tuple[str, dict[str, Any]]:
    """``url`` (a local path, ``file://``, ``s3://`` ...) and its storage options seen through
    ``kslatency://`` with ``model``; unchanged when ``model`` is None."""
    if model is None:
        return str(url), dict(storage_options or {})
    protocol, path = fsspec.core.split_protocol(str(url))
    if protocol in (None, "file", "local"):
        protocol, path = "file", os.path.abspath(path)
    return (f"{PROTOCOL}://{path}",
            model.storage_options(protocol, storage_options, log_dir))


def model_of_options(model: str | None = None, first_byte_ms: float | None = None,
                     mb_per_s: float | None = None) -> LatencyModel:
    """The model of ``kslatency://``'s storage options: the figures of ``model`` (a name of
    :data:`MODELS`; None: :data:`DEFAULT_MODEL`), each replaced where ``first_byte_ms`` or
    ``mb_per_s`` is given. Any other ``model`` is a label for figures given by hand: it needs
    ``first_byte_ms``, and without ``mb_per_s`` has no bandwidth limit."""
    base = MODELS.get(model or DEFAULT_MODEL)
    if base is None:
        if first_byte_ms is None:
            raise LatencyModelError(
                f"kslatency: unknown model {model!r} and no first_byte_ms; give a known model "
                f"({', '.join(MODELS)}) or the figures first_byte_ms (and mb_per_s)")
        return LatencyModel(str(model), first_byte_ms, mb_per_s)
    if first_byte_ms in (None, base.first_byte_ms) and mb_per_s in (None, base.mb_per_s):
        return base
    return LatencyModel(f"{base.name} (changed)",
                        base.first_byte_ms if first_byte_ms is None else first_byte_ms,
                        base.mb_per_s if mb_per_s is None else mb_per_s, base.source)


# --------------------------------------------------------------------------------------------
# counting
# --------------------------------------------------------------------------------------------


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


def counts_of(records: Iterator[RequestRecord] | list[RequestRecord]) -> RequestCounts:
    """The :class:`RequestCounts` of logged requests."""
    cells: dict[tuple[str, str], Cell] = {}
    for r in records:
        cells[(r.kind, r.area)] = cells.get((r.kind, r.area), Cell()) + Cell(
            r.requests, r.bytes, r.modeled_s, r.wall_s)
    return RequestCounts(cells)


# --------------------------------------------------------------------------------------------
# the filesystem
# --------------------------------------------------------------------------------------------


class LatencyFileSystem(AbstractFileSystem):
    """``kslatency://``: every call goes to ``target_fs``, shaped by the model its storage
    options give (``model``, ``first_byte_ms``, ``mb_per_s``: :func:`model_of_options`) and
    counted (module docstring). An unknown storage option raises :class:`LatencyModelError`
    naming it."""

    protocol = PROTOCOL

    def __init__(self, target_protocol: str = "file",
                 target_options: Mapping[str, Any] | None = None, model: str | None = None,
                 first_byte_ms: float | None = None, mb_per_s: float | None = None,
                 log_dir: str | None = None, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _FSSPEC_OPTIONS)
        if unknown:
            raise LatencyModelError(
                f"kslatency: unknown storage option(s) {unknown}; known: target_protocol, "
                f"target_options, model, first_byte_ms, mb_per_s, log_dir")
        super().__init__(target_protocol=target_protocol, target_options=target_options,
                         model=model, first_byte_ms=first_byte_ms, mb_per_s=mb_per_s,
                         log_dir=log_dir, **kwargs)
        self.model = model_of_options(model, first_byte_ms, mb_per_s)
        self.target_protocol = target_protocol
        target = dict(target_options or {})
        target.setdefault("use_listings_cache", False)  # as storage.connect, for the same reason
        # ``target_fs``: checkpoint storage looks through it (is the store an object store?)
        self.target_fs = fsspec.filesystem(target_protocol, **target)
        self.log_dir = os.fspath(log_dir) if log_dir is not None else None
        self._log_lock = threading.Lock()

    # -- shaping -------------------------------------------------------------------------------

    def _record(self, kind: str, path: Any, cell: Cell, started: float) -> None:
        area = area_of(str(path))
        _METER.add(kind, area, cell)
        if self.log_dir is not None:
            line = json.dumps({"t": started, "pid": os.getpid(), "kind": kind, "area": area,
                               "requests": cell.requests, "bytes": cell.bytes,
                               "modeled_s": cell.modeled_s, "wall_s": cell.wall_s})
            with self._log_lock:
                os.makedirs(self.log_dir, exist_ok=True)
                with open(os.path.join(self.log_dir, f"requests-{os.getpid()}.jsonl"),
                          "a") as f:
                    f.write(line + "\n")

    def _shaped(self, kind: str, path: Any, call: Callable[[], T], *,
                requests: int | Callable[[T], int] = 1,
                size: Callable[[T], int] | None = None, transfer: bool = True) -> T:
        """``call()`` taking at least the model's time for ``requests`` requests (a number,
        or a function of the result) moving the bytes ``size(result)`` gives (none without
        ``size``); counted, failed calls too (a 404 costs its round trip as well)."""
        started, t0 = time.time(), time.perf_counter()
        nbytes = 0
        if not callable(requests):
            count = requests
        else:
            count, of_result = 1, requests
        try:
            result = call()
            nbytes = size(result) if size is not None else 0
            if callable(requests):
                count = of_result(result)
            return result
        finally:
            modeled = count * self.model.first_byte_s + (
                self.model.transfer_s(nbytes) if transfer else 0.0)
            self._settle(t0, modeled)
            self._record(kind, path, Cell(count, nbytes, modeled,
                                          time.perf_counter() - t0), started)

    @staticmethod
    def _settle(t0: float, modeled: float) -> None:
        """Sleep until ``modeled`` seconds have passed since ``t0``."""
        left = modeled - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)

    @staticmethod
    def _pages(found: Any) -> int:
        """LIST (or ``DeleteObjects``) requests for ``found`` entries: one per 1,000."""
        return max(1, math.ceil(len(found) / _PAGE))

    # -- writes --------------------------------------------------------------------------------

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self._shaped("write", path, lambda: self.target_fs.pipe_file(path, value, **kwargs),
                     size=lambda _: len(value))

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        size = os.path.getsize(lpath)
        self._shaped("write", rpath, lambda: self.target_fs.put_file(lpath, rpath, **kwargs),
                     size=lambda _: size)

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:  # type: ignore[override]
        if "r" in mode:
            inner = self._shaped("read", path, lambda: self.target_fs.open(path, mode, **kwargs))
            return _ShapedReader(self, path, inner)
        started = time.time()
        return _ShapedWriter(self, path, self.target_fs.open(path, mode, **kwargs), started)

    # -- reads ---------------------------------------------------------------------------------

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        return self._shaped("read", path, lambda: bytes(self.target_fs.cat_file(
            path, start=start, end=end, **kwargs)), size=len)

    def get_file(self, rpath: str, lpath: str, **kwargs: Any) -> None:
        self._shaped("read", rpath, lambda: self.target_fs.get_file(rpath, lpath, **kwargs),
                     size=lambda _: os.path.getsize(lpath) if os.path.isfile(lpath) else 0)

    # -- server-side copies --------------------------------------------------------------------

    def copy(self, path1: Any, path2: Any, recursive: bool = False,  # type: ignore[override]
             **kwargs: Any) -> None:
        n = 1 if isinstance(path1, str) and not recursive else \
            len(self.target_fs.expand_path(path1, recursive=recursive))
        self._shaped("copy", path1 if isinstance(path1, str) else path2,
                     lambda: self.target_fs.copy(path1, path2, recursive=recursive, **kwargs),
                     requests=max(1, n), transfer=False)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._shaped("copy", path1, lambda: self.target_fs.cp_file(path1, path2, **kwargs),
                     transfer=False)

    # -- listings ------------------------------------------------------------------------------

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._shaped("list", path, lambda: self.target_fs.ls(path, detail=detail,
                                                                    **kwargs),
                            requests=self._pages)

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._shaped("list", path, lambda: self.target_fs.find(path, *args, **kwargs),
                            requests=self._pages)

    def glob(self, path: str, **kwargs: Any) -> Any:
        return self._shaped("list", path, lambda: self.target_fs.glob(path, **kwargs),
                            requests=self._pages)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self._shaped("head", path, lambda: self.target_fs.exists(path, **kwargs)))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return dict(self._shaped("head", path, lambda: self.target_fs.info(path, **kwargs)))

    def size(self, path: str) -> int:
        return int(self._shaped("head", path, lambda: self.target_fs.size(path)))

    def isfile(self, path: str) -> bool:
        return bool(self._shaped("head", path, lambda: self.target_fs.isfile(path)))

    def isdir(self, path: str) -> bool:
        return bool(self._shaped("head", path, lambda: self.target_fs.isdir(path)))

    # -- deletes -------------------------------------------------------------------------------

    def rm_file(self, path: str) -> None:
        self._shaped("delete", path, lambda: self.target_fs.rm_file(path))

    def rm(self, path: Any, recursive: bool = False, **kwargs: Any) -> None:  # type: ignore[override]
        if recursive:
            where = path if isinstance(path, str) else ""
            objects = self.find(where) if isinstance(path, str) else list(path)
            self._shaped("delete", where, lambda: self.target_fs.rm(path, recursive=True,
                                                                    **kwargs),
                         requests=self._pages(objects))
            return
        paths = [path] if isinstance(path, str) else list(path)
        self._shaped("delete", paths[0] if paths else "",
                     lambda: self.target_fs.rm(path, recursive=False, **kwargs),
                     requests=self._pages(paths))

    # -- folders (not requests: module docstring) ----------------------------------------------

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._passed("mkdir", path, lambda: self.target_fs.makedirs(path, exist_ok=exist_ok))

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._passed("mkdir", path, lambda: self.target_fs.mkdir(
            path, create_parents=create_parents, **kwargs))

    def _passed(self, kind: str, path: str, call: Callable[[], Any]) -> None:
        started, t0 = time.time(), time.perf_counter()
        try:
            call()
        finally:
            self._record(kind, path, Cell(1, 0, 0.0, time.perf_counter() - t0), started)


class _ShapedReader:
    """A file opened for reading: its request was paid at open; its bytes pay the bandwidth
    as they arrive."""

    def __init__(self, fs: LatencyFileSystem, path: str, inner: Any) -> None:
        self._fs, self._path, self._inner = fs, path, inner

    def _arrived(self, n: int, t0: float, started: float) -> None:
        modeled = self._fs.model.transfer_s(n)
        self._fs._settle(t0, modeled)
        self._fs._record("read", self._path, Cell(0, n, modeled, time.perf_counter() - t0),
                         started)

    def read(self, size: int = -1) -> bytes:
        started, t0 = time.time(), time.perf_counter()
        data = self._inner.read(size)
        self._arrived(len(data), t0, started)
        return bytes(data)

    def readinto(self, buffer: Any) -> int:
        started, t0 = time.time(), time.perf_counter()
        n = int(self._inner.readinto(buffer) or 0)
        self._arrived(n, t0, started)
        return n

    def readline(self, size: int = -1) -> bytes:
        started, t0 = time.time(), time.perf_counter()
        line = self._inner.readline(size)
        self._arrived(len(line), t0, started)
        return bytes(line)

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> _ShapedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _ShapedWriter:
    """A file opened for writing: one PUT of every byte written, paid at close (where s3fs
    uploads an object of up to its block size)."""

    def __init__(self, fs: LatencyFileSystem, path: str, inner: Any, started: float) -> None:
        self._fs, self._path, self._inner, self._started = fs, path, inner, started
        self._written = 0
        self._closed = False

    def write(self, data: Any) -> int:
        nbytes = memoryview(data).nbytes
        self._inner.write(data)
        self._written += nbytes
        return nbytes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fs._shaped("write", self._path, self._inner.close,
                         size=lambda _: self._written)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> _ShapedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# Where the installed metadata has no entry point for the protocol yet (an editable install
# made before it was added), a process that imported this module still finds it.
fsspec.register_implementation(PROTOCOL, LatencyFileSystem, clobber=True)


__all__ = ["Cell", "DEFAULT_MODEL", "KINDS", "LatencyFileSystem", "LatencyModel", "MODELS",
           "NONE", "PROTOCOL", "RequestCounts", "RequestRecord", "STORE_KINDS",
           "behind_latency", "counts_of", "model_of_options", "parse_latency",
           "process_counts", "read_request_log"]
