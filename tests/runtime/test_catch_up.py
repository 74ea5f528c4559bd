"""A subtask whose task lands in another Python worker than last time: a stale live copy that
can catch up (``KeyedStateBackend.catch_up``) applies only what later checkpoints wrote; one
that can't is closed and the state restored. Driven through the local runtime, which keeps live
copies as a Spark Python worker does (``runtime.live_copies.LIVE``); moving a copy out of
``LIVE`` and back stands for Spark running the subtask's next tasks in another worker."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

import keyedstate.runtime.live_copies as live_copies
from keyedstate.backends.heap.restore import chain_of
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.stats import subtask_stats_of
from keyedstate.errors import BatchFailedError
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from tests.backends.test_heap import MAX_P, VALUE, FileParts, Job, contents
from tests.runtime.test_local_job import T0, batches, config, new_job, reference, rows

pytestmark = pytest.mark.integration


def _latest_subtasks(root: Any) -> list[Any]:
    stats = subtask_stats_of(resolve_snapshot(str(root / "ckpt")).metadata)
    assert stats is not None
    return stats


def _take_live(job_id: str, index: int) -> live_copies.LiveCopy:
    """The live copy of subtask ``index``, as another worker would keep it."""
    return live_copies.LIVE.pop((job_id, index))


def _hand_back(job_id: str, index: int, live: live_copies.LiveCopy) -> None:
    """Spark runs the subtask's next task in the worker holding ``live``: the copy the
    other worker made since is not there."""
    other = live_copies.LIVE.pop((job_id, index), None)
    if other is not None:
        other.backend.close()
    live_copies.LIVE[(job_id, index)] = live


def _every_key(users: int) -> pa.Table:
    """One row per user of ``batches(users=users)``, all at the first batch's start time."""
    return pa.table({"user_id": [f"u{i:03d}" for i in range(users)],
                     "ts": pa.array([T0 * 1000] * users, pa.timestamp("us", tz="UTC")),
                     "amount": [1.0] * users})


def test_a_stale_heap_copy_catches_up_with_the_diffs_written_since(tmp_path):
    # A first batch with every key, so that the few checkpoints in between image only some
    # key groups: the chain still goes through the copy's own file.
    data = [_every_key(5000), *batches(5, users=5000)]
    outputs = []
    with new_job(config(tmp_path, backend="heap")) as job:
        job_id = job.storage.url
        outputs.append(job.process_batch(data[0]))
        stale = _take_live(job_id, 0)  # worker A keeps subtask 0 at checkpoint 1
        outputs.append(job.process_batch(data[1]))  # worker B restores it, writes checkpoint 2
        outputs.append(job.process_batch(data[2]))  # and 3
        assert not _latest_subtasks(tmp_path)[0].caught_up
        _hand_back(job_id, 0, stale)
        outputs.append(job.process_batch(data[3]))  # back in worker A: 2 diffs to apply
        caught_up, other = _latest_subtasks(tmp_path)
        assert caught_up.caught_up and caught_up.restored and not caught_up.reused
        assert other.reused and not other.caught_up
        # The caught-up copy extends the checkpoint's chain: file 1 (full), files 2 and 3
        # (worker B's), file 4 (its own).
        handle = resolve_snapshot(str(tmp_path / "ckpt")).metadata.handles[0]
        assert len(chain_of(handle)) == 4
        outputs.append(job.process_batch(data[4]))
        assert _latest_subtasks(tmp_path)[0].reused  # reused again as usual
    # What the caught-up copy wrote restores (at another parallelism, in a new directory).
    with new_job(config(tmp_path, backend="heap", parallelism=3,
                        restore_path=str(tmp_path / "ckpt"),
                        checkpoint_dir=str(tmp_path / "again"))) as job:
        outputs.append(job.process_batch(data[5]))
        outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data, "heap")


def test_a_stale_heap_copy_catches_up_to_a_checkpoint_in_flight(tmp_path):
    # The asynchronous mode: the next batch restores from the checkpoint in flight (its
    # acknowledgement's handle); a stale copy there catches up, as from a completed one.
    data = [_every_key(5000), *batches(4, users=5000)]
    outputs = []
    with new_job(config(tmp_path, backend="heap", async_upload=True)) as job:
        job_id = job.storage.url
        outputs.append(job.process_batch(data[0]))
        stale = _take_live(job_id, 0)  # worker A keeps subtask 0 at checkpoint 1, in flight
        outputs.append(job.process_batch(data[1]))  # worker B restores it from the ack
        outputs.append(job.process_batch(data[2]))
        _hand_back(job_id, 0, stale)
        outputs.append(job.process_batch(data[3]))  # back in worker A: checkpoint 3 in flight
        outputs.append(job.flush())
        caught_up, other = _latest_subtasks(tmp_path)
        assert caught_up.caught_up and not caught_up.reused
        assert other.reused and not other.caught_up
        handle = resolve_snapshot(str(tmp_path / "ckpt")).metadata.handles[0]
        assert len(chain_of(handle)) == 4  # file 1 (its own), 2 and 3 (worker B's), 4
        outputs.append(job.process_batch(data[4]))
        outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data, "heap")


def test_a_copy_on_another_chain_is_closed_and_the_state_restored(tmp_path):
    """Once every key group was imaged again after the copy's own file, the chain no longer
    lists that file (max_chain_length 1: half the key groups imaged per checkpoint): catching
    up is refused, the copy closed, the state restored."""
    data = batches(4)
    cfg = config(tmp_path, backend="heap",
                 backend_options={"max_chain_length": 1})
    outputs = []
    with new_job(cfg) as job:
        job_id = job.storage.url
        outputs.append(job.process_batch(data[0]))  # checkpoint 1: full
        stale = _take_live(job_id, 0)
        outputs.append(job.process_batch(data[1]))  # 2 and 3 image all key groups again
        outputs.append(job.process_batch(data[2]))
        _hand_back(job_id, 0, stale)
        outputs.append(job.process_batch(data[3]))
        first = _latest_subtasks(tmp_path)[0]
        assert first.restored and not first.caught_up and not first.reused
        assert stale.backend._closed  # type: ignore[attr-defined]
        outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data, "heap")


def test_rocksdb_copies_do_not_catch_up_they_restore(tmp_path):
    data = batches(3)
    outputs = []
    with new_job(config(tmp_path, backend="rocksdb")) as job:
        job_id = job.storage.url
        outputs.append(job.process_batch(data[0]))
        stale = _take_live(job_id, 0)
        outputs.append(job.process_batch(data[1]))
        _hand_back(job_id, 0, stale)
        outputs.append(job.process_batch(data[2]))
        first = _latest_subtasks(tmp_path)[0]
        assert first.restored and not first.caught_up
        outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data, "rocksdb")


def test_a_storage_error_while_catching_up_fails_the_batch_then_a_restore_succeeds(
        tmp_path, monkeypatch):
    """The copy may be half caught up when reading a diff fails: it is closed, never used
    again; the batch fails and its retry restores from the checkpoint."""
    data = [_every_key(5000), *batches(3, users=5000)]  # as in the first test
    outputs = []
    with new_job(config(tmp_path, backend="heap")) as job:
        job_id = job.storage.url
        outputs.append(job.process_batch(data[0]))
        stale = _take_live(job_id, 0)
        outputs.append(job.process_batch(data[1]))
        outputs.append(job.process_batch(data[2]))
        _hand_back(job_id, 0, stale)
        read = CheckpointStorage.read_verified
        calls = {"n": 0}

        def failing_second_read(self: CheckpointStorage, *args: Any, **kwargs: Any) -> bytes:
            calls["n"] += 1
            if calls["n"] == 2:  # the second diff of the catch-up
                raise OSError("injected: the store is unreachable")
            return read(self, *args, **kwargs)

        monkeypatch.setattr(CheckpointStorage, "read_verified", failing_second_read)
        with pytest.raises(BatchFailedError, match="injected"):
            job.process_batch(data[3])
        monkeypatch.setattr(CheckpointStorage, "read_verified", read)
        assert stale.backend._closed  # type: ignore[attr-defined]
        outputs.append(job.process_batch(data[3]))
        first = _latest_subtasks(tmp_path)[0]
        assert first.restored and not first.caught_up
        outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data, "heap")


def test_a_key_group_imaged_since_is_rebuilt_from_its_image(tmp_path):
    """The copy holds key X; the other worker removes it, and the next checkpoint images X's
    key group (the first one, as rolling materialization starts at the range's start) and
    writes no diff for it. Catching up must drop X, not keep it beside the image, and take
    the other key groups' diffs on top of the copy's content."""
    job = Job(tmp_path)
    keys = range(4000)
    in_first = [k for k in keys if job.keys.key_group(k, MAX_P) == 0]
    elsewhere = [k for k in keys if job.keys.key_group(k, MAX_P) == 100]
    assert in_first and elsewhere
    gone, changed = in_first[0], elsewhere[0]
    copy = job.create()
    state = copy.get_state(VALUE)
    for k in keys:
        copy.set_current_key(k)
        state.update(k)
    first = job.snapshot(copy, 1)  # the copy's own (full) snapshot
    other = job.create(handles=[first])
    other_state = other.get_state(VALUE)
    other.set_current_key(gone)
    other_state.clear()
    other.set_current_key(changed)
    other_state.update(-1)
    second = job.snapshot(other, 2)
    assert 0 in FileParts(job, chain_of(second)[-1][1]).imaged  # X's key group: an image
    assert 100 not in FileParts(job, chain_of(second)[-1][1]).imaged  # the change: a diff
    assert copy.catch_up([second], job.storage)
    assert contents([copy]) == contents([other])
    copy.set_current_key(gone)
    assert state.value() is None
    # The caught-up copy's next snapshot extends the chain it caught up with.
    third = job.snapshot(copy, 3)
    assert [n for n, _ in chain_of(third)][:-1] == [n for n, _ in chain_of(second)]
    assert contents(job.create_all(2, [third])) == contents([copy])
