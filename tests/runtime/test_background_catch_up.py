"""A worker catches its stale live copies up in the background once the checkpoint its task
wrote is committed (``runtime.live_copies.catch_up_in_background``), so that a later task of
that subtask there reuses its copy; the next task stops the thread first and never sees a copy
half caught up; a catch-up that fails closes the copy. Driven as ``tests/runtime/test_catch_up.py``
drives a stale copy: the local runtime, a copy moved out of ``LIVE`` and back standing for
another worker."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Iterator

import pytest

import keyedstate.runtime.live_copies as live_copies
import keyedstate.runtime.subtask as runtime
from keyedstate.backends.heap.backend import HeapKeyedStateBackend
from keyedstate.checkpoint.properties import TOKENS
from keyedstate.checkpoint.resolve import resolve_snapshot
from tests.runtime.test_catch_up import _every_key, _hand_back, _latest_subtasks, _take_live
from tests.runtime.test_local_job import batches, config, new_job, reference, rows

pytestmark = pytest.mark.integration


def _committed(root: Any) -> tuple[int, list[str]]:
    """The latest checkpoint's id and its subtasks' tokens."""
    metadata = resolve_snapshot(str(root / "ckpt")).metadata
    return metadata.checkpoint_id, json.loads(metadata.properties[TOKENS])


def _finish_background() -> None:
    """Wait for the background thread to end by itself (not stopped)."""
    background = live_copies._background
    assert background is not None
    background.thread.join(timeout=60)
    assert not background.thread.is_alive()


@pytest.fixture
def stale_copy(tmp_path: Any) -> Iterator[dict[str, Any]]:
    """A heap job at p=2 whose worker 'A' holds subtask 0's copy at checkpoint 1 while the
    committed checkpoint is 3 (worker 'B' ran the subtask's batches 1 and 2)."""
    data = [_every_key(5000), *batches(4, users=5000)]
    with new_job(config(tmp_path, backend="heap")) as job:
        outputs = [job.process_batch(data[0])]
        stale = _take_live(job.storage.url, 0)
        outputs.append(job.process_batch(data[1]))
        outputs.append(job.process_batch(data[2]))
        _hand_back(job.storage.url, 0, stale)
        yield {"job": job, "data": data, "outputs": outputs, "stale": stale}
        live_copies.stop_background_catch_up()


def _finish(tmp_path: Any, copy: dict[str, Any]) -> None:
    """Run the remaining batches and check every output against the reference."""
    job, data, outputs = copy["job"], copy["data"], copy["outputs"]
    outputs.append(job.process_batch(data[4]))
    outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data, "heap")


def test_a_stale_copy_caught_up_in_the_background_is_reused(tmp_path, stale_copy):
    job, stale = stale_copy["job"], stale_copy["stale"]
    checkpoint_id, tokens = _committed(tmp_path)
    assert stale.token != tokens[0]
    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage, checkpoint_id)
    _finish_background()
    assert live_copies.LIVE[(job.storage.url, 0)] is stale and stale.token == tokens[0]
    assert stale.caught_up_s > 0
    stale_copy["outputs"].append(job.process_batch(stale_copy["data"][3]))
    first, other = _latest_subtasks(tmp_path)
    assert first.reused and not first.caught_up and not first.restored
    assert other.reused
    # The statistics say the copy was caught up in the background, and how long it took.
    assert first.background_catch_up_ms and first.background_catch_up_ms > 0
    assert other.background_catch_up_ms == 0
    _finish(tmp_path, stale_copy)


def test_the_next_task_waits_for_the_copy_being_caught_up(tmp_path, stale_copy, monkeypatch):
    """A task that starts while the thread is changing a copy waits for it: it then finds the
    copy whole, at the committed checkpoint."""
    job, stale = stale_copy["job"], stale_copy["stale"]
    checkpoint_id, tokens = _committed(tmp_path)
    original = HeapKeyedStateBackend.catch_up
    inside = threading.Event()

    def slow_catch_up(self: HeapKeyedStateBackend, *args: Any) -> bool:
        inside.set()
        time.sleep(0.5)
        return original(self, *args)

    monkeypatch.setattr(HeapKeyedStateBackend, "catch_up", slow_catch_up)
    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage, checkpoint_id)
    assert inside.wait(30)
    stale_copy["outputs"].append(job.process_batch(stale_copy["data"][3]))
    assert live_copies._background is None  # stopped, after the copy was done
    assert stale.token == tokens[0]  # the thread finished the copy before the task took it
    assert live_copies.LIVE[(job.storage.url, 0)].backend is stale.backend
    first = _latest_subtasks(tmp_path)[0]
    assert first.reused and not first.caught_up
    _finish(tmp_path, stale_copy)


def test_a_catch_up_that_fails_in_the_background_closes_the_copy(tmp_path, stale_copy,
                                                                 monkeypatch):
    job, stale = stale_copy["job"], stale_copy["stale"]
    checkpoint_id, _ = _committed(tmp_path)

    def failing(self: HeapKeyedStateBackend, *args: Any) -> bool:
        raise OSError("injected: the store is unreachable")

    monkeypatch.setattr(HeapKeyedStateBackend, "catch_up", failing)
    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage, checkpoint_id)
    _finish_background()
    assert (job.storage.url, 0) not in live_copies.LIVE
    assert stale.backend._closed  # type: ignore[attr-defined]
    monkeypatch.undo()
    stale_copy["outputs"].append(job.process_batch(stale_copy["data"][3]))
    first = _latest_subtasks(tmp_path)[0]
    assert first.restored and not first.reused and not first.caught_up
    _finish(tmp_path, stale_copy)


def test_a_checkpoint_never_committed_leaves_the_copies_alone(tmp_path, stale_copy):
    """The batch failed elsewhere: its checkpoint never appears. The thread polls until the
    next task stops it; the copy is as it was and catches up on the task's path."""
    job, stale = stale_copy["job"], stale_copy["stale"]
    checkpoint_id, _ = _committed(tmp_path)
    token = stale.token
    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage, checkpoint_id + 1)
    time.sleep(0.3)
    background = live_copies._background
    assert background is not None and background.thread.is_alive()
    stale_copy["outputs"].append(job.process_batch(stale_copy["data"][3]))
    assert not background.thread.is_alive()
    first = _latest_subtasks(tmp_path)[0]
    assert first.caught_up and not first.reused  # on the task's path, as without the thread
    assert stale.token == token  # the thread never touched it
    assert live_copies.LIVE[(job.storage.url, 0)].backend is stale.backend
    _finish(tmp_path, stale_copy)


def test_a_copy_at_the_committed_checkpoint_is_left_alone(tmp_path, stale_copy, monkeypatch):
    """The task's own copies (and any already at the checkpoint) are not touched."""
    job = stale_copy["job"]
    checkpoint_id, tokens = _committed(tmp_path)
    own = live_copies.LIVE[(job.storage.url, 1)]
    assert own.token == tokens[1]
    touched: list[int] = []
    original = HeapKeyedStateBackend.catch_up

    def recording(self: HeapKeyedStateBackend, *args: Any) -> bool:
        touched.append(self.subtask_index)
        return original(self, *args)

    monkeypatch.setattr(HeapKeyedStateBackend, "catch_up", recording)
    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage, checkpoint_id)
    _finish_background()
    assert touched == [0]
    monkeypatch.undo()
    stale_copy["outputs"].append(job.process_batch(stale_copy["data"][3]))
    _finish(tmp_path, stale_copy)


@pytest.fixture
def stale_rocksdb_copy(tmp_path: Any) -> Iterator[dict[str, Any]]:
    """A RocksDB job at p=2 whose worker 'A' holds subtask 0's copy at checkpoint 1 while the
    committed checkpoint is 2."""
    data = batches(3)
    with new_job(config(tmp_path, backend="rocksdb")) as job:
        outputs = [job.process_batch(data[0])]
        stale = _take_live(job.storage.url, 0)
        outputs.append(job.process_batch(data[1]))
        _hand_back(job.storage.url, 0, stale)
        yield {"job": job, "data": data, "outputs": outputs, "stale": stale}
        live_copies.stop_background_catch_up()


def _drain_and_check(tmp_path: Any, copy: dict[str, Any], backend: str) -> None:
    copy["outputs"].append(copy["job"].drain())
    assert rows(copy["outputs"]) == reference(tmp_path, copy["data"], backend)


def test_a_rocksdb_copy_is_restored_in_the_background_and_reused(tmp_path,
                                                                 stale_rocksdb_copy):
    """A RocksDB copy can't catch up: the thread closes it and restores the subtask from the
    committed checkpoint instead (from the worker's file cache where it can); the subtask's
    next task in the worker reuses that."""
    job, stale = stale_rocksdb_copy["job"], stale_rocksdb_copy["stale"]
    checkpoint_id, tokens = _committed(tmp_path)
    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage, checkpoint_id,
                                       runtime.restorer(job._plan(0, 0)))
    _finish_background()
    fresh = live_copies.LIVE[(job.storage.url, 0)]
    assert fresh is not stale and fresh.token == tokens[0] and fresh.caught_up_s > 0
    assert not os.path.exists(stale.backend.instance_dir)  # type: ignore[attr-defined]
    stale_rocksdb_copy["outputs"].append(job.process_batch(stale_rocksdb_copy["data"][2]))
    first = _latest_subtasks(tmp_path)[0]
    assert first.reused and not first.restored
    assert first.background_catch_up_ms and first.background_catch_up_ms > 0
    _drain_and_check(tmp_path, stale_rocksdb_copy, "rocksdb")


def test_a_failed_background_restore_leaves_no_copy(tmp_path, stale_rocksdb_copy):
    """The restore fails (a storage error): the worker holds no copy of the subtask, whose
    next task restores on its path."""
    job = stale_rocksdb_copy["job"]
    checkpoint_id, _ = _committed(tmp_path)

    def failing(index: int, metadata: Any) -> Any:
        raise OSError("injected: the store is unreachable")

    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage, checkpoint_id, failing)
    _finish_background()
    assert (job.storage.url, 0) not in live_copies.LIVE
    stale_rocksdb_copy["outputs"].append(job.process_batch(stale_rocksdb_copy["data"][2]))
    first = _latest_subtasks(tmp_path)[0]
    assert first.restored and not first.reused
    _drain_and_check(tmp_path, stale_rocksdb_copy, "rocksdb")


def test_without_a_restorer_rocksdb_copies_start_no_thread(tmp_path, stale_rocksdb_copy):
    job, stale = stale_rocksdb_copy["job"], stale_rocksdb_copy["stale"]
    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage, _committed(tmp_path)[0])
    assert live_copies._background is None
    assert live_copies.LIVE[(job.storage.url, 0)] is stale
    stale_rocksdb_copy["outputs"].append(job.process_batch(stale_rocksdb_copy["data"][2]))
    first = _latest_subtasks(tmp_path)[0]
    assert first.restored and not first.caught_up
    _drain_and_check(tmp_path, stale_rocksdb_copy, "rocksdb")


def test_the_setting_is_a_boolean(tmp_path):
    from keyedstate.config import JobConfig
    from keyedstate.errors import ConfigurationError

    off = JobConfig.from_mapping({"execution.checkpointing.dir": str(tmp_path),
                                  "keyedstate.live-copies.background-catch-up": False})
    assert off.background_catch_up is False
    assert JobConfig(checkpoint_dir=str(tmp_path)).background_catch_up is True
    with pytest.raises(ConfigurationError,
                       match="background-catch-up .*can't be 'yes': it takes true or false"):
        JobConfig(checkpoint_dir=str(tmp_path), background_catch_up="yes")  # type: ignore[arg-type]
    assert JobConfig(checkpoint_dir=str(tmp_path)).background_restore is False
    with pytest.raises(ConfigurationError,
                       match="background-restore .*can't be 1: it takes true or false"):
        JobConfig(checkpoint_dir=str(tmp_path), background_restore=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_a_later_start_never_uses_an_earlier_starts_copies(tmp_path, backend):
    """Two starts of one job in one process (a query stopped and started again in the same
    Spark session): the second restores every subtask although the first start's copies hold
    exactly the committed state, closes those copies, and a background catch-up of the first
    start (waiting for a checkpoint id the second start may reuse) touches nothing of it."""
    data = batches(3, users=200)
    first = new_job(config(tmp_path, backend=backend))
    outputs = [first.process_batch(data[0])]
    old = {key: live for key, live in live_copies.LIVE.items() if key[0] == first.storage.url}
    assert len(old) == 2 and all(v.start_id == first.start_id for v in old.values())
    with new_job(config(tmp_path, backend=backend)) as second:
        assert second.start_id != first.start_id
        outputs.append(second.process_batch(data[1]))
        assert all(not s.reused and s.restored for s in _latest_subtasks(tmp_path))
        assert all(live.backend._closed for live in old.values())  # type: ignore[attr-defined]
        kept = dict(live_copies.LIVE)
        assert {v.start_id for k, v in kept.items() if k[0] == second.storage.url} \
            == {second.start_id}
        checkpoint_id, _ = _committed(tmp_path)
        live_copies.catch_up_in_background(first.storage.url, first.start_id, first.storage,
                                           checkpoint_id)
        assert live_copies._background is None  # none of the first start's copies is left
        first.close()  # closes only the first start's copies
        assert live_copies.LIVE == kept
        outputs.append(second.process_batch(data[2]))
        assert all(s.reused for s in _latest_subtasks(tmp_path))
        outputs.append(second.drain())
    assert rows(outputs) == reference(tmp_path, data, backend)
