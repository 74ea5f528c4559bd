"""A worker catches its stale live copies up in the background once the checkpoint its task
wrote is committed (``runtime.live_copies.catch_up_in_background``), so that a later task of
that subtask there reuses its copy; the next task stops the thread first and never sees a copy
half caught up; a catch-up that fails closes the copy. In the asynchronous mode the thread
brings the copies to the checkpoint in flight, from its subtasks' acknowledgements. Driven as
``tests/runtime/test_catch_up.py`` drives a stale copy: the local runtime, a copy moved out of
``LIVE`` and back standing for another worker."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Iterator

import msgspec
import pytest

import keyedstate.runtime.live_copies as live_copies
import keyedstate.runtime.subtask as runtime
from keyedstate.backends.heap.backend import HeapKeyedStateBackend
from keyedstate.checkpoint.properties import TOKENS
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.stats import subtask_stats_of
from keyedstate.errors import CheckpointDiscardedError
from keyedstate.runtime.uploads import read_ack, wait_for_job
from keyedstate.runtime.wire import decode_ack, encode_ack
from keyedstate.storage.layout import ACKS_DIR, ack_file
from keyedstate.testing.faults import FaultPlan
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

    def failing(index: int, checkpoint_id: int, handles: Any) -> Any:
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


def test_the_setting_is_a_boolean_or_unset_for_the_mode_s_default(tmp_path):
    from keyedstate.config import JobConfig
    from keyedstate.errors import ConfigurationError

    def config(**settings: object) -> JobConfig:
        return JobConfig.from_mapping({"execution.checkpointing.dir": str(tmp_path),
                                       **{f"keyedstate.{k}": v for k, v in settings.items()}})

    off = config(**{"live-copies.background-catch-up": False})
    assert off.background_catch_up is False and not off.catches_up_in_background
    # Unset: on in the synchronous mode, off in the asynchronous one (its next batch's tasks
    # start at once: no idle worker to do it in).
    assert JobConfig(checkpoint_dir=str(tmp_path)).background_catch_up is None
    assert config().catches_up_in_background
    assert not config(**{"checkpointing.async-upload": True}).catches_up_in_background
    assert config(**{"checkpointing.async-upload": True,
                     "live-copies.background-catch-up": "true"}).catches_up_in_background
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


# -- the asynchronous mode: brought to the checkpoint in flight, from its acknowledgements ----


def _in_flight(job: Any) -> int:
    """The checkpoint in flight after a batch of an asynchronous job (bound 1), once this
    process's uploads of it wrote their acknowledgements; its ``_metadata`` is not written."""
    wait_for_job(job.storage.url)
    acked = [int(p.split("chk-")[1].split("/")[0]) for p in job.storage.list_files()
             if f"/{ACKS_DIR}/" in p]
    checkpoint_id = max(acked)
    assert job.latest_checkpoint.metadata.checkpoint_id < checkpoint_id
    assert not job.storage.exists(job.storage.metadata_path(checkpoint_id))
    return checkpoint_id


def stale_beside_a_flight(job: Any, data: list[Any]) -> tuple[list[Any], Any, int]:
    """Run an asynchronous job's first two batches with subtask 0's copy kept aside after the
    first (another worker's), then hand it back: the outputs, the stale copy, and the
    checkpoint in flight."""
    outputs = [job.process_batch(data[0])]
    stale = _take_live(job.storage.url, 0)
    outputs.append(job.process_batch(data[1]))
    checkpoint_id = _in_flight(job)
    _hand_back(job.storage.url, 0, stale)
    return outputs, stale, checkpoint_id


def _ack_tokens(job: Any, checkpoint_id: int) -> list[str]:
    acks = [read_ack(job.storage, checkpoint_id, i) for i in range(2)]
    assert all(a is not None and a.handle is not None for a in acks)
    return [a.token for a in acks]  # type: ignore[union-attr]


@pytest.fixture
def stale_async_copy(tmp_path: Any) -> Iterator[dict[str, Any]]:
    """A heap job at p=2 in the asynchronous mode whose worker 'A' holds subtask 0's copy at
    checkpoint 1 while checkpoint 3 is in flight (acknowledged, not completed)."""
    data = [_every_key(5000), *batches(4, users=5000)]
    cfg = config(tmp_path, backend="heap", async_upload=True, background_catch_up=True)
    with new_job(cfg) as job:
        outputs = [job.process_batch(data[0])]
        stale = _take_live(job.storage.url, 0)
        outputs.append(job.process_batch(data[1]))
        outputs.append(job.process_batch(data[2]))
        checkpoint_id = _in_flight(job)
        _hand_back(job.storage.url, 0, stale)
        yield {"job": job, "data": data, "outputs": outputs, "stale": stale,
               "checkpoint_id": checkpoint_id}
        live_copies.stop_background_catch_up()


def _finish_async(tmp_path: Any, copy: dict[str, Any], backend: str) -> Any:
    """Run the next batch, complete its checkpoint, drain, check every output against the
    reference; the statistics of the first subtask in that batch."""
    job, data, outputs = copy["job"], copy["data"], copy["outputs"]
    outputs.append(job.process_batch(data[len(outputs)]))
    outputs.append(job.flush())
    first = _latest_subtasks(tmp_path)[0]
    outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data[:len(outputs) - 2], backend)
    return first


def test_a_stale_copy_is_caught_up_to_the_checkpoint_in_flight(tmp_path, stale_async_copy):
    """The asynchronous mode: the thread waits for the acks (not the ``_metadata``, which is
    written only during the next batch), catches the copy up from its subtask's ack, and
    gives it the ack's token: the next batch, planned on the checkpoint in flight, reuses it."""
    job, stale = stale_async_copy["job"], stale_async_copy["stale"]
    checkpoint_id = stale_async_copy["checkpoint_id"]
    tokens = _ack_tokens(job, checkpoint_id)
    assert stale.token != tokens[0]
    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage,
                                       checkpoint_id, in_flight=2)
    _finish_background()
    assert not job.storage.exists(job.storage.metadata_path(checkpoint_id))
    assert live_copies.LIVE[(job.storage.url, 0)] is stale and stale.token == tokens[0]
    assert stale.caught_up_s > 0
    first = _finish_async(tmp_path, stale_async_copy, "heap")
    assert first.reused and not first.caught_up and not first.restored
    assert first.background_catch_up_ms and first.background_catch_up_ms > 0


def test_an_ack_reporting_a_failed_upload_leaves_the_copies_alone(tmp_path, stale_async_copy,
                                                                  monkeypatch):
    """One subtask's upload failed (its ack says so): the checkpoint will fail, so the thread
    touches no copy, not even the one whose own ack is fine; it ends by itself."""
    job, stale = stale_async_copy["job"], stale_async_copy["stale"]
    checkpoint_id, token = stale_async_copy["checkpoint_id"], stale.token
    relative = ack_file(checkpoint_id, 1)
    original = job.storage.read(relative)
    failed = msgspec.structs.replace(decode_ack(original, relative), handle=None,
                                     error="OSError: injected: the upload failed")
    job.storage.write(relative, encode_ack(failed))
    touched: list[int] = []
    monkeypatch.setattr(HeapKeyedStateBackend, "catch_up",
                        lambda self, *args: touched.append(self.subtask_index) or True)
    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage,
                                       checkpoint_id, in_flight=2)
    _finish_background()
    assert touched == [] and stale.token == token
    assert live_copies.LIVE[(job.storage.url, 0)] is stale
    monkeypatch.undo()
    job.storage.write(relative, original)  # the upload did succeed: the job goes on
    first = _finish_async(tmp_path, stale_async_copy, "heap")
    assert first.caught_up and not first.reused  # on the task's path, as without the thread


def test_the_thread_waiting_for_acks_stops_at_once(tmp_path, stale_async_copy):
    """Acks still missing (the checkpoint after the one in flight, never written): the thread
    polls; the next task's stop returns well within a second and the copy is untouched."""
    job, stale = stale_async_copy["job"], stale_async_copy["stale"]
    token = stale.token
    live_copies.catch_up_in_background(job.storage.url, job.start_id, job.storage,
                                       stale_async_copy["checkpoint_id"] + 1, in_flight=2)
    time.sleep(1.5)  # long enough for the polls to slow down
    background = live_copies._background
    assert background is not None and background.thread.is_alive()
    started = time.monotonic()
    live_copies.stop_background_catch_up()
    assert time.monotonic() - started < 0.5
    assert not background.thread.is_alive() and stale.token == token
    first = _finish_async(tmp_path, stale_async_copy, "heap")
    assert first.caught_up and not first.reused


def test_a_rocksdb_copy_is_restored_from_its_ack_in_the_background(tmp_path):
    """The asynchronous mode with a restorer: the RocksDB copy is replaced with the subtask
    restored from its ack of the checkpoint in flight, whose token it takes; reused next."""
    data = batches(3)
    cfg = config(tmp_path, backend="rocksdb", async_upload=True, background_catch_up=True)
    with new_job(cfg) as job:
        outputs, stale, checkpoint_id = stale_beside_a_flight(job, data)
        tokens = _ack_tokens(job, checkpoint_id)
        try:
            live_copies.catch_up_in_background(
                job.storage.url, job.start_id, job.storage, checkpoint_id,
                runtime.restorer(job._plan(0, 0)), in_flight=2)
            _finish_background()
        finally:
            live_copies.stop_background_catch_up()
        assert not job.storage.exists(job.storage.metadata_path(checkpoint_id))
        fresh = live_copies.LIVE[(job.storage.url, 0)]
        assert fresh is not stale and fresh.token == tokens[0] and fresh.caught_up_s > 0
        assert not os.path.exists(stale.backend.instance_dir)  # type: ignore[attr-defined]
        first = _finish_async(tmp_path, {"job": job, "data": data, "outputs": outputs},
                              "rocksdb")
    assert first.reused and not first.restored
    assert first.background_catch_up_ms and first.background_catch_up_ms > 0


def test_a_copy_caught_up_to_a_checkpoint_that_fails_is_never_used(tmp_path):
    """The copy is caught up to checkpoint 3 in flight; worker 'B' runs subtask 0's batch 3;
    checkpoint 3 fails (its ``_metadata`` refused), which discards batches 2 and 3. Batch 2,
    sent again, is planned on checkpoint 2, whose token the copy does not carry: the copy is
    not reused, and output and state are exactly once."""
    data = [_every_key(5000), *batches(4, users=5000)]
    faults = FaultPlan(tmp_path / "faults.json")
    faults.add("write", "denied", match="chk-3/_metadata")
    cfg = config(tmp_path, backend="heap", async_upload=True, background_catch_up=True,
                 transfer_attempts=1, checkpoint_dir=faults.url(str(tmp_path / "store" / "job")),
                 storage_options=faults.storage_options("file"))
    with new_job(cfg) as job:
        url = job.storage.url
        outputs = [job.process_batch(data[0])]
        stale = _take_live(url, 0)
        outputs += [job.process_batch(data[1]), job.process_batch(data[2])]
        checkpoint_id = _in_flight(job)
        assert checkpoint_id == 3
        _hand_back(url, 0, stale)
        live_copies.catch_up_in_background(url, job.start_id, job.storage, checkpoint_id,
                                           in_flight=2)
        _finish_background()
        assert stale.token == _ack_tokens(job, checkpoint_id)[0]
        caught = _take_live(url, 0)  # worker 'A' keeps it; 'B' runs batch 3
        with pytest.raises(CheckpointDiscardedError) as failed:
            job.process_batch(data[3])
        # Batch 3 ran on checkpoint 3's state (discarded with it), or, when the abort deleted
        # chk-3/ before subtask 0 restored from it, failed restoring: either way the job is
        # back at batch 1.
        assert failed.value.discarded_batches in ([2, 3], [2]) and faults.fired()
        assert failed.value.last_batch_id == job.last_batch_id == 1
        outputs.append(job.last_outputs)
        wait_for_job(url)
        _hand_back(url, 0, caught)  # batch 2 again runs subtask 0 in worker 'A'
        outputs.append(job.process_batch(data[2]))
        assert live_copies.LIVE[(url, 0)].backend is not caught.backend
        assert caught.backend._closed  # type: ignore[attr-defined]
        outputs.append(job.process_batch(data[3]))  # completes batch 2's checkpoint
        rerun = subtask_stats_of(job.latest_checkpoint.metadata)
        assert rerun is not None and not rerun[0].reused and rerun[0].restored
        outputs.append(job.flush())
        outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data[:4], "heap")
