"""The checkpoint coordinator on real files: the walkthrough and the race of Flink's blog post on
incremental checkpoints ("Managing Large State in Apache Flink"), aborts, crashes at every step
of ``complete``, corrupt and incompatible checkpoints on recovery."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import msgspec
import pytest

from keyedstate.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from keyedstate.checkpoint.registry import SharedStateRegistry
from keyedstate.errors import (
    CheckpointAbortedError,
    CheckpointError,
    CheckpointProtocolError,
    ConfigurationError,
    CorruptCheckpointError,
    KeyGroupRangeError,
    MaxParallelismMismatchError,
    MissingCheckpointFileError,
    UnsupportedFormatVersionError,
)
from keyedstate.processor.inspection import find_garbage
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import (
    CheckpointMetadata,
    KeyedStateHandle,
    StreamHandle,
    serialize_metadata,
)

from . import acknowledge_all, make_handle, shared_files, snapshot


@pytest.fixture
def storage(tmp_path: Path) -> CheckpointStorage:
    return CheckpointStorage(str(tmp_path / "job"))


def config(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(backend="rocksdb", parallelism=2, max_parallelism=128,
                                key_types=["bigint"], num_retained=1)
    args.update(overrides)
    return args


def checkpoint(coordinator: CheckpointCoordinator, *, new: tuple[str, ...] = ("sst",),
               reuse: list[StreamHandle] | tuple[()] = ()) -> CompletedCheckpoint:
    pending = coordinator.trigger({"batch_id": "b"})
    acknowledge_all(coordinator, pending, new=new, reuse=reuse)
    return coordinator.complete(pending)


def shared_of(completed: CompletedCheckpoint) -> list[StreamHandle]:
    return [f for h in completed.handles for f in h.shared.values()]


def assert_restorable(coordinator: CheckpointCoordinator) -> None:
    """Every file of every retained checkpoint is there and intact; nothing else is left."""
    for completed in coordinator.retained:
        storage = coordinator.storage
        assert storage.read_metadata(completed.metadata_path) == completed.metadata
        for stream in completed.metadata.files():
            storage.read_verified(stream)
    assert find_garbage(coordinator.storage).files == []


# -- the incremental checkpointing blog post ---------------------------------------------------

def test_incremental_checkpoint_walkthrough(storage: CheckpointStorage) -> None:
    """The blog post's example: one subtask, two retained checkpoints, CP1..CP4 (and CP5)."""
    coordinator = CheckpointCoordinator(storage, **config(parallelism=1, num_retained=2))
    files: dict[str, StreamHandle] = {}

    def cp(new: list[str], reuse: list[str]) -> CompletedCheckpoint:
        pending = coordinator.trigger()
        location = pending.location(0)
        for name in new:
            files[name] = location.write_shared(name.encode(), name)
        handle = make_handle(coordinator, pending, 0, {n: files[n] for n in new + reuse})
        coordinator.acknowledge(pending, handle)
        return coordinator.complete(pending)

    def present() -> set[str]:
        return {n for n, h in files.items() if storage.exists(h.path)}

    def last_used(name: str) -> int:
        entry = coordinator.registry.get(files[name].path)
        assert entry is not None
        return entry.last_used_checkpoint_id

    cp(["sst1", "sst2"], [])
    cp(["sst3", "sst4"], ["sst1", "sst2"])
    assert present() == {"sst1", "sst2", "sst3", "sst4"}
    # CP3: compaction merged 1, 2, 3; CP1 is subsumed, but CP2 still uses sst1 and sst2.
    cp(["sst123", "sst5"], ["sst4"])
    assert [c.checkpoint_id for c in coordinator.retained] == [2, 3]
    assert not storage.exists("chk-1/_metadata") and storage.list_files("chk-1") == []
    assert present() == {"sst1", "sst2", "sst3", "sst4", "sst123", "sst5"}
    assert [last_used(n) for n in ("sst1", "sst2", "sst3", "sst4")] == [2, 2, 2, 3]
    # CP4: CP2 is subsumed; sst1, sst2 and sst3 were last used by CP2: deleted now, exactly.
    cp(["sst456"], ["sst123"])
    assert [c.checkpoint_id for c in coordinator.retained] == [3, 4]
    assert present() == {"sst4", "sst5", "sst123", "sst456"}
    assert coordinator.registry.get(files["sst1"].path) is None
    # CP5: CP3 goes, and with it the last users of sst4 and sst5.
    cp([], ["sst123", "sst456"])
    assert present() == {"sst123", "sst456"}
    assert_restorable(coordinator)


def test_incremental_checkpoint_race_unconfirmed_or_deleted_base(
        storage: CheckpointStorage) -> None:
    """Concurrent checkpoints: one that builds on a subsumed checkpoint's deleted file, or on
    a checkpoint that has not completed, is aborted, and its new files are deleted."""
    coordinator = CheckpointCoordinator(storage, **config(parallelism=1))
    cp1 = checkpoint(coordinator)
    cp2 = coordinator.trigger()
    cp3 = coordinator.trigger()
    acknowledge_all(coordinator, cp2, new=["compacted"])  # references nothing of CP1
    handle2 = cp2.acknowledged[0]
    handle3 = snapshot(coordinator, cp3, 0, new=["x"], reuse=shared_of(cp1))
    coordinator.acknowledge(cp3, handle3)
    coordinator.complete(cp2)  # subsumes CP1 and deletes its file
    assert not storage.exists(shared_of(cp1)[0].path)
    # CP3 was triggered before CP2 completed, so its backend built on CP1 (then the last
    # confirmed checkpoint) and references the file just deleted: Step 2 refuses it.
    with pytest.raises(CheckpointAbortedError, match=shared_of(cp1)[0].path) as info:
        coordinator.complete(cp3)
    assert "last confirmed checkpoint" in str(info.value)
    assert not any(storage.exists(f.path) for f in handle3.shared.values()
                   if f.path.startswith("shared/chk-3-"))
    assert storage.list_files("chk-3") == ["chk-3/_aborted"]  # its id stays used
    # A checkpoint built on a still-pending one (an unconfirmed base) is refused too.
    cp4, cp5 = coordinator.trigger(), coordinator.trigger()
    acknowledge_all(coordinator, cp4)
    coordinator.acknowledge(cp5, snapshot(coordinator, cp5, 0, reuse=list(
        cp4.acknowledged[0].shared.values())))
    with pytest.raises(CheckpointAbortedError, match="checkpoint 4, which has not completed"):
        coordinator.complete(cp5)
    assert coordinator.latest_completed is not None
    assert coordinator.latest_completed.checkpoint_id == 2
    assert all(f.path in shared_files(coordinator) for f in handle2.shared.values())
    coordinator.abort(cp4, "test")
    assert_restorable(coordinator)


# -- abort -------------------------------------------------------------------------------------

def test_abort_deletes_what_the_checkpoint_wrote(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config())
    cp1 = checkpoint(coordinator)
    before = set(storage.list_files())
    pending = coordinator.trigger()
    coordinator.acknowledge(pending, snapshot(coordinator, pending, 0, reuse=shared_of(cp1)))
    # Subtask 1 runs in an executor: it writes through a pickled copy of its location, whose
    # record of written files the driver never sees, and fails before acknowledging.
    remote = pickle.loads(pickle.dumps(pending.location(1)))
    remote.write_shared(b"half", "000009.sst")
    remote.write_private(b"half", "MANIFEST")
    coordinator.abort(pending, "subtask 1 failed")
    # Nothing it wrote is left; its tombstone keeps its id used.
    assert set(storage.list_files()) == before | {"chk-2/_aborted"}
    assert pending.is_aborted and pending.failure_reason == "subtask 1 failed"
    with pytest.raises(CheckpointAbortedError, match="subtask 1 failed"):
        coordinator.complete(pending)
    with pytest.raises(CheckpointAbortedError):
        coordinator.acknowledge(pending, make_handle(coordinator, pending, 1, {}))
    coordinator.abort(pending, "again")  # idempotent
    assert_restorable(coordinator)
    assert checkpoint(coordinator).checkpoint_id == 3  # ids are never reused


def test_abort_of_completed_checkpoint_is_refused(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config())
    pending = coordinator.trigger()
    acknowledge_all(coordinator, pending)
    coordinator.complete(pending)
    with pytest.raises(CheckpointError, match="already completed"):
        coordinator.abort(pending, "late")
    with pytest.raises(CheckpointError, match="already completed"):
        coordinator.complete(pending)


def test_completing_a_newer_checkpoint_aborts_older_pending_ones(
        storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config())
    older, newer = coordinator.trigger(), coordinator.trigger()
    acknowledge_all(coordinator, older)
    acknowledge_all(coordinator, newer)
    coordinator.complete(newer)
    with pytest.raises(CheckpointAbortedError, match="subsumed by checkpoint 2"):
        coordinator.complete(older)
    assert coordinator.pending == []
    assert_restorable(coordinator)


def test_files_of_failed_task_attempts_are_deleted(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config())
    pending = coordinator.trigger()
    first_attempt = pickle.loads(pickle.dumps(pending.location(0)))
    orphan = first_attempt.write_shared(b"lost", "000001.sst")
    acknowledge_all(coordinator, pending)
    coordinator.complete(pending)
    assert not storage.exists(orphan.path)
    assert_restorable(coordinator)


# -- acknowledge and complete refusals ---------------------------------------------------------

def test_acknowledge_errors(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config())
    pending = coordinator.trigger()
    good = snapshot(coordinator, pending, 0)
    with pytest.raises(KeyGroupRangeError, match="subtask index 2 is out of range"):
        coordinator.acknowledge(pending, _with(good, subtask_index=2))
    with pytest.raises(KeyGroupRangeError, match="owns KeyGroupRange\\[0, 63\\]"):
        coordinator.acknowledge(pending, _with(good, key_group_end=127))
    with pytest.raises(CheckpointError, match="with a handle of checkpoint 9"):
        coordinator.acknowledge(pending, _with(good, checkpoint_id=9))
    with pytest.raises(ConfigurationError, match="'heap' backend"):
        coordinator.acknowledge(pending, _with(good, backend="heap"))
    coordinator.acknowledge(pending, good)
    with pytest.raises(CheckpointError, match="subtask 0 already acknowledged"):
        coordinator.acknowledge(pending, good)
    with pytest.raises(CheckpointError, match=r"subtasks \[1\] have not acknowledged"):
        coordinator.complete(pending)
    with pytest.raises(KeyGroupRangeError):
        pending.location(5)
    other = CheckpointCoordinator(CheckpointStorage(storage.url + "-other"), **config())
    with pytest.raises(CheckpointError, match="not triggered by this coordinator"):
        other.acknowledge(pending, good)


def _with(handle: KeyedStateHandle, **changes: Any) -> KeyedStateHandle:
    return msgspec.structs.replace(handle, **changes)


def test_private_file_outside_its_checkpoint_is_refused(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config(parallelism=1))
    cp1 = checkpoint(coordinator)
    pending = coordinator.trigger()
    stale = cp1.handles[0].private  # a backend that re-lists last checkpoint's private files
    coordinator.acknowledge(pending, make_handle(coordinator, pending, 0, {}, stale))
    with pytest.raises(CheckpointAbortedError, match="chk-1/sub-0/[0-9a-f]{32}-meta as a private file"):
        coordinator.complete(pending)
    assert_restorable(coordinator)


@pytest.mark.parametrize("num_retained", [0, -1, True, 1.5])
def test_num_retained_must_be_positive(storage: CheckpointStorage, num_retained: Any) -> None:
    with pytest.raises(ConfigurationError, match="num-retained"):
        CheckpointCoordinator(storage, **config(num_retained=num_retained))


def test_new_coordinator_refuses_a_used_root(storage: CheckpointStorage) -> None:
    checkpoint(CheckpointCoordinator(storage, **config()))
    with pytest.raises(ConfigurationError, match="recover"):
        CheckpointCoordinator(storage, **config())


def test_properties_and_handles(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config())
    assert coordinator.latest_completed is None and coordinator.restore_handles() == []
    pending = coordinator.trigger({"batch_id": "7"})
    acknowledge_all(coordinator, pending)
    completed = coordinator.complete(pending, properties={"watermark": "100"})
    assert completed.metadata.properties == {"batch_id": "7", "watermark": "100"}
    assert completed.metadata_path == "chk-1/_metadata"
    assert coordinator.restore_handles() == completed.handles
    assert [h.subtask_index for h in completed.handles] == [0, 1]
    with pytest.raises(ConfigurationError, match="str to str"):
        coordinator.trigger({"batch_id": 7})  # type: ignore[dict-item]


# -- crashes and recovery ----------------------------------------------------------------------

@pytest.mark.parametrize("steps_done", [0, 1, 2, 3, 4, 5, 6])
def test_crash_after_each_step_of_complete(storage: CheckpointStorage, steps_done: int) -> None:
    """Run complete() up to step k, drop the coordinator (the driver died), recover."""
    coordinator = CheckpointCoordinator(storage, **config())
    cp1 = checkpoint(coordinator, new=("a", "b"))
    pending = coordinator.trigger()
    acknowledge_all(coordinator, pending, reuse=shared_of(cp1)[:1])
    steps = coordinator._complete_steps(pending)
    for _ in range(steps_done):
        next(steps)
    del coordinator, steps
    recovered = CheckpointCoordinator.recover(storage, **config())
    latest = recovered.latest_completed
    assert latest is not None
    assert latest.checkpoint_id == (2 if steps_done >= 3 else 1)
    assert [c.checkpoint_id for c in recovered.retained] == [latest.checkpoint_id]
    if steps_done >= 3:
        assert recovered.recovery_notes == []
    else:  # chk-2/ without _metadata: the fall-back to checkpoint 1 is said, not silent
        assert len(recovered.recovery_notes) == 1
        assert "chk-2 has no _metadata" in recovered.recovery_notes[0]
        assert "recovered from checkpoint 1" in recovered.recovery_notes[0]
    assert_restorable(recovered)
    assert storage.checkpoint_ids() == [latest.checkpoint_id]
    # The recovered coordinator goes on, with a fresh id.
    assert checkpoint(recovered, reuse=shared_of(latest)).checkpoint_id == 3
    assert_restorable(recovered)


@pytest.mark.parametrize("first", [False, True])
def test_a_registry_failing_after_the_commit_point_takes_the_checkpoint_back(
        storage: CheckpointStorage, monkeypatch: pytest.MonkeyPatch, first: bool) -> None:
    """Step 4 (register) raises after Step 3 wrote ``_metadata``: the caller sees the
    checkpoint fail, and storage agrees: it is aborted after all (its ``_metadata`` and files
    gone, a tombstone), recovery finds the checkpoint before it, or, when it was the job's
    first, a new job (the root's completed marker its commit wrote is gone too)."""
    coordinator = CheckpointCoordinator(storage, **config())
    before = None if first else checkpoint(coordinator, new=("a",))
    pending = coordinator.trigger({"batch_id": "7"})
    acknowledge_all(coordinator, pending, new=("b",))

    def failing(self: SharedStateRegistry, metadata: CheckpointMetadata, *,
                owned: bool = True) -> None:
        raise OSError("the registry failed")

    monkeypatch.setattr(SharedStateRegistry, "register_all", failing)
    with pytest.raises(OSError, match="the registry failed"):
        coordinator.complete(pending)
    monkeypatch.undo()
    n = pending.checkpoint_id
    assert pending.is_aborted and not pending.is_completed
    assert storage.list_files(f"chk-{n}") == [f"chk-{n}/_aborted"]
    assert not [p for p in shared_files(coordinator) if p.startswith(f"shared/chk-{n}-")]
    assert storage.exists("_completed") is not first
    assert coordinator.latest_completed is before
    coordinator.abort(pending, "the caller aborts it again")  # a no-op, as for any abort
    recovered = CheckpointCoordinator.recover(storage, **config())
    latest = recovered.latest_completed
    assert (latest and latest.checkpoint_id) == (before and before.checkpoint_id)
    assert checkpoint(recovered).checkpoint_id == n + 1
    assert_restorable(recovered)


def test_recover_deletes_incomplete_and_subsumes_old(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config(num_retained=3))
    for _ in range(3):
        checkpoint(coordinator)
    crashed = coordinator.trigger()
    acknowledge_all(coordinator, crashed)  # files written, never completed
    recovered = CheckpointCoordinator.recover(storage, **config(num_retained=1))
    assert [c.checkpoint_id for c in recovered.retained] == [3]
    assert storage.checkpoint_ids() == [3]
    # chk-4/'s files are gone; as the newest id used it is a tombstone until a later one
    # completes.
    assert storage.list_files("chk-4") == ["chk-4/_aborted"]
    assert storage.list_files("chk-1") == []
    assert_restorable(recovered)
    assert recovered.trigger().checkpoint_id == 5


def test_ids_are_never_reused_across_aborts_and_restarts(storage: CheckpointStorage) -> None:
    """An aborted checkpoint's id is never given out again: not after a restart, not after a
    restart that crashed before writing anything, and its tombstone goes once a later
    checkpoint completes."""
    coordinator = CheckpointCoordinator(storage, **config())
    checkpoint(coordinator)
    aborted = coordinator.trigger()
    acknowledge_all(coordinator, aborted)
    coordinator.abort(aborted, "a subtask failed")  # deletes every file it wrote
    assert aborted.checkpoint_id == 2
    # A restart, then a crash before the next checkpoint wrote anything, then a restart.
    CheckpointCoordinator.recover(storage, **config()).trigger()
    restarted = CheckpointCoordinator.recover(storage, **config())
    assert restarted.recovery_notes == []  # a tombstone is no lost checkpoint
    pending = restarted.trigger()
    assert pending.checkpoint_id == 3
    acknowledge_all(restarted, pending)
    restarted.complete(pending)
    assert storage.list_files("chk-2") == []
    assert storage.checkpoint_dir_ids() == [3]
    assert CheckpointCoordinator.recover(storage, **config()).trigger().checkpoint_id == 4


def test_recover_without_orphan_cleanup(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config())
    checkpoint(coordinator)
    orphan = storage.location(7, 0).write_shared(b"o", "lost.sst")
    kept = CheckpointCoordinator.recover(storage, cleanup_orphans=False, **config())
    assert storage.exists(orphan.path)
    # Id 7 is above the latest checkpoint: gc can't tell it from a checkpoint in flight.
    assert find_garbage(storage).files == []
    assert kept.trigger().checkpoint_id == 8  # above the orphan's id
    cleaned = CheckpointCoordinator.recover(storage, **config())
    assert not storage.exists(orphan.path)
    assert_restorable(cleaned)


def test_checkpoints_in_flight_are_adopted_and_completed_by_another_coordinator(
        storage: CheckpointStorage) -> None:
    """The asynchronous mode's take-over (a Spark Connect client completing what the server's
    copy of the driver left in flight): a coordinator recovered with their ids ``in_flight``
    keeps their directories and files, adopts them as pending and completes them in order,
    the second built on the first's files; ids it can't adopt are refused."""
    first = CheckpointCoordinator(storage, **config())
    reuse = shared_of(checkpoint(first))
    flights = []
    for _ in range(2):  # checkpoints 2 and 3 in flight, 3 built on 2's files
        pending = first.trigger({"batch_id": str(len(flights) + 1)})
        handles = [snapshot(first, pending, i, reuse=reuse if i == 0 else ())
                   for i in range(2)]
        flights.append((pending, handles))
        reuse = list(handles[0].shared.values())
    taken = CheckpointCoordinator.recover(storage, cleanup_orphans=False, in_flight={2, 3},
                                          **config())
    latest = taken.latest_completed
    assert latest is not None and latest.checkpoint_id == 1
    for refused in (1, 4):  # completed; never used
        with pytest.raises(CheckpointProtocolError, match=f"checkpoint {refused} can't be "
                                                          f"adopted"):
            taken.adopt(refused, 0, {})
    for pending, handles in flights:
        adopted = taken.adopt(pending.checkpoint_id, pending.timestamp_ms, pending.properties)
        with pytest.raises(CheckpointProtocolError, match="can't be adopted"):
            taken.adopt(pending.checkpoint_id, pending.timestamp_ms, pending.properties)
        for handle in handles:
            taken.acknowledge(adopted, handle)
        completed = taken.complete(adopted)
        assert completed.metadata.properties["batch_id"] == pending.properties["batch_id"]
    assert storage.checkpoint_ids() == [3]
    assert_restorable(taken)
    assert taken.trigger().checkpoint_id == 4


def test_recover_an_empty_root_starts_a_new_job(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator.recover(storage, **config())
    assert coordinator.latest_completed is None and coordinator.restore_handles() == []
    assert checkpoint(coordinator).checkpoint_id == 1


def test_corrupt_latest_metadata_falls_back_with_a_note(
        storage: CheckpointStorage, caplog: pytest.LogCaptureFixture) -> None:
    coordinator = CheckpointCoordinator(storage, **config(num_retained=2))
    cp1 = checkpoint(coordinator)
    cp2 = checkpoint(coordinator, reuse=shared_of(cp1))
    data = Path(storage.path(cp2.metadata_path)).read_bytes()
    Path(storage.path(cp2.metadata_path)).write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="keyedstate.checkpoint.coordinator"):
        recovered = CheckpointCoordinator.recover(storage, **config(num_retained=2))
    assert recovered.latest_completed is not None
    assert recovered.latest_completed.checkpoint_id == 1
    assert len(recovered.recovery_notes) == 1
    note = recovered.recovery_notes[0]
    assert "checkpoint 2 is unreadable" in note and "chk-2/_metadata" in note
    assert "recovered from checkpoint 1" in note
    assert note in caplog.text
    # CP1's files are intact; CP2's own files are gone, its directory kept for inspection.
    for stream in cp1.metadata.files():
        storage.read_verified(stream)
    assert storage.list_files("chk-2") != []
    with pytest.raises(CorruptCheckpointError, match="chk-2"):
        find_garbage(storage)  # gc refuses while it can't know what chk-2 references
    # New checkpoints never reuse id 2; chk-2 goes once it falls below the retained ones.
    assert checkpoint(recovered, reuse=shared_of(cp1)).checkpoint_id == 3
    assert storage.list_files("chk-2") != []
    checkpoint(recovered)
    assert storage.list_files("chk-2") == []
    assert_restorable(recovered)


def test_no_readable_checkpoint_raises_and_deletes_nothing(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config())
    cp1 = checkpoint(coordinator)
    Path(storage.path(cp1.metadata_path)).write_bytes(b"{}")
    before = storage.list_files()
    with pytest.raises(CorruptCheckpointError, match="no checkpoint .* can be read.*chk-1"):
        CheckpointCoordinator.recover(storage, **config())
    assert storage.list_files() == before


def test_lost_metadata_of_the_latest_checkpoint_falls_back_with_a_note(
        storage: CheckpointStorage, caplog: pytest.LogCaptureFixture) -> None:
    """Only the latest ``_metadata`` deleted: recovery falls back to the newest older complete
    checkpoint and says so (a missing ``_metadata`` may be a crash before the commit or a
    loss; storage can't tell, so the fall-back is never silent)."""
    coordinator = CheckpointCoordinator(storage, **config(num_retained=2))
    cp1 = checkpoint(coordinator)
    cp2 = checkpoint(coordinator, reuse=shared_of(cp1))
    storage.delete([cp2.metadata_path])
    with caplog.at_level(logging.WARNING, logger="keyedstate.checkpoint.coordinator"):
        recovered = CheckpointCoordinator.recover(storage, **config(num_retained=2))
    assert recovered.latest_completed is not None
    assert recovered.latest_completed.checkpoint_id == 1
    assert len(recovered.recovery_notes) == 1
    note = recovered.recovery_notes[0]
    assert "chk-2 has no _metadata" in note and "recovered from checkpoint 1" in note
    assert note in caplog.text
    assert_restorable(recovered)
    assert checkpoint(recovered, reuse=shared_of(cp1)).checkpoint_id == 3


def test_lost_metadata_of_the_only_checkpoint_raises_and_deletes_nothing(
        storage: CheckpointStorage) -> None:
    """num_retained=1 and the latest ``_metadata`` deleted: no complete checkpoint is left,
    but the job completed some (its marker says so). Recovery must not start it from empty
    state: a typed error naming the checkpoint, and nothing deleted."""
    coordinator = CheckpointCoordinator(storage, **config())
    checkpoint(coordinator)
    cp2 = checkpoint(coordinator)
    storage.delete([cp2.metadata_path])
    before = storage.list_files()
    with pytest.raises(MissingCheckpointFileError, match=r"lost its checkpoints.*chk-2/"):
        CheckpointCoordinator.recover(storage, **config())
    with pytest.raises(MissingCheckpointFileError, match="lost its checkpoints"):
        CheckpointCoordinator(storage, **config())  # nor as a new job
    assert storage.list_files() == before


def test_a_crash_before_the_first_commit_still_starts_a_new_job(
        storage: CheckpointStorage) -> None:
    """Without a completed checkpoint ever (no marker), a ``chk-1/`` without ``_metadata`` is
    a checkpoint that never completed: a new job, silently, as before."""
    coordinator = CheckpointCoordinator(storage, **config())
    crashed = coordinator.trigger()
    acknowledge_all(coordinator, crashed)
    del coordinator
    recovered = CheckpointCoordinator.recover(storage, **config())
    assert recovered.latest_completed is None and recovered.recovery_notes == []
    assert checkpoint(recovered).checkpoint_id == 2
    assert storage.exists("_completed")


def test_recover_marks_a_root_written_before_the_marker(storage: CheckpointStorage) -> None:
    """A job directory from before the completed-checkpoint marker gets it on recovery, so a
    later loss of its ``_metadata`` is caught too."""
    coordinator = CheckpointCoordinator(storage, **config())
    cp1 = checkpoint(coordinator)
    storage.delete(["_completed"])
    CheckpointCoordinator.recover(storage, **config())
    assert storage.exists("_completed")
    storage.delete([cp1.metadata_path])
    with pytest.raises(MissingCheckpointFileError, match="chk-1/"):
        CheckpointCoordinator.recover(storage, **config())


def test_a_repeated_checkpoint_id_after_a_driver_crash_is_not_clobbered(
        storage: CheckpointStorage) -> None:
    """The driver triggers checkpoint 2 and dies before any task wrote a file: the restarted
    driver finds no trace of 2 and triggers 2 again. A task of the dead application, still
    running, then finishes its snapshot through its own copy of the location: its files must
    not overwrite the new attempt's (same subtask, same file names), and gc lists them."""

    coordinator = CheckpointCoordinator(storage, **config())
    cp1 = checkpoint(coordinator)
    crashed = coordinator.trigger()
    late_task = pickle.loads(pickle.dumps(crashed.location(0)))  # pickled to an executor
    del coordinator
    recovered = CheckpointCoordinator.recover(storage, **config())
    pending = recovered.trigger()
    assert pending.checkpoint_id == crashed.checkpoint_id == 2
    acknowledge_all(recovered, pending, reuse=shared_of(cp1))
    cp2 = recovered.complete(pending)
    late = [late_task.write_private(b"the failed attempt's meta", "meta"),
            late_task.write_shared(b"the failed attempt's sst", "sst")]
    for stream in cp2.metadata.files():  # the committed checkpoint is intact
        storage.read_verified(stream)
    leftovers = sorted(h.path for h in late)
    assert find_garbage(storage).files == leftovers


def test_newer_format_version_is_not_skipped(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config(num_retained=2))
    checkpoint(coordinator)
    cp2 = checkpoint(coordinator)
    data = serialize_metadata(cp2.metadata).replace(b'"format_version":3', b'"format_version":4')
    Path(storage.path(cp2.metadata_path)).write_bytes(data)
    before = storage.list_files()
    with pytest.raises(UnsupportedFormatVersionError, match="upgrade keyedstate"):
        CheckpointCoordinator.recover(storage, **config(num_retained=2))
    assert storage.list_files() == before


def test_max_parallelism_mismatch_on_recover(storage: CheckpointStorage) -> None:
    checkpoint(CheckpointCoordinator(storage, **config()))
    storage.write("chk-9/sub-0/x", b"pending")
    before = storage.list_files()
    with pytest.raises(MaxParallelismMismatchError,
                       match="max parallelism 128.*configured with 256.*canonical savepoint.*"
                             "state processor API"):
        CheckpointCoordinator.recover(storage, **config(max_parallelism=256))
    assert storage.list_files() == before  # refused before touching anything
    with pytest.raises(ConfigurationError, match="'rocksdb' backend"):
        CheckpointCoordinator.recover(storage, **config(backend="heap"))


def test_recover_at_another_parallelism_rescales(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config(parallelism=2))
    cp1 = checkpoint(coordinator)
    recovered = CheckpointCoordinator.recover(storage, **config(parallelism=3))
    assert recovered.restore_handles() == cp1.handles  # two handles, restored by three
    cp2 = checkpoint(recovered, reuse=shared_of(cp1))
    assert [h.key_group_range.start for h in cp2.handles] == [0, 43, 86]
    assert_restorable(recovered)


def test_not_owned_files_are_never_deleted(storage: CheckpointStorage) -> None:
    """The restore-mode hook: files of a snapshot restored in NO_CLAIM or LEGACY mode (here
    snapshot 7 of another job, whose shared files sit in this root) stay the user's."""
    user = {n: storage.write(f"shared/user-{n}", n.encode()) for n in ("a", "b")}
    restored = CheckpointMetadata(7, 0, "rocksdb", 1, 128, ["bigint"], [KeyedStateHandle(
        "rocksdb", 0, 0, 127, 7, [], user, {}, 2, 2)])
    coordinator = CheckpointCoordinator(storage, **config(parallelism=1))
    coordinator.register_restored(restored, claim=False)
    first = checkpoint(coordinator, reuse=[user["a"]])  # LEGACY: the first one builds on it
    assert first.checkpoint_id == 8  # above the restored snapshot's id
    checkpoint(coordinator)
    checkpoint(coordinator)  # nothing references the user's files any more
    assert all(storage.exists(h.path) for h in user.values())
    assert not {h.path for h in user.values()} & set(find_garbage(storage).files)
    # After a crash, the restore settings are passed again (as Flink reads its job config).
    again = CheckpointCoordinator.recover(storage, **config(parallelism=1), not_owned=[restored])
    assert all(storage.exists(h.path) for h in user.values())
    assert find_garbage(storage).files == []
    assert again.trigger().checkpoint_id == 11


def test_corrupt_metadata_between_retained_checkpoints(storage: CheckpointStorage) -> None:
    coordinator = CheckpointCoordinator(storage, **config(num_retained=3))
    for _ in range(3):
        checkpoint(coordinator)
    storage.write("chk-2/_metadata", b"garbage")
    recovered = CheckpointCoordinator.recover(storage, **config(num_retained=3))
    assert [c.checkpoint_id for c in recovered.retained] == [1, 3]
    assert len(recovered.recovery_notes) == 1
    assert "recovered from" not in recovered.recovery_notes[0]
    assert "chk-2 is kept for inspection" in recovered.recovery_notes[0]
    # Once older than every retained checkpoint, it goes with the rest of the subsumed.
    again = CheckpointCoordinator.recover(storage, **config(num_retained=1))
    assert "was deleted" in again.recovery_notes[0]
    assert storage.list_files("chk-2") == [] and storage.checkpoint_ids() == [3]
    assert_restorable(again)
