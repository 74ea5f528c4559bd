"""A job restarted in the same Spark session with a changed definition runs as it is now.

Spark keeps its Python workers between queries of one session, and a worker keeps the live
copies of the subtasks it ran (``runtime.live_copies``). A later start of the job, whose
definition may have changed (an evolved state type, a dropped state), must never reuse or catch
up such a copy: it restores from the snapshot, as a new session would. The tests repeat the
restart until the restarted job's first batch ran in a Python worker that holds a copy made by
the first start (told by the workers' process ids), and assert that this happened.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pytest

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.runtime.function import Context
from keyedstate.state.descriptors import ValueStateDescriptor
from tests.spark.jobs import RunningTotals
from tests.spark.test_job import check_against_pandas, run_job, write_files

pytestmark = pytest.mark.spark

#: Restarts tried before the test gives up waiting for a worker that holds an old copy.
ATTEMPTS = 6


class RecordsWorker(RunningTotals):
    """RunningTotals that records which Python worker ran each of its batches: a file
    ``<start>-<batch id>-<pid>`` in ``pid_dir``."""

    def __init__(self, pid_dir: str, start: str) -> None:
        self.pid_dir, self.start = pid_dir, start

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        self._record(ctx)
        return super().process_key(key, rows, ctx)

    def _record(self, ctx: Context) -> None:
        marker = os.path.join(self.pid_dir, f"{self.start}-{ctx.batch_id}-{os.getpid()}")
        if not os.path.exists(marker):
            open(marker, "w").close()


class WithSeen(RecordsWorker):
    """The first start of the dropped-state case: a second state, ``seen``."""

    seen = ValueStateDescriptor("seen", "boolean")

    def open(self, ctx: Context) -> None:
        super().open(ctx)
        self.seen_state = ctx.get_state(self.seen)

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        self.seen_state.update(True)
        return super().process_key(key, rows, ctx)


class Evolved(RecordsWorker):
    """The second start of the evolved-type case: fields reordered, one added."""

    totals = ValueStateDescriptor("totals", "total double, count bigint, first_batch bigint")

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        self._record(ctx)
        now = self.state.value() or {"count": 0, "total": 0.0, "first_batch": ctx.batch_id}
        amounts = rows.column("amount").to_pylist()
        new = {"count": now["count"] + len(amounts), "total": now["total"] + sum(amounts)}
        self.state.update({**new, "first_batch": now["first_batch"]})
        return [{"user_id": key, **new, "batch_id": ctx.batch_id}]


def _pids(pid_dir: str, start: str) -> dict[int, set[int]]:
    """Batch id -> the worker pids that ran a batch of ``start``."""
    found: dict[int, set[int]] = {}
    for name in os.listdir(pid_dir):
        label, batch, pid = name.rsplit("-", 2)
        if label == start:
            found.setdefault(int(batch), set()).add(int(pid))
    return found


def _restart_once(spark: Any, root: str, backend: str, change: str) -> bool:
    """Start a job for two batches, then start it again in this session with ``change``
    for one more; check its output and state; returns whether the restarted job's first batch
    ran in a worker that held a copy made by the first start."""
    pid_dir = os.path.join(root, "pids")
    os.makedirs(pid_dir)
    write_files(os.path.join(root, "input"), 2, users=40, events=200)
    first: Any = WithSeen(pid_dir, "a") if change == "dropped state" else RecordsWorker(
        pid_dir, "a")
    run_job(spark, root, first, parallelism=1, backend=backend)
    write_files(os.path.join(root, "input"), 1, first=2, users=40, events=200)
    if change == "dropped state":
        run_job(spark, root, RecordsWorker(pid_dir, "b"), parallelism=1, backend=backend,
                drop_states=("seen",))
    else:
        run_job(spark, root, Evolved(pid_dir, "b"), parallelism=1, backend=backend)
    # Every batch exactly once, totals carried across the restart.
    check_against_pandas(root)
    latest = resolve_snapshot(os.path.join(root, "ckpt"))
    names = {s.name for h in latest.metadata.handles for s in h.states}
    if change == "dropped state":
        assert "seen" not in names, "a dropped state came back from a reused copy"
    old, new = _pids(pid_dir, "a"), _pids(pid_dir, "b")
    assert sorted(new) == [2]
    return bool(new[2] & set().union(*old.values()))


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("change", ["evolved type", "dropped state"])
def test_a_restart_in_the_same_session_never_uses_the_old_starts_copies(
        spark, tmp_path, backend, change):
    for attempt in range(ATTEMPTS):
        if _restart_once(spark, str(tmp_path / f"attempt-{attempt}"), backend, change):
            return
    pytest.fail(f"in {ATTEMPTS} restarts no batch of the restarted job ran in a Python worker "
                f"that held a copy of the first start: the test proved nothing")
