"""Restore modes (CLAIM / NO_CLAIM / LEGACY, docs/restore-modes.md) across subsume cycles, with the
files on disk checked after every step: who deletes what, and when. Both backends, real files,
:class:`LocalKeyedOperator`."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from keyedstate.checkpoint.properties import CLAIMED_FROM
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.errors import MissingCheckpointFileError, SnapshotClaimedError
from keyedstate.processor.inspection import find_garbage
from keyedstate.runtime.local import LocalKeyedOperator
from keyedstate.storage.layout import CLAIM_MARKER_FILE, COMPLETED_MARKER_FILE, METADATA_FILE
from tests.checkpoint.test_savepoints import (
    BACKENDS,
    SOME_KEYS,
    feed,
    files_under,
    read_all,
    run_job,
)

pytestmark = pytest.mark.integration


def make_savepoint(tmp_path, backend: str) -> tuple[str, dict]:
    op, expected = run_job(str(tmp_path / "source"), backend, rounds=2)
    path = str(tmp_path / "sp")
    op.savepoint(path)
    op.close()
    return path, expected


def open_job(root: str, backend: str, snapshot: str, mode: str, *, parallelism: int = 2,
             num_retained: int = 1) -> LocalKeyedOperator:
    return LocalKeyedOperator(root, key_types=["bigint"], backend=backend,
                              parallelism=parallelism, num_retained=num_retained,
                              restore_path=snapshot, restore_mode=mode)


def inodes(root: str) -> set[int]:
    return {os.stat(os.path.join(root, p)).st_ino for p in files_under(root)}


def only_referenced_files(root: str) -> bool:
    """The job's root holds exactly what its committed checkpoints reference (gc finds
    nothing), so nothing of the snapshot lingers there unreferenced."""
    return find_garbage(root).files == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["NO_CLAIM", "LEGACY"])
def test_no_claim_and_legacy_never_touch_the_snapshot_nor_depend_on_it(tmp_path, backend, mode):
    snapshot, expected = make_savepoint(tmp_path, backend)
    original = files_under(snapshot)
    job = str(tmp_path / "job")
    # Restore: nothing written anywhere yet; LEGACY warns.
    if mode == "LEGACY":
        with pytest.warns(DeprecationWarning, match="LEGACY is deprecated"):
            op = open_job(job, backend, snapshot, mode)
    else:
        op = open_job(job, backend, snapshot, mode)
    assert files_under(snapshot) == original
    assert not os.path.exists(job)
    assert read_all(op) == expected
    # Checkpoint 1 is full: it references (and hard-links) none of the snapshot's files.
    feed(op, 10, expected)
    first = op.checkpoint()
    assert first.metadata.incremental_size == first.metadata.full_size
    assert not inodes(job) & inodes(snapshot)
    assert files_under(snapshot) == original
    # Later checkpoints are incremental again; subsuming never reaches the snapshot.
    for n in (11, 12):
        feed(op, n, expected, SOME_KEYS)
        later = op.checkpoint()
        assert later.metadata.incremental_size < later.metadata.full_size
        assert files_under(snapshot) == original
        assert only_referenced_files(job)
    op.close()
    # The job no longer needs the snapshot: delete it and restart (rescaled).
    shutil.rmtree(snapshot)
    with LocalKeyedOperator(job, key_types=["bigint"], backend=backend, parallelism=3,
                            restore_path=snapshot, restore_mode=mode) as again:
        assert read_all(again) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_claim_lets_several_jobs_start_from_one_snapshot(tmp_path, backend):
    snapshot, expected = make_savepoint(tmp_path, backend)
    original = files_under(snapshot)
    jobs = [open_job(str(tmp_path / f"job{i}"), backend, snapshot, "NO_CLAIM", parallelism=i)
            for i in (1, 2, 3)]
    for op in jobs:
        assert read_all(op) == expected
        op.checkpoint()
        op.close()
    assert files_under(snapshot) == original


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_retained", [1, 2])
def test_claim_takes_ownership_and_deletes_the_snapshot_once_subsumed(tmp_path, backend,
                                                                     num_retained):
    snapshot, expected = make_savepoint(tmp_path, backend)
    original = files_under(snapshot)
    snapshot_id = resolve_snapshot(snapshot).metadata.checkpoint_id
    job = str(tmp_path / "job")
    op = open_job(job, backend, snapshot, "CLAIM", num_retained=num_retained)
    # Claimed: the snapshot is intact and marked; its files are this job's checkpoint M now.
    marker = json.loads(open(os.path.join(snapshot, CLAIM_MARKER_FILE)).read())
    assert marker["owner"] == job
    assert set(files_under(snapshot)) == set(original) | {CLAIM_MARKER_FILE}
    claimed = op.coordinator.latest_completed
    assert claimed.checkpoint_id == snapshot_id
    assert claimed.metadata.properties[CLAIMED_FROM] == os.path.join(snapshot,
                                                                          METADATA_FILE)
    assert inodes(job) >= inodes(snapshot) - {os.stat(os.path.join(snapshot,
                                                                   CLAIM_MARKER_FILE)).st_ino,
                                              os.stat(os.path.join(snapshot,
                                                                   METADATA_FILE)).st_ino}
    assert read_all(op) == expected
    # Checkpoint 1 builds on the claimed files (incremental, same parallelism).
    feed(op, 10, expected, SOME_KEYS)
    first = op.checkpoint()
    assert first.metadata.incremental_size < first.metadata.full_size
    if num_retained == 2:
        # The claimed checkpoint is still retained: the snapshot stays.
        assert set(files_under(snapshot)) == set(original) | {CLAIM_MARKER_FILE}
        feed(op, 11, expected)
        op.checkpoint()
    # Subsumed: the snapshot is gone, and so is chk-M; only referenced files remain.
    assert not os.path.exists(snapshot)
    assert not os.path.exists(os.path.join(job, f"chk-{snapshot_id}"))
    assert only_referenced_files(job)
    feed(op, 12, expected)
    op.checkpoint()
    op.close()
    with LocalKeyedOperator(job, key_types=["bigint"], backend=backend, parallelism=1,
                            restore_path=snapshot, restore_mode="CLAIM") as again:
        assert read_all(again) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_claim_of_an_already_claimed_snapshot_is_refused_before_anything_is_touched(
        tmp_path, backend):
    snapshot, expected = make_savepoint(tmp_path, backend)
    owner = open_job(str(tmp_path / "owner"), backend, snapshot, "CLAIM")
    claimed = files_under(snapshot)
    for mode in ("CLAIM", "NO_CLAIM", "LEGACY"):
        with pytest.raises(SnapshotClaimedError, match=str(tmp_path / "owner")):
            open_job(str(tmp_path / f"other-{mode}"), backend, snapshot, mode)
        assert not os.path.exists(tmp_path / f"other-{mode}")
        assert files_under(snapshot) == claimed
    assert read_all(owner) == expected
    owner.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_interrupted_claim_is_claimed_again_by_the_same_job(tmp_path, backend):
    snapshot, expected = make_savepoint(tmp_path, backend)
    job = str(tmp_path / "job")
    op = open_job(job, backend, snapshot, "CLAIM")
    checkpoint_id = op.coordinator.latest_completed.checkpoint_id
    op.close()
    # As if the job crashed before the claimed checkpoint's _metadata was committed (so
    # before any checkpoint of the job completed: no completed-checkpoint marker either).
    os.remove(os.path.join(job, f"chk-{checkpoint_id}", METADATA_FILE))
    os.remove(os.path.join(job, COMPLETED_MARKER_FILE))
    with open_job(job, backend, snapshot, "CLAIM") as again:
        assert again.coordinator.latest_completed.checkpoint_id == checkpoint_id
        assert read_all(again) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_crash_between_commit_and_subsume_deletes_the_claimed_snapshot_on_recovery(
        tmp_path, backend):
    snapshot, expected = make_savepoint(tmp_path, backend)
    job = str(tmp_path / "job")
    op = open_job(job, backend, snapshot, "CLAIM")
    feed(op, 10, expected)
    # Checkpoint 1 committed (step 3) and registered (step 4), then the driver "crashes".
    pending = op.coordinator.trigger()
    for sub in op.subtasks:
        op.coordinator.acknowledge(pending, sub.snapshot(
            pending.checkpoint_id, pending.location(sub.subtask_index)).materialize())
    steps = op.coordinator._complete_steps(pending)
    assert [next(steps) for _ in range(4)] == [1, 2, 3, 4]
    steps.close()
    op.close_subtasks()
    assert os.path.exists(snapshot)  # not subsumed yet
    with LocalKeyedOperator(job, key_types=["bigint"], backend=backend, parallelism=2,
                            restore_path=snapshot, restore_mode="CLAIM") as recovered:
        assert not os.path.exists(snapshot)
        assert read_all(recovered) == expected
        assert only_referenced_files(job)


@pytest.mark.parametrize("backend", BACKENDS)
def test_claim_of_another_jobs_checkpoint_keeps_the_files_its_neighbours_use(tmp_path,
                                                                            backend):
    op, expected_old = run_job(str(tmp_path / "source"), backend, rounds=3, num_retained=2)
    first_id, last_id = op.coordinator.storage.checkpoint_ids()
    op.close()
    # Claim the older retained checkpoint (chk-first); the newer one shares files with it.
    claim = open_job(str(tmp_path / "job"), backend,
                     str(tmp_path / "source" / f"chk-{first_id}"), "CLAIM")
    claim.checkpoint()
    claim.close()
    assert not os.path.exists(tmp_path / "source" / f"chk-{first_id}")
    with open_job(str(tmp_path / "job2"), backend, str(tmp_path / "source"),
                  "NO_CLAIM") as neighbour:
        assert neighbour.restored.metadata.checkpoint_id == last_id
        assert read_all(neighbour) == expected_old


def test_restore_mode_is_read_from_the_configuration_key(tmp_path):
    from keyedstate.config import JobConfig, RestoreMode
    from keyedstate.errors import ConfigurationError

    config = JobConfig.from_mapping({"execution.checkpointing.dir": str(tmp_path),
                                     "execution.state-recovery.claim-mode": "claim"})
    assert config.restore_mode is RestoreMode.CLAIM
    assert JobConfig(checkpoint_dir=str(tmp_path)).restore_mode is RestoreMode.NO_CLAIM
    with pytest.raises(ConfigurationError, match="NO_CLAIM"):
        LocalKeyedOperator(str(tmp_path / "job"), key_types=["bigint"], restore_mode="GRAB")


# -- a lost _metadata of the job's latest checkpoint ---------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_retained", [1, 2])
def test_lost_latest_metadata_falls_back_with_a_note_or_fails_never_starts_empty(
        tmp_path, backend, num_retained):
    """Only the latest checkpoint's ``_metadata`` deleted: with an older retained checkpoint,
    the job restores it and says so (``recovery_notes``, a warning); with none left, a typed
    error naming the checkpoint, nothing deleted. Never empty state."""
    root = str(tmp_path / "job")
    states = []
    with LocalKeyedOperator(root, key_types=["bigint"], backend=backend, parallelism=2,
                            num_retained=num_retained) as op:
        expected: dict = {}
        for n in range(3):
            feed(op, n, expected)
            latest = op.checkpoint({"batch_id": str(n)})
            states.append(json.loads(json.dumps(expected)))
    os.remove(os.path.join(root, latest.metadata_path))
    if num_retained == 1:
        before = files_under(root)
        with pytest.raises(MissingCheckpointFileError,
                           match=rf"lost its checkpoints.*chk-{latest.checkpoint_id}/"):
            LocalKeyedOperator(root, key_types=["bigint"], backend=backend, parallelism=3)
        assert files_under(root) == before
        return
    with LocalKeyedOperator(root, key_types=["bigint"], backend=backend, parallelism=3,
                            num_retained=num_retained) as op:
        restored = op.coordinator.latest_completed
        assert restored is not None and restored.checkpoint_id == latest.checkpoint_id - 1
        assert any(f"chk-{latest.checkpoint_id} has no _metadata" in note
                   and f"recovered from checkpoint {restored.checkpoint_id}" in note
                   for note in op.coordinator.recovery_notes)
        assert {str(k): [c, s] for k, (c, s) in read_all(op).items()} == states[-2]


@pytest.mark.parametrize("mode", ["NO_CLAIM", "CLAIM"])
def test_lost_metadata_of_a_restored_job_does_not_restart_it_from_its_snapshot(tmp_path, mode):
    """A job started from a savepoint whose only checkpoint lost its ``_metadata`` must not
    silently start from the savepoint again (dropping everything since): a typed error."""
    snapshot, expected = make_savepoint(tmp_path, "rocksdb")
    job = str(tmp_path / "job")
    with open_job(job, "rocksdb", snapshot, mode) as op:
        feed(op, 10, expected)
        latest = op.checkpoint()
    os.remove(os.path.join(job, latest.metadata_path))
    with pytest.raises(MissingCheckpointFileError, match="lost its checkpoints"):
        open_job(job, "rocksdb", snapshot, mode)


def test_the_start_check_notes_the_files_it_hashed_for_the_restores(tmp_path):
    """open_restore_snapshot hashes every file of a local snapshot before anything is touched
    and records them on the snapshot's storage, which travels to the executors: their hard
    links then check sizes only (tests/storage/test_storage.py)."""
    import pickle

    from keyedstate.checkpoint.restore_modes import open_restore_snapshot
    from keyedstate.checkpoint.savepoint import unique_files
    from keyedstate.config import RestoreMode
    from keyedstate.storage.checkpoint_storage import CheckpointStorage

    snapshot, _ = make_savepoint(tmp_path, "rocksdb")
    job = CheckpointStorage(str(tmp_path / "job"))
    opened = open_restore_snapshot(job, snapshot, RestoreMode.NO_CLAIM, max_parallelism=None)
    files = {(f.path, f.size, f.checksum) for f in unique_files(opened.metadata)
             if f.data is None and f.segment is None}
    assert files and pickle.loads(pickle.dumps(opened.storage))._verified == files
