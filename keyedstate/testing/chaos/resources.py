"""Resource accounting for the soak, from ``/proc`` and the filesystem (Linux).

- :class:`ProcessSampler` walks the controller's process tree every second and keeps the
  largest resident set (``VmRSS``) per process class: executor JVMs, Python workers (the
  ``pyspark.daemon`` processes), the driver JVM and the driver's Python.
- :func:`become_subreaper` makes the controller adopt processes orphaned by a killed driver
  (its JVM, then its executors), so that none escapes the accounting, and
  :func:`reap_tree` waits for them to exit and kills (by pid) any that linger.
- :func:`dir_stats` counts files and bytes under a directory (local or fsspec).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

MiB = 1 << 20
CLASSES = ("executor_jvm", "python_worker", "driver_jvm", "driver_python", "other")


def become_subreaper() -> bool:
    """``prctl(PR_SET_CHILD_SUBREAPER)``: orphaned descendants are re-parented to us."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0
    except OSError:
        return False


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid``, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[0]
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int, exclude: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """Live (not zombie) descendants of ``root``, without ``exclude`` and their subtrees."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[1] != "Z":
                children.setdefault(st[0], []).append(int(entry))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def classify(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return "other"
    if b"CoarseGrainedExecutorBackend" in cmd:
        return "executor_jvm"
    if b"pyspark.daemon" in cmd or b"pyspark/daemon" in cmd:
        return "python_worker"
    if b"SparkSubmit" in cmd:
        return "driver_jvm"
    if b"keyedstate.testing.chaos.driver" in cmd:
        return "driver_python"
    return "other"


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


@dataclass
class ProcessSampler:
    """Samples RSS of the tree under ``root`` (minus ``exclude``) every ``interval`` s, plus
    ``extra`` callables (e.g. directory sizes), until :meth:`stop`."""

    root: int
    exclude: set[int] = field(default_factory=set)
    interval: float = 1.0
    extra: dict[str, Callable[[], int]] = field(default_factory=dict)
    max_rss: dict[str, int] = field(default_factory=lambda: {c: 0 for c in CLASSES})
    max_rss_pid: dict[str, int] = field(default_factory=dict)
    max_processes: dict[str, int] = field(default_factory=lambda: {c: 0 for c in CLASSES})
    max_extra: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    #: (time, {class: total rss}) every ~30 s, to show memory does not creep
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-sampler", daemon=True)
        self._last_timeline = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a sample may race a dying process
                pass

    def sample(self) -> None:
        counts = {c: 0 for c in CLASSES}
        totals = {c: 0 for c in CLASSES}
        for pid in descendants(self.root, self.exclude):
            cls = classify(pid)
            rss = rss_bytes(pid)
            counts[cls] += 1
            totals[cls] += rss
            if rss > self.max_rss[cls]:
                self.max_rss[cls] = rss
                self.max_rss_pid[cls] = pid
        for cls, n in counts.items():
            self.max_processes[cls] = max(self.max_processes[cls], n)
        for name, fn in self.extra.items():
            self.max_extra[name] = max(self.max_extra.get(name, 0), fn())
        self.samples += 1
        now = time.time()
        if now - self._last_timeline >= 30:
            self._last_timeline = now
            self.timeline.append((now, totals))

    def to_json(self) -> dict[str, Any]:
        return {"samples": self.samples,
                "max_rss_mib": {c: round(v / MiB, 1) for c, v in self.max_rss.items()},
                "max_processes": self.max_processes, "max": self.max_extra}


def reap_tree(root: int, exclude: set[int], timeout: float = 60.0) -> list[dict[str, Any]]:
    """Wait until no process is left under ``root`` (besides ``exclude``), reaping adopted
    zombies; after ``timeout`` SIGKILL the stragglers by pid. Returns the stragglers."""
    deadline = time.monotonic() + timeout
    stragglers: list[dict[str, Any]] = []
    while True:
        _reap_children(root, exclude)
        left = descendants(root, exclude)
        if not left:
            return stragglers
        if time.monotonic() > deadline:
            for pid in left:
                stragglers.append({"pid": pid, "class": classify(pid)})
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
        time.sleep(0.5)


def _reap_children(root: int, exclude: set[int]) -> None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        st = _stat(int(entry))
        if st is not None and st[0] == root and st[1] == "Z":
            try:
                os.waitpid(int(entry), os.WNOHANG)
            except ChildProcessError:
                pass


def dir_stats(url: str, storage_options: dict[str, Any] | None = None,
              skip: tuple[str, ...] = ()) -> tuple[int, int]:
    """(files, bytes) under ``url`` (local path or fsspec URL); paths starting with one of
    ``skip`` (relative) are left out."""
    if "://" not in url:
        files = size = 0
        for base, dirs, names in os.walk(url):
            rel = os.path.relpath(base, url)
            if skip and rel != "." and rel.split(os.sep)[0] in skip:
                dirs[:] = []
                continue
            for name in names:
                try:
                    size += os.lstat(os.path.join(base, name)).st_size
                    files += 1
                except OSError:
                    pass
        return files, size
    from keyedstate.storage.filesystem import connect

    fs, root = connect(url, storage_options)
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return 0, 0
    prefix = root.rstrip("/") + "/"
    entries = [v for k, v in found.items()
               if not any(k[len(prefix):].startswith(s + "/") for s in skip)]
    return len(entries), sum(int(e.get("size") or 0) for e in entries)
