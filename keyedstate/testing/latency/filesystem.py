"""``kslatency://``: the fsspec filesystem that shapes every request by a
:class:`~keyedstate.testing.latency.model.LatencyModel` and counts it."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Self, TypeVar

import fsspec
from fsspec.spec import AbstractFileSystem

from keyedstate.errors import LatencyModelError
from keyedstate.storage.layout import area_of
from keyedstate.testing.latency.counts import Cell, count_request
from keyedstate.testing.latency.model import PROTOCOL, model_of_options

T = TypeVar("T")
#: Entries one LIST or one ``DeleteObjects`` request handles on S3.
_PAGE = 1000
#: Storage options fsspec itself passes to every filesystem (accepted, unused).
_FSSPEC_OPTIONS = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths",
                             "skip_instance_cache", "asynchronous", "loop"})


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
        count_request(kind, area, cell)
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

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
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

    def copy(self, path1: Any, path2: Any, recursive: bool = False,
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

    def rm(self, path: Any, recursive: bool = False, **kwargs: Any) -> None:
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


class _ShapedFile:
    """A file of the inner filesystem behind the model: a context manager that closes it, and
    the inner file's other attributes as they are."""

    def __init__(self, fs: LatencyFileSystem, path: str, inner: Any) -> None:
        self._fs, self._path, self._inner = fs, path, inner

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _ShapedReader(_ShapedFile):
    """A file opened for reading: its request was paid at open; its bytes pay the bandwidth
    as they arrive."""

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


class _ShapedWriter(_ShapedFile):
    """A file opened for writing: one PUT of every byte written, paid at close (where s3fs
    uploads an object of up to its block size)."""

    def __init__(self, fs: LatencyFileSystem, path: str, inner: Any, started: float) -> None:
        super().__init__(fs, path, inner)
        self._started = started
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


# Where the installed metadata has no entry point for the protocol yet (an editable install
# made before it was added), a process that imported this module still finds it.
fsspec.register_implementation(PROTOCOL, LatencyFileSystem, clobber=True)
