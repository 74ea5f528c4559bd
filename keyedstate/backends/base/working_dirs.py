"""Per-process working directories of the backends (``state.backend.local-dir``).

A backend instance keeps its working files (RocksDB's database and local snapshots) in its own
instance directory and deletes it on ``close()``. A process that dies first (a Python worker
killed with its task, executor or driver, or one that simply exits: Spark stops the application
without closing anything) can't. So every process puts its instance directories under a
directory of its own, named after the process::

    <base>/worker-<pid>-<start time>/rocksdb-<subtask>-<uuid>/...

and when a process creates that directory (the first time it needs one below ``base``), it
removes the sibling ``worker-*`` directories of processes that no longer exist. The start time
(clock ticks after boot, ``/proc/<pid>/stat`` field 22) tells a reused pid from the process
that made the directory; where ``/proc`` is missing, only a pid that no longer exists counts
as gone. Processes sharing ``base`` must see each other's pids: one machine, one pid namespace
(one container), as Spark's local directories are.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading

#: Name prefix of a process's directory below a local dir.
WORKER_DIR_PREFIX = "worker-"
#: Below the system temp dir when no ``state.backend.local-dir`` is configured. Never the
#: package's own name: a ``keyedstate`` directory in the temp dir is a namespace package that
#: shadows the installed (editable) keyedstate for any script run from there.
DEFAULT_LOCAL_DIR_NAME = "keyedstate-work"
#: The default of earlier versions: emptied of ended processes' directories, then removed
#: if empty, so that it stops shadowing the package.
FORMER_LOCAL_DIR_NAME = "keyedstate"

_WORKER_DIR_RE = re.compile(rf"^{WORKER_DIR_PREFIX}(\d+)-(\d+)$")
_lock = threading.Lock()
_identity: tuple[int, int] | None = None


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks after boot (``/proc/<pid>/stat`` field
    22), or None when there is no such process or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 2 (the command) is in parentheses and may hold spaces or ')': split after the last.
    fields = stat.rsplit(b")", 1)[-1].split()
    try:
        return int(fields[19])  # fields[0] is field 3
    except (IndexError, ValueError):
        return None


def _this_process() -> tuple[int, int]:
    """(pid, start time) of this process; recomputed after a fork (Spark forks its workers)."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity[0] != pid:
        _identity = (pid, process_start_time(pid) or 0)
    return _identity


def default_local_dir() -> str:
    """The base used when no local dir is configured: ``$TMPDIR/keyedstate-work``."""
    return os.path.join(tempfile.gettempdir(), DEFAULT_LOCAL_DIR_NAME)


def is_gone(pid: int, start_time: int) -> bool:
    """Whether the process that named a directory ``worker-<pid>-<start_time>`` has ended."""
    now = process_start_time(pid)
    if now is not None:
        return start_time != 0 and now != start_time  # 0: made where /proc was missing
    if os.path.isdir("/proc"):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def worker_dir(base: str | None) -> str:
    """This process's directory below ``base`` (None: :func:`default_local_dir`), created if
    missing; creating it removes the directories of ended processes beside it (and, for the
    default base, those in the former default, ``$TMPDIR/keyedstate``, then that directory if
    it is empty)."""
    default = base is None
    base = default_local_dir() if base is None else base
    pid, start_time = _this_process()
    path = os.path.join(base, f"{WORKER_DIR_PREFIX}{pid}-{start_time}")
    with _lock:
        try:
            os.makedirs(path)
        except FileExistsError:
            return path
        remove_dead_worker_dirs(base)
        if default:
            _retire_former_default()
    return path


def _retire_former_default() -> None:
    former = os.path.join(tempfile.gettempdir(), FORMER_LOCAL_DIR_NAME)
    if os.path.isdir(former) and not os.path.islink(former):
        remove_dead_worker_dirs(former)
        try:
            os.rmdir(former)  # only if empty: a live process of an earlier version, or anything
        except OSError:       # not ours, keeps it
            pass


def remove_dead_worker_dirs(base: str) -> list[str]:
    """Remove every ``worker-<pid>-<start time>`` directory in ``base`` whose process has
    ended; returns their paths. Other entries are never touched."""
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        m = _WORKER_DIR_RE.match(name)
        if m and is_gone(int(m.group(1)), int(m.group(2))):
            path = os.path.join(base, name)
            # Another process may remove it at the same time: that is fine.
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
