"""CPU seconds by process, over a window of wall time: where a batch's cores went.

On 2 shared cores a batch is as fast as what else runs beside its tasks lets it be, so the
benchmarks that compare checkpointing modes record, per batch, the CPU seconds each part of
the run used: ``driver`` (this process: the job's driver, its completion thread, the
benchmark), ``jvm`` (Spark's JVM: in local mode the executors too), ``workers`` (Spark's
Python workers, where the subtasks, their uploads and their restores run), ``store`` (the
local S3 server, moto: the stand-in for an object store whose CPU is not on the job's machines
in production) and ``other`` (any other process this one started). Only this process and its
descendants count, so another program on the machine changes no figure (it changes the wall
seconds); they are looked for once a second, so a process that lives less than that may go
uncounted (Spark's JVM, its Python workers and the store live for the whole run). Linux
only: read from ``/proc``; elsewhere :class:`CpuSampler` records nothing and every window is
``None``.
"""

from __future__ import annotations

import bisect
import os
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

#: the parts a window's CPU seconds are split into
PARTS = ("driver", "jvm", "workers", "store", "other")
#: seconds between two samples: a window's edges are this precise
INTERVAL_S = 0.1

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """``(parent pid, user + system CPU seconds)`` of ``pid``, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command in parentheses may hold spaces: the fields follow its last ")"
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class CpuSampler:
    """Samples, every :data:`INTERVAL_S` on a thread of its own, the CPU seconds of this
    process and its descendants, by part (:data:`PARTS`); :meth:`window` gives a window's.
    ``store_pid``: the local S3 server's process, if any."""

    def __init__(self, store_pid: int | None = None) -> None:
        self.store_pid = store_pid
        self.enabled = os.path.isdir("/proc/self/task")
        # per sample, appended as one item (read by other threads): its wall-clock time and
        # {pid: (part, CPU seconds)}
        self._log: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._parts: dict[int, str] = {}
        self._ours: set[int] = set()
        self._scans_in = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        if self.enabled:
            self._sample()
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
            self._sample()

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._sample()

    def _part(self, pid: int) -> str | None:
        """Which part ``pid`` is (None: not known yet; a process that execs, as Spark's
        launcher script does into the JVM, is asked again until its command says)."""
        part = self._parts.get(pid)
        if part is not None:
            return part
        if pid == os.getpid():
            part = "driver"
        elif pid == self.store_pid:
            part = "store"
        else:
            command = _command(pid)
            program = os.path.basename(command.split(" ", 1)[0])
            if program == "java":
                part = "jvm"
            elif "pyspark.daemon" in command or "pyspark.worker" in command:
                part = "workers"
            elif program in ("bash", "sh", ""):
                return None  # a launcher about to exec: not decided yet
            else:
                part = "other"
        self._parts[pid] = part
        return part

    def _sample(self) -> None:
        """One sample: every known descendant's CPU seconds; once a second (and at the first
        sample) the whole of ``/proc`` is scanned for new descendants first (a scan reads
        every process's ``stat``: too much to do ten times a second beside a benchmark)."""
        if self._scans_in <= 0:
            self._scan()
            self._scans_in = round(1 / INTERVAL_S)
        self._scans_in -= 1
        sample: dict[int, tuple[str, float]] = {}
        for pid in self._ours:
            stat = _stat(pid)
            if stat is not None:
                sample[pid] = (self._part(pid) or "other", stat[1])
        self._log.append((time.time(), sample))

    def _scan(self) -> None:
        """Find this process's descendants: every process whose parent is one of them."""
        parents: dict[int, int] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                stat = _stat(int(name))
                if stat is not None:
                    parents[int(name)] = stat[0]
        ours = {os.getpid()}
        grew = True
        while grew:  # a child may be listed before its parent: repeat until none is added
            grew = False
            for pid, parent in parents.items():
                if pid not in ours and parent in ours:
                    ours.add(pid)
                    grew = True
        self._ours = ours

    def window(self, start: float, end: float) -> dict[str, float] | None:
        """CPU seconds by part (and ``total``) between the samples nearest after ``start``
        and ``end`` (wall-clock seconds since the epoch, as Spark's progress gives a
        trigger's start); None when not sampled (not Linux, or outside the sampled time)."""
        deadline = time.time() + 3 * INTERVAL_S
        while self._log and end > self._log[-1][0] and self._thread.is_alive() \
                and time.time() < deadline:  # a window that just ended: its next sample
            time.sleep(INTERVAL_S / 4)
        log = self._log[:]
        if not log or start < log[0][0] or end > log[-1][0] or end <= start:
            return None
        i, j = (bisect.bisect_left(log, t, key=lambda entry: entry[0]) for t in (start, end))
        first = log[i][1]
        # every process seen in the window, at its last sample there (one that ended in the
        # window counts up to it), less what it had used at the window's start (0 if born
        # in it)
        latest: dict[int, tuple[str, float]] = {}
        for _, sample in log[i:j + 1]:
            latest.update(sample)
        seconds = dict.fromkeys(PARTS, 0.0)
        for pid, (part, cpu) in latest.items():
            before = first.get(pid)
            seconds[part] += cpu - (before[1] if before is not None else 0.0)
        seconds = {part: round(max(0.0, s), 3) for part, s in seconds.items()}
        seconds["total"] = round(sum(seconds.values()), 3)
        return seconds


def cpu_medians(batches: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """The median over ``batches`` of each part's CPU seconds (their ``cpu_s``), or None when
    no batch has them."""
    windows = [b["cpu_s"] for b in batches if b.get("cpu_s") is not None]
    if not windows:
        return None
    return {part: round(statistics.median(w[part] for w in windows), 3)
            for part in (*PARTS, "total")}
