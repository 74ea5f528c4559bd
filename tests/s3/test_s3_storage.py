"""Checkpoint storage on an S3-compatible object store (a local moto server): the same
guarantees as on a local disk."""

from __future__ import annotations

import pytest

from keyedstate.errors import CorruptCheckpointError, MissingCheckpointFileError
from keyedstate.processor.inspection import find_garbage
from keyedstate.runtime.local import LocalKeyedOperator
from keyedstate.state.descriptors import ListStateDescriptor, ValueStateDescriptor
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.duplication import duplicate_object
from keyedstate.storage.handles import CheckpointMetadata

pytestmark = pytest.mark.s3

COUNT = ValueStateDescriptor("count", "bigint", default=0)
SEEN = ListStateDescriptor("seen", "string")


def test_write_read_verify_and_atomic_metadata(s3_bucket):
    url, options = s3_bucket
    storage = CheckpointStorage(f"{url}/job", options)
    handle = storage.location(1, 0).write_shared(b"hello", "x.bin")
    assert storage.read_verified(handle) == b"hello"
    storage.write(handle.path, b"hellO")  # altered in place
    with pytest.raises(CorruptCheckpointError):
        storage.read_verified(handle)
    storage.delete([handle.path])
    with pytest.raises(MissingCheckpointFileError):
        storage.read_verified(handle)
    metadata = CheckpointMetadata(checkpoint_id=1, timestamp_ms=0, backend="heap", parallelism=1,
                                  max_parallelism=128, key_types=["string"], handles=[])
    storage.write_metadata(metadata)
    assert storage.checkpoint_ids() == [1]
    assert storage.read_metadata(storage.metadata_path(1)) == metadata


def test_files_written_by_another_process_after_a_listing_are_seen(s3_bucket):
    # The driver lists shared/ (gc, registry), then an executor writes a file there, then the
    # driver copies it into a savepoint: s3fs's listings cache used to answer "missing" (the
    # S3 soak's seed 20261122). Another process = another filesystem instance.
    url, options = s3_bucket
    driver = CheckpointStorage(f"{url}/job", options)
    first = driver.location(1, 0).write_shared(b"one", "a.sst")
    assert driver.list_files("shared") == [first.path]
    executor = CheckpointStorage(f"{url}/job", {**options, "skip_instance_cache": True})
    assert executor.fs is not driver.fs
    second = executor.location(2, 0).write_shared(b"two", "b.sst")
    assert driver.exists(second.path)
    assert driver.read_verified(second) == b"two"
    assert sorted(driver.list_files("shared")) == sorted([first.path, second.path])
    target = CheckpointStorage(f"{url}/savepoint", options)
    duplicate_object(driver, second.path, target, "shared/b.sst", second.size)
    assert target.read("shared/b.sst") == b"two"


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_checkpoint_restore_and_rescale_on_s3(s3_bucket, tmp_path, backend):
    url, options = s3_bucket

    def add(sub, key, value):
        sub.get_state(COUNT).update(sub.get_state(COUNT).value() + value)
        sub.get_state(SEEN).add(f"{key}:{value}")

    keys = [f"user-{i}" for i in range(300)]
    op = LocalKeyedOperator(f"{url}/job", key_types=["string"], backend=backend,
                            parallelism=2, local_dir=str(tmp_path / "a"),
                            storage_options=options)
    with op:
        for round_ in range(3):
            op.process(((k, round_ + 1) for k in keys), add)
            op.checkpoint({"round": str(round_)})
        assert len(op.coordinator.retained) == 1
    # Restore at another parallelism from the objects alone.
    op = LocalKeyedOperator(f"{url}/job", key_types=["string"], backend=backend,
                            parallelism=3, local_dir=str(tmp_path / "b"),
                            storage_options=options)
    with op:
        counts = {}
        for sub in op.subtasks:
            for entry in sub.iter_entries("count"):
                counts[op.key_serializer.deserialize(entry.key_bytes)] = entry.value
        assert counts == {k: 6 for k in keys}
        # No orphan objects: every shared object is referenced by the retained checkpoint.
        assert find_garbage(op.storage).files == []
