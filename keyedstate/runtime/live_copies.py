"""The live copies a Python worker keeps between batches: each subtask's state backend, left
open after its snapshot, for the next batch of that subtask that Spark runs in this worker
(Flink's task-local state, kept in memory). A copy is reused only if its token is the one the
committed checkpoint records for its subtask; else it catches up or is closed
(:func:`keyedstate.runtime.subtask._restore`).

Bounded: at most :data:`MAX_LIVE` copies per worker (least recently used closed first), copies
of other jobs idle for :data:`LIVE_IDLE_S` closed; a worker that exits normally closes them
all. Every close goes through :func:`close_live` (it thaws what ``runtime.gc_freeze`` froze).
"""

from __future__ import annotations

import atexit
import time
from collections import OrderedDict
from dataclasses import dataclass

from keyedstate.backends.base.backend import KeyedStateBackend
from keyedstate.runtime.gc_freeze import thaw


@dataclass
class LiveCopy:
    backend: KeyedStateBackend
    #: the token of the snapshot the backend's state is (the committed checkpoint's, to reuse)
    token: str
    parallelism: int
    #: ``time.monotonic()`` when it was last kept
    last_used: float = 0.0


#: Live state per (job, subtask) in this Python worker, least recently used first. A Spark
#: Python worker runs one task at a time, so no lock is needed; a copy is reused only if its
#: token is the committed one.
LIVE: OrderedDict[tuple[str, int], LiveCopy] = OrderedDict()
#: At most this many live copies per Python worker (or twice the subtasks of one Spark task,
#: if more: a worker may run either of two tasks' groups from one batch to the next): beyond
#: it the least recently used is closed (its local directory goes with it). A worker serves
#: whichever subtasks Spark gives it, of any number of jobs over its life; only the latest few
#: are likely to come back.
MAX_LIVE = 8
#: A live copy of another job unused this long is closed: that job stopped, or runs elsewhere.
LIVE_IDLE_S = 300.0


def close_live(live: LiveCopy) -> None:
    """Close ``live``'s backend; never raises."""
    try:
        live.backend.close()
    except Exception:  # noqa: BLE001 - closing a cached copy must never fail a task
        pass
    thaw()  # its frozen objects (runtime.gc_freeze) are the collector's again


def take_live(job_id: str, index: int) -> LiveCopy | None:
    """Remove and return this worker's copy of subtask ``index`` of ``job_id``, if any (the
    caller reuses, catches up or closes it); copies of other jobs idle for
    :data:`LIVE_IDLE_S` are closed first."""
    _close_idle_live(job_id)
    return LIVE.pop((job_id, index), None)


def keep_live(key: tuple[str, int], live: LiveCopy, group: int = 1) -> None:
    """Cache ``live`` for the next batch of its subtask, within :data:`MAX_LIVE` (or twice
    ``group``, the most subtasks one Spark task runs)."""
    live.last_used = time.monotonic()
    LIVE[key] = live
    LIVE.move_to_end(key)
    while len(LIVE) > max(MAX_LIVE, 2 * group):
        close_live(LIVE.popitem(last=False)[1])


def _close_idle_live(job_id: str) -> None:
    """Close the live copies of jobs other than ``job_id`` unused for :data:`LIVE_IDLE_S`."""
    now = time.monotonic()
    for key in [k for k, v in LIVE.items()
                if k[0] != job_id and now - v.last_used > LIVE_IDLE_S]:
        close_live(LIVE.pop(key))


def release_live(job_id: str) -> None:
    """Close this process's live copies of ``job_id``'s subtasks (a job that runs its subtasks
    in its own process, :class:`~keyedstate.runtime.local.LocalJob`, closing)."""
    for key in [k for k in LIVE if k[0] == job_id]:
        close_live(LIVE.pop(key))


@atexit.register
def close_all_live() -> None:
    """A worker that exits normally closes its copies (a killed one can't: its directory is
    removed by the next process, see :mod:`keyedstate.backends.base.working_dirs`)."""
    while LIVE:
        close_live(LIVE.popitem()[1])
