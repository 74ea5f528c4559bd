"""Checkpoint storage on a real local directory: verified reads, atomic ``_metadata``, pickling."""

from __future__ import annotations

import os
import pickle
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from keyedstate.errors import (
    CorruptCheckpointError,
    MissingCheckpointFileError,
    NoCheckpointError,
    UnsafePathError,
)
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata, KeyedStateHandle, StreamHandle
from keyedstate.storage.layout import checkpoint_id_of_shared_file
from keyedstate.storage.transfer import TransferStats


@pytest.fixture
def storage(tmp_path: Path) -> CheckpointStorage:
    return CheckpointStorage(str(tmp_path / "ckpt"))


def metadata(checkpoint_id: int, files: int = 1) -> CheckpointMetadata:
    shared = {f"{i}.sst": StreamHandle(f"shared/f{i}", i, f"{i:016x}") for i in range(files)}
    handle = KeyedStateHandle("heap", 0, 0, 127, checkpoint_id, [], shared, {}, files, files)
    return CheckpointMetadata(checkpoint_id, 0, "heap", 1, 128, ["bigint"], [handle],
                              properties={"batch_id": str(checkpoint_id)})


# -- verified reads ----------------------------------------------------------------------------

def test_write_then_read_verified(storage: CheckpointStorage) -> None:
    handle = storage.write("shared/a", b"hello")
    assert handle == StreamHandle("shared/a", 5, handle.checksum)
    assert storage.read_verified(handle) == b"hello"


def test_upload_then_download(storage: CheckpointStorage, tmp_path: Path) -> None:
    source = tmp_path / "local.sst"
    source.write_bytes(b"x" * 10_000)
    handle = storage.upload(str(source), "shared/b.sst")
    target = tmp_path / "restore" / "b.sst"
    storage.download(handle, str(target))
    assert target.read_bytes() == source.read_bytes()


def test_an_immutable_file_of_a_local_store_is_linked_not_copied(storage: CheckpointStorage,
                                                                  tmp_path: Path) -> None:
    handle = storage.write("shared/c.sst", b"y" * 10_000)
    target = tmp_path / "restore" / "c.sst"
    stats = TransferStats()
    storage.download(handle, str(target), immutable=True, stats=stats)
    assert os.stat(target).st_ino == os.stat(storage.path("shared/c.sst")).st_ino
    assert (stats.duplicated_bytes, stats.downloaded_bytes) == (10_000, 0)
    target.unlink()  # RocksDB deleting its copy (compaction) leaves the checkpoint whole
    assert storage.read_verified(handle) == b"y" * 10_000
    # a mutable file is copied
    storage.download(handle, str(target), immutable=False)
    assert os.stat(target).st_ino != os.stat(storage.path("shared/c.sst")).st_ino


def test_files_hashed_before_a_restore_are_linked_with_a_size_check_only(
        storage: CheckpointStorage, tmp_path: Path) -> None:
    """What the driver hashed at a job's start (verify_snapshot_files) travels with the storage
    to the executors, whose hard links of those files then check sizes, not bytes again."""
    noted = storage.write("shared/e.sst", b"a" * 100)
    other = storage.write("shared/f.sst", b"b" * 100)
    storage.note_verified([noted])
    shipped = pickle.loads(pickle.dumps(storage))
    shipped.download(noted, str(tmp_path / "e.sst"), immutable=True)
    Path(storage.path("shared/e.sst")).write_bytes(b"a" * 99)  # truncated since: caught
    with pytest.raises(CorruptCheckpointError, match="shared/e.sst is corrupt"):
        shipped.download(noted, str(tmp_path / "e2.sst"), immutable=True)
    Path(storage.path("shared/f.sst")).write_bytes(b"B" * 100)  # not noted: hashed
    with pytest.raises(CorruptCheckpointError, match="shared/f.sst is corrupt"):
        shipped.download(other, str(tmp_path / "f.sst"), immutable=True)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a second file system")
def test_an_immutable_file_on_another_device_is_copied(storage: CheckpointStorage) -> None:
    handle = storage.write("shared/d.sst", b"z" * 1000)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        if os.stat(other).st_dev == os.stat(storage.path("shared/d.sst")).st_dev:
            pytest.skip("/dev/shm is on the same device here")
        target = os.path.join(other, "d.sst")
        storage.download(handle, target, immutable=True)  # EXDEV: no link, a copy
        assert open(target, "rb").read() == b"z" * 1000


@pytest.mark.parametrize("immutable", [False, True])
@pytest.mark.parametrize("altered", [b"hellO", b"hell"])
def test_download_detects_alteration_linked_or_copied(storage: CheckpointStorage, tmp_path: Path,
                                                      altered: bytes, immutable: bool) -> None:
    handle = storage.write("shared/a", b"hello")
    Path(storage.path("shared/a")).write_bytes(altered)
    with pytest.raises(CorruptCheckpointError, match="shared/a is corrupt"):
        storage.download(handle, str(tmp_path / "out"), immutable=immutable)


@pytest.mark.parametrize("altered", [b"hellO", b"hell", b"hello!"])
def test_read_verified_detects_alteration(storage: CheckpointStorage, altered: bytes) -> None:
    handle = storage.write("shared/a", b"hello")
    Path(storage.path("shared/a")).write_bytes(altered)
    with pytest.raises(CorruptCheckpointError, match="shared/a is corrupt"):
        storage.read_verified(handle)


def test_missing_files(storage: CheckpointStorage, tmp_path: Path) -> None:
    handle = storage.write("shared/a", b"hello")
    storage.delete(["shared/a"])
    with pytest.raises(MissingCheckpointFileError, match="shared/a is missing"):
        storage.read_verified(handle)
    with pytest.raises(MissingCheckpointFileError, match="shared/a is missing"):
        storage.download(handle, str(tmp_path / "out"))
    with pytest.raises(MissingCheckpointFileError, match="shared/a is missing"):
        storage.download(handle, str(tmp_path / "out"), immutable=True)
    with pytest.raises(NoCheckpointError, match="chk-1/_metadata"):
        storage.read_metadata("chk-1/_metadata")


def test_delete_is_idempotent(storage: CheckpointStorage) -> None:
    storage.write("chk-1/sub-0/a", b"1")
    storage.delete(["chk-1/sub-0/a", "chk-1/sub-0/a", "shared/never"])
    storage.delete_dir("chk-1")
    storage.delete_dir("chk-1")
    assert storage.list_files() == []


def test_paths_never_leave_the_root(storage: CheckpointStorage) -> None:
    for bad in ["../x", "/x", "a/../../x", ""]:
        with pytest.raises(UnsafePathError):
            storage.path(bad)
    with pytest.raises(UnsafePathError):
        storage.delete_dir("")  # never the root itself


# -- _metadata ---------------------------------------------------------------------------------

def test_metadata_roundtrip_and_listing(storage: CheckpointStorage) -> None:
    assert storage.checkpoint_ids() == []
    path = storage.write_metadata(metadata(1))
    assert path == "chk-1/_metadata"
    storage.write("chk-2/sub-0/private", b"x")  # a pending checkpoint: no _metadata yet
    storage.write_metadata(metadata(10))
    assert storage.read_metadata(path) == metadata(1)
    assert storage.checkpoint_ids() == [1, 10]


@pytest.mark.parametrize("content", [b"", b'{"format_version": 1, "chec', b"\x00" * 64])
def test_corrupt_metadata_file_names_the_file(storage: CheckpointStorage,
                                              content: bytes) -> None:
    storage.write("chk-4/_metadata", content)
    with pytest.raises(CorruptCheckpointError, match=r"chk-4/_metadata"):
        storage.read_metadata("chk-4/_metadata")


def test_metadata_commit_leaves_no_temporary_file(storage: CheckpointStorage) -> None:
    storage.write_metadata(metadata(1))
    storage.write_metadata(metadata(1, files=3))  # overwritten atomically too
    assert storage.list_files("chk-1") == ["chk-1/_metadata"]


def test_failed_commit_leaves_no_temporary_file(storage: CheckpointStorage) -> None:
    # A directory where _metadata should go makes the final rename fail.
    os.makedirs(storage.path("chk-1/_metadata"))
    with pytest.raises(OSError):
        storage.write_metadata(metadata(1))
    assert os.listdir(storage.path("chk-1")) == ["_metadata"]


def _reading_while(read_once: Callable[[], None], write: Callable[[int], object],
                   writes: int) -> None:
    """Call ``read_once`` over and over on a thread of its own while ``write(i)`` runs for
    each of ``writes`` values of ``i`` here; raise what the reader raised."""
    done = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while not done.is_set():
                read_once()
        except BaseException as exc:  # raised below, in the test's thread
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(writes):
            write(i)
    finally:
        done.set()
        reader.join()
    if errors:
        raise errors[0]


def test_concurrent_reader_sees_only_complete_metadata(storage: CheckpointStorage) -> None:
    """A reader racing the writer sees the old file or the new one, never a partial one; the
    temporary file is never called ``_metadata`` (it ends ``.inprogress``)."""
    versions = [metadata(1, files=n) for n in (1, 400, 2, 800)]
    storage.write_metadata(versions[0])
    seen: list[CheckpointMetadata] = []
    strays: set[str] = set()

    def read() -> None:
        seen.append(storage.read_metadata("chk-1/_metadata"))
        strays.update(n for n in os.listdir(storage.path("chk-1")) if n != "_metadata")

    _reading_while(read, lambda i: storage.write_metadata(versions[i % len(versions)]), 200)
    assert seen and all(m in versions for m in seen)
    assert all(n.startswith("_metadata.") and n.endswith(".inprogress") for n in strays)
    assert storage.list_files("chk-1") == ["chk-1/_metadata"]


def test_a_reader_polling_for_a_written_file_never_sees_part_of_it(
        storage: CheckpointStorage) -> None:
    """What another process polls for as it is written (a subtask's acknowledgement, read by
    the driver the moment it exists) is whole or absent on a local disk, as after a PUT on an
    object store: it is written under a temporary name and renamed. On the old code (opened
    in place, truncated, then written) the reader saw empty and partial files."""
    versions = [bytes([n]) * size for n, size in enumerate((1, 40_000, 3, 120_000), start=1)]
    seen: list[bytes] = []

    def read() -> None:
        try:
            seen.append(storage.read("chk-1/_acks/subtask-0"))
        except FileNotFoundError:
            pass

    _reading_while(read, lambda i: storage.write("chk-1/_acks/subtask-0",
                                                 versions[i % len(versions)]), 400)
    assert seen and all(data in versions for data in seen), \
        sorted({len(d) for d in seen if d not in versions})
    assert storage.list_files("chk-1/_acks") == ["chk-1/_acks/subtask-0"]


# -- locations ---------------------------------------------------------------------------------

def test_location_names_and_tracks_its_files(storage: CheckpointStorage) -> None:
    location = storage.location(5, 2)
    shared = location.write_shared(b"s", "000001.sst")
    private = location.write_private(b"p", "MANIFEST")
    assert shared.path.startswith("shared/chk-5-sub-2-") and shared.path.endswith("-000001.sst")
    assert checkpoint_id_of_shared_file(shared.path) == 5
    assert private.path.startswith("chk-5/sub-2/") and private.path.endswith("-MANIFEST")
    assert location.written == [shared.path, private.path]
    # A retry under the same name never clobbers the first file.
    assert location.write_shared(b"t", "000001.sst").path != shared.path
    assert location.write_private(b"q", "MANIFEST").path != private.path


def test_private_names_are_unique_per_attempt(storage: CheckpointStorage) -> None:
    """Checkpoint ids can repeat after a driver crash: a late task of the failed attempt of
    checkpoint 5 (its own pickled location) writes the same private file name after the new
    attempt did. Both files survive, each under its own name, and the new attempt's handle
    still reads back verified."""
    failed_attempt = pickle.loads(pickle.dumps(storage.location(5, 0)))
    new_attempt = storage.location(5, 0)
    mine = new_attempt.write_private(b"new attempt", "MANIFEST-000004")
    late = failed_attempt.write_private(b"failed attempt, late", "MANIFEST-000004")
    assert late.path != mine.path
    assert storage.read_verified(mine) == b"new attempt"
    assert sorted(storage.list_files("chk-5")) == sorted([mine.path, late.path])


def test_storage_and_locations_pickle(storage: CheckpointStorage) -> None:
    storage.write("shared/x", b"x")  # connects: the live filesystem must not be pickled
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.url == storage.url and copy.read("shared/x") == b"x"
    location = storage.location(3, 0)
    location.write_private(b"p", "a")
    remote = pickle.loads(pickle.dumps(location))
    handle = remote.write_shared(b"data", "b.sst")
    assert (remote.checkpoint_id, remote.subtask_index) == (3, 0)
    assert storage.read_verified(handle) == b"data"
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert pickle.loads(pickle.dumps(metadata(3))) == metadata(3)
