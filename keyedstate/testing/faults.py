"""A fault-injecting fsspec filesystem: throttling, timeouts, server errors, refused access.

``ksfault://<path>`` wraps any fsspec filesystem (``target_protocol``, ``target_options``) and
raises, on the calls a :class:`FaultPlan` names, the errors an object-store client raises for
those conditions (s3fs's translations: ``SlowDown`` / 503 -> ``OSError(EBUSY)``, 500 ->
``OSError(EREMOTEIO)``, timeouts -> ``TimeoutError``, 403 -> ``PermissionError``, a missing bucket
-> ``FileNotFoundError``). Everything else goes to the target unchanged, so tests run against a
real store (the local S3 server, or a local directory) with faults exactly where they want them.

The plan is a JSON file shared by every process (Spark executors included), updated under a
file lock, so "fail the next 3 uploads under ``shared/``" holds across a whole job::

    plan = FaultPlan(tmp_path / "faults.json")
    plan.add("write", "slowdown", match="/shared/", times=3)
    storage = CheckpointStorage(plan.url("s3://bucket/job"), plan.storage_options("s3", opts))

Test and chaos machinery, not a production path: the protocol is registered through the
``fsspec.specs`` entry point in ``pyproject.toml``, so that fsspec resolves it in every process
(drivers, Spark's Python workers) without the library importing this module.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from typing import Any, Callable, Iterator, Mapping

import fsspec
from fsspec.spec import AbstractFileSystem

PROTOCOL = "ksfault"

#: Call categories a rule names (``"any"`` matches all).
OPS = ("write", "read", "copy", "list", "delete", "mkdir")

_ERRORS: dict[str, Callable[[str], BaseException]] = {
    "slowdown": lambda p: OSError(errno.EBUSY, f"SlowDown: Please reduce your request rate. "
                                               f"(503, injected on {p})"),
    "unavailable": lambda p: OSError(errno.EBUSY, f"ServiceUnavailable (503, injected on {p})"),
    "internal": lambda p: OSError(errno.EREMOTEIO, f"InternalError: We encountered an internal "
                                                   f"error. Please try again. (500, injected on "
                                                   f"{p})"),
    "timeout": lambda p: TimeoutError(f"Read timeout on endpoint URL (injected on {p})"),
    "reset": lambda p: ConnectionResetError(errno.ECONNRESET,
                                            f"Connection reset by peer (injected on {p})"),
    "denied": lambda p: PermissionError(f"AccessDenied: Access Denied (403, injected on {p})"),
    "nobucket": lambda p: FileNotFoundError(f"The specified bucket does not exist (NoSuchBucket, "
                                            f"injected on {p})"),
}
ERRORS = tuple(_ERRORS)


class FaultPlan:
    """Rules of which calls fail, in a JSON file (``path``); every process reading the same
    file sees and consumes the same rules."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            self._write({"rules": [], "fired": []})

    # -- building ------------------------------------------------------------------------------

    def add(self, op: str, error: str, *, match: str = "", times: int = 1,
            after: int = 0) -> FaultPlan:
        """Fail the calls of category ``op`` (:data:`OPS` or ``"any"``) on paths containing
        ``match`` with ``error`` (:data:`ERRORS`): ``times`` times (-1: forever), after letting
        ``after`` matching calls through."""
        if op not in (*OPS, "any") or error not in _ERRORS:
            raise ValueError(f"op must be one of {OPS + ('any',)}, error one of {ERRORS}")
        with self._locked() as plan:
            plan["rules"].append({"op": op, "error": error, "match": match, "times": times,
                                  "after": after})
        return self

    def clear(self) -> None:
        with self._locked() as plan:
            plan["rules"] = []

    def fired(self) -> list[dict[str, str]]:
        """Every injected fault so far: ``{"op", "error", "path"}``."""
        with self._locked() as plan:
            return list(plan["fired"])

    def url(self, target_url: str) -> str:
        """The ``ksfault://`` URL of ``target_url`` (``s3://b/job`` -> ``ksfault://b/job``)."""
        _, _, rest = str(target_url).rpartition("://")
        return f"{PROTOCOL}://{rest}"

    def storage_options(self, target_protocol: str,
                        target_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return {"target_protocol": target_protocol,
                "target_options": dict(target_options or {}), "plan": self.path}

    # -- consuming -----------------------------------------------------------------------------

    def check(self, op: str, path: str) -> None:
        """Raise the fault the plan holds for ``op`` on ``path``, if any (and consume it)."""
        error = None
        with self._locked() as plan:
            for rule in plan["rules"]:
                if rule["op"] not in (op, "any") or rule["match"] not in path \
                        or rule["times"] == 0:
                    continue
                if rule["after"] > 0:
                    rule["after"] -= 1
                    continue
                if rule["times"] > 0:
                    rule["times"] -= 1
                plan["fired"].append({"op": op, "error": rule["error"], "path": path})
                error = rule["error"]
                break
        if error is not None:
            raise _ERRORS[error](path)

    def _write(self, plan: dict[str, Any]) -> None:
        with open(self.path, "w") as f:
            json.dump(plan, f)

    def _locked(self) -> _PlanLock:
        return _PlanLock(self.path)


class _PlanLock:
    """Read-modify-write of the plan file under an exclusive lock."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> dict[str, Any]:
        self._f = open(self.path, "r+")
        fcntl.flock(self._f, fcntl.LOCK_EX)
        self._plan: dict[str, Any] = json.loads(self._f.read() or '{"rules": [], "fired": []}')
        return self._plan

    def __exit__(self, *exc: object) -> None:
        try:
            self._f.seek(0)
            self._f.truncate()
            json.dump(self._plan, self._f)
            self._f.flush()
        finally:
            fcntl.flock(self._f, fcntl.LOCK_UN)
            self._f.close()


class FaultInjectingFileSystem(AbstractFileSystem):
    """``ksfault://``: every call goes to ``target_fs`` after the plan had its say."""

    protocol = PROTOCOL

    def __init__(self, target_protocol: str = "file",
                 target_options: Mapping[str, Any] | None = None, plan: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(target_protocol=target_protocol, target_options=target_options,
                         plan=plan, **kwargs)
        self.target_protocol = target_protocol
        target = dict(target_options or {})
        target.setdefault("use_listings_cache", False)  # as storage.connect, for the same reason
        self.target_fs = fsspec.filesystem(target_protocol, **target)
        self.plan = FaultPlan(plan) if plan else None

    def _check(self, op: str, path: Any) -> None:
        if self.plan is not None:
            self.plan.check(op, str(path))

    # writes
    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self._check("write", path)
        self.target_fs.pipe_file(path, value, **kwargs)

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        self._check("write", rpath)
        self.target_fs.put_file(lpath, rpath, **kwargs)

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self._check("read" if "r" in mode else "write", path)
        return self.target_fs.open(path, mode, **kwargs)

    # reads
    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        self._check("read", path)
        return bytes(self.target_fs.cat_file(path, start=start, end=end, **kwargs))

    def get_file(self, rpath: str, lpath: str, **kwargs: Any) -> None:
        self._check("read", rpath)
        self.target_fs.get_file(rpath, lpath, **kwargs)

    # copies
    def copy(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._check("copy", path1)
        self.target_fs.copy(path1, path2, **kwargs)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._check("copy", path1)
        self.target_fs.cp_file(path1, path2, **kwargs)

    # listings
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._check("list", path)
        entries = self.target_fs.ls(path, detail=detail, **kwargs)
        return entries

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._check("list", path)
        return self.target_fs.find(path, *args, **kwargs)

    def glob(self, path: str, **kwargs: Any) -> Any:
        self._check("list", path)
        return self.target_fs.glob(path, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self._check("list", path)
        return bool(self.target_fs.exists(path, **kwargs))

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._check("list", path)
        return dict(self.target_fs.info(path, **kwargs))

    def size(self, path: str) -> int:
        self._check("list", path)
        return int(self.target_fs.size(path))

    def isdir(self, path: str) -> bool:
        return bool(self.target_fs.isdir(path))

    # deletes
    def rm_file(self, path: str) -> None:
        self._check("delete", path)
        self.target_fs.rm_file(path)

    def rm(self, path: str, recursive: bool = False, **kwargs: Any) -> None:
        self._check("delete", path)
        self.target_fs.rm(path, recursive=recursive, **kwargs)

    # folders
    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._check("mkdir", path)
        self.target_fs.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._check("mkdir", path)
        self.target_fs.mkdir(path, create_parents=create_parents, **kwargs)

    def walk(self, path: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return self.target_fs.walk(path, *args, **kwargs)
