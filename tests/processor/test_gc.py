"""The one garbage finder (:func:`keyedstate.processor.inspection.find_garbage`, what
``keyedstate gc``, the chaos soak and the tests use) where it can go wrong: a file an in-flight
checkpoint may still write, a claimed snapshot's files, the staged output of a batch whose
sink commit is still to come, and a sink-commit marker the driver still reads. Real
checkpoints of both backends, no mocks."""

from __future__ import annotations

import json
import os

import pytest

from keyedstate.processor.inspection import delete_garbage, find_garbage
from keyedstate.runtime.local import LocalKeyedOperator
from keyedstate.storage.layout import CLAIM_MARKER_FILE, commit_marker, staging_dir
from tests.checkpoint.test_savepoints import BACKENDS, feed, files_under, read_all, run_job


def _touch(root: str, relative: str) -> str:
    path = os.path.join(root, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"x")
    return relative


@pytest.mark.parametrize("backend", BACKENDS)
def test_files_an_in_flight_checkpoint_may_still_write_are_never_listed(tmp_path, backend):
    root = str(tmp_path / "job")
    op, expected = run_job(root, backend, rounds=2)  # checkpoint 2 retained
    # Checkpoint 3 is in flight: its subtasks have written files, nothing is committed yet.
    feed(op, 2, expected)
    pending = op.coordinator.trigger({"batch_id": "2"})
    in_flight = [pending.location(0).write_shared(b"sst", "000009.sst").path,
                 pending.location(1).write_private(b"meta", "MANIFEST-000002").path]
    assert find_garbage(root).files == []
    # Once a newer checkpoint completes, the in-flight one can never complete (aborted,
    # Flink's rule): a late write of it is garbage now.
    op.checkpoint({"batch_id": "3"})
    late = pending.location(0).write_shared(b"late", "000010.sst").path
    assert find_garbage(root).files == [late]
    assert not any(os.path.exists(os.path.join(root, p)) for p in in_flight)
    op.close()
    with LocalKeyedOperator(root, key_types=["bigint"], backend=backend,
                            parallelism=2) as again:
        assert read_all(again) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_claimed_snapshots_files_are_kept_in_both_directories(tmp_path, backend):
    source = str(tmp_path / "source")
    op, expected = run_job(source, backend, rounds=2)
    op.close()
    snapshot = os.path.join(source, "chk-2")
    before = set(files_under(source))
    job = str(tmp_path / "job")
    with LocalKeyedOperator(job, key_types=["bigint"], backend=backend, parallelism=2,
                            num_retained=2, restore_path=snapshot,
                            restore_mode="CLAIM") as claimed:
        # The claimed checkpoint lies in another job's directory, marked: gc there keeps it.
        assert set(files_under(source)) == before | {f"chk-2/{CLAIM_MARKER_FILE}"}
        assert find_garbage(source).files == []
        # In the claiming job, its duplicated files are checkpoint 2's: referenced, kept.
        assert find_garbage(job).files == []
        feed(claimed, 2, expected)
        claimed.checkpoint()
        assert find_garbage(job).files == [] and find_garbage(source).files == []
        assert read_all(claimed) == expected


def _staged(root: str, batch: int, n: int = 1) -> dict[str, list[str]]:
    return {"main": [_touch(root, f"{staging_dir(batch)}/main/part-{i:05d}.parquet")
                     for i in range(n)]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_staged_output_and_markers_the_sink_commit_still_needs_are_kept(tmp_path, backend):
    """A Spark job stages a batch's output, checkpoints (recording what it staged), then
    commits the sinks and writes ``commits/batch-B-chk-N``. Between the checkpoint and the
    marker, the staged files are the batch's only output: gc must keep them."""
    root = str(tmp_path / "job")
    op = LocalKeyedOperator(root, key_types=["bigint"], backend=backend, parallelism=2,
                            num_retained=2)
    expected: dict = {}
    for batch in range(3):  # checkpoints 1..3 for batches 0..2, each committed
        feed(op, batch, expected)
        staged = _staged(root, batch)
        done = op.checkpoint({"batch_id": str(batch), "staged": json.dumps(staged)})
        _touch(root, commit_marker(batch, done.checkpoint_id))
    # Batch 3: checkpoint 4 complete, its sink commit not yet done (no marker).
    feed(op, 3, expected)
    waiting = _staged(root, 3, n=2)
    op.checkpoint({"batch_id": "3", "staged": json.dumps(waiting)})
    report = find_garbage(root)
    # Retained: checkpoints 3 and 4. Batches 0-2 are committed: their staged files are
    # garbage; the markers of checkpoints older than every retained one (1, 2) too; the
    # retained checkpoint 3's marker stays (the driver may consult it after a failure).
    assert report.files == sorted([
        commit_marker(0, 1), commit_marker(1, 2),
        *(p for b in range(3) for p in _staged_paths(b)),
    ])
    assert not set(waiting["main"]) & set(report.files)
    delete_garbage(report)
    assert all(os.path.exists(os.path.join(root, p)) for p in waiting["main"])
    assert os.path.exists(os.path.join(root, commit_marker(2, 3)))
    # The sink commit of batch 3 completes: now its staged files are garbage too.
    _touch(root, commit_marker(3, 4))
    assert find_garbage(root).files == sorted(waiting["main"])
    op.close()


def _staged_paths(batch: int) -> list[str]:
    return [f"{staging_dir(batch)}/main/part-00000.parquet"]


def test_shared_files_outside_the_layouts_names_are_never_listed(tmp_path):
    """``shared/`` names carry the checkpoint that wrote them (``shared/chk-<N>-...``); a file
    without one is not the job's (e.g. a restored snapshot's it does not own)."""
    root = str(tmp_path / "job")
    op, _ = run_job(root, "heap", rounds=2)
    op.close()
    foreign = _touch(root, "shared/user-file.sst")
    dead = _touch(root, "shared/chk-1-sub-0-dead-000009.sst")
    assert find_garbage(root).files == [dead]
    assert os.path.exists(os.path.join(root, foreign))
