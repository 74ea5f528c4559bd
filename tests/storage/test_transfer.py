"""Transfers: retries on transient errors only, parallelism, the bounded file cache, metadata
format version 2 (inline and segment references) and reading version 1."""

from __future__ import annotations

import errno
import json
import os
import threading

import msgspec
import pytest

from keyedstate.checkpoint.registry import SharedStateRegistry
from keyedstate.errors import (
    CorruptCheckpointError,
    KeyedStateError,
    TransientStorageError,
)
from keyedstate.storage.cache import FileCache, cache_key, process_file_cache
from keyedstate.storage.checkpoint_storage import (
    COALESCE_HOLE_BYTES,
    COALESCE_RANGE_BYTES,
    CheckpointStorage,
    coalesce,
    segments_range,
)
from keyedstate.storage.handles import (
    FORMAT_VERSION,
    CheckpointMetadata,
    KeyedStateHandle,
    Segment,
    StreamHandle,
    content_checksum,
    deserialize_metadata,
    inline_handle,
    serialize_metadata,
)
from keyedstate.storage.location import StateFile
from keyedstate.storage.transfer import (
    MiB,
    TransferOptions,
    TransferStats,
    is_transient,
    parallel_map,
    with_retries,
)
from keyedstate.testing.latency import LatencyModel, behind_latency, process_counts

FAST = TransferOptions(attempts=3, backoff_s=0.001, max_backoff_s=0.002)


# -- retries -------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [
    TimeoutError("read timed out"),
    ConnectionResetError(errno.ECONNRESET, "reset"),
    OSError(errno.EBUSY, "SlowDown: Please reduce your request rate."),
    OSError(errno.EREMOTEIO, "InternalError"),
])
def test_transient_errors_are_retried_then_reported(exc):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise exc
        return "ok"

    assert is_transient(exc)
    assert with_retries("writing x", flaky, FAST) == "ok"
    calls.clear()
    with pytest.raises(TransientStorageError, match="writing x failed 3 times") as info:
        with_retries("writing x", lambda: (calls.append(1), (_ for _ in ()).throw(exc)), FAST)
    assert len(calls) == 3 and info.value.__cause__ is exc


@pytest.mark.parametrize("exc", [FileNotFoundError("gone"), PermissionError("AccessDenied"),
                                 CorruptCheckpointError("bad"), ValueError("bug")])
def test_other_errors_are_raised_at_once(exc):
    calls = []

    def failing():
        calls.append(1)
        raise exc

    assert not is_transient(exc)
    with pytest.raises(type(exc)):
        with_retries("reading y", failing, FAST)
    assert calls == [1]


def test_transfers_run_in_parallel_and_keep_order():
    barrier = threading.Barrier(4, timeout=10)  # deadlocks unless 4 calls run at once

    def work(i):
        barrier.wait()
        return i * i

    assert parallel_map(work, range(4), threads=4) == [0, 1, 4, 9]
    with pytest.raises(ZeroDivisionError):
        parallel_map(lambda i: 1 // (i - 2), range(4), threads=4)


def test_transfer_threads_are_kept_between_calls_and_nested_calls_run_inline():
    barrier = threading.Barrier(3, timeout=10)  # every call of a round on its own thread

    def thread(_):
        barrier.wait()
        return threading.current_thread()

    first = set(parallel_map(thread, range(3), threads=3))
    assert set(parallel_map(thread, range(3), threads=3)) == first  # the same 3 threads
    assert all(t.name.startswith("keyedstate-transfer-3") for t in first)
    # A call from a pool thread that fans out again must not wait on the pool it occupies:
    # with 2 threads and 2 outer calls each waiting on 2 inner ones it would deadlock.
    assert parallel_map(lambda i: sum(parallel_map(lambda j: i * j, range(3), threads=2)),
                        range(2), threads=2) == [0, 3]


def test_a_forked_child_gets_its_own_transfer_threads():
    parallel_map(lambda i: i, range(4), threads=4)  # the parent's pool exists
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a pool without threads would hang here
        try:
            ok = parallel_map(lambda i: i + 1, range(4), threads=4) == [1, 2, 3, 4]
            os.write(write, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 2) == b"ok" and status == 0


def test_transfer_stats_round_trip_through_properties():
    stats = TransferStats(uploaded_bytes=10, duplicated_bytes=5, retries=1)
    props = stats.to_properties()
    assert props == {"transfer.uploaded-bytes": "10", "transfer.duplicated-bytes": "5",
                     "transfer.retries": "1"}
    assert TransferStats.from_properties(props) == stats


# -- cache ---------------------------------------------------------------------------------------

def test_cache_is_bounded_and_evicts_the_least_recently_used_whole_files(tmp_path):
    cache = FileCache(str(tmp_path / "cache"), capacity=250)
    for name in "abc":
        cache.put_bytes(name, name.encode() * 100)
    # 300 bytes do not fit: "a" (oldest) went whole
    assert cache.get_bytes("a") is None
    assert cache.get_bytes("b") == b"b" * 100  # "b" is now the most recently used
    cache.put_bytes("d", b"d" * 100)
    assert "c" not in cache and "b" in cache and "d" in cache
    src = tmp_path / "big"
    src.write_bytes(b"x" * 300)
    cache.put_file("big", str(src), link=True)  # larger than the cache: never admitted
    assert "big" not in cache
    dest = tmp_path / "out"
    assert cache.get_file("d", str(dest), link=True) and dest.read_bytes() == b"d" * 100
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (2, 1, 2)
    assert stats["used_bytes"] == 200 <= stats["capacity_bytes"]
    assert sorted(os.listdir(tmp_path / "cache")) == ["b", "d"]


def test_process_cache_is_one_per_process_and_directory(tmp_path):
    first = process_file_cache(1000, str(tmp_path))
    assert first is not None and process_file_cache(1000, str(tmp_path)) is first
    assert process_file_cache(500, str(tmp_path)) is first and first.capacity == 500
    assert process_file_cache(0, str(tmp_path)) is None
    assert os.path.basename(first.directory) == f"keyedstate-file-cache-{os.getpid()}"


# -- metadata version 2 --------------------------------------------------------------------------

def _v2_metadata() -> CheckpointMetadata:
    container = StreamHandle("shared/chk-4-sub-0-u-merged", 30, "00aa")
    handle = KeyedStateHandle(
        "rocksdb", 0, 0, 127, 4, [],
        shared={"000009.sst": StreamHandle(container.path, 30, "00aa",
                                           segment=Segment(0, 20, "0011")),
                "000010.sst": StreamHandle("shared/chk-3-sub-0-v-000010.sst", 99, "00bb")},
        private={"MANIFEST": StreamHandle(container.path, 30, "00aa",
                                          segment=Segment(20, 10, "0022")),
                 "CURRENT": inline_handle(b"MANIFEST-000004\n")},
        full_size=20 + 99 + 10 + 16, incremental_size=46)
    return CheckpointMetadata(4, 0, "rocksdb", 1, 128, ["bigint"], [handle])


def test_version_3_round_trips_inline_and_segment_references():
    metadata = _v2_metadata()
    data = serialize_metadata(metadata)
    assert json.loads(data)["format_version"] == FORMAT_VERSION == 3
    assert deserialize_metadata(data) == metadata
    handle = metadata.handles[0]
    # objects, once per segment with the object's identity; inline files have none
    assert sorted({f.path for f in handle.files()}) == ["shared/chk-3-sub-0-v-000010.sst",
                                                        "shared/chk-4-sub-0-u-merged"]
    assert all(f.segment is None and f.data is None for f in handle.files())
    # the registry tracks the merged object (also for its private segment) by its identity
    registry = SharedStateRegistry()
    registry.register_all(metadata)
    assert set(registry) == {"shared/chk-4-sub-0-u-merged", "shared/chk-3-sub-0-v-000010.sst"}


def test_version_1_metadata_is_still_read():
    body = {"checkpoint_id": 3, "timestamp_ms": 5, "backend": "heap", "parallelism": 1,
            "max_parallelism": 128, "key_types": ["bigint"], "handles": [{
                "backend": "heap", "subtask_index": 0, "key_group_start": 0,
                "key_group_end": 127, "checkpoint_id": 3, "states": [],
                "shared": {"f": {"path": "shared/chk-3-sub-0-x-f", "size": 4,
                                 "checksum": "abcd"}},
                "private": {}, "full_size": 4, "incremental_size": 4}]}
    raw = json.dumps(body, separators=(",", ":")).encode()
    data = json.dumps({"format_version": 1, "checksum": content_checksum(raw)}).encode()
    data = data[:-1] + b', "body": ' + raw + b"}"
    metadata = deserialize_metadata(data)
    assert metadata.handles[0].shared["f"] == StreamHandle("shared/chk-3-sub-0-x-f", 4, "abcd")


@pytest.mark.parametrize("bad", [
    {"path": "shared/x", "size": 2, "checksum": "00", "data": "aGk="},  # inline with a path
    {"path": "", "size": 5, "checksum": "00", "data": "aGk="},          # wrong inline size
    {"path": "shared/x", "size": 5, "checksum": "00", "segment": [3, 4, "00"]},  # outside
])
def test_inconsistent_references_are_refused(bad):
    with pytest.raises((CorruptCheckpointError, msgspec.ValidationError)):
        msgspec.json.decode(json.dumps(bad), type=StreamHandle)


# -- storage: inline, merged, verified reads ------------------------------------------------------

def test_put_files_inlines_merges_and_reads_back_verified(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "root"), transfer=TransferOptions(
        inline_threshold=10, merge_file_size=1000, merge_max_size=2000))
    big = tmp_path / "big.sst"
    big.write_bytes(os.urandom(5000))
    files = [StateFile("CURRENT", False, data=b"tiny"),
             StateFile("a.sst", True, data=b"a" * 300),
             StateFile("MANIFEST", False, data=b"m" * 200),
             StateFile("big.sst", True, local_path=str(big))]
    location = storage.location(7, 1)
    handles = location.put_files(files)
    assert handles[0].data == b"tiny"
    assert handles[1].segment is not None and handles[1].path == handles[2].path
    assert handles[1].path.startswith("shared/chk-7-sub-1-")  # merged objects are shared
    assert handles[3].segment is None and handles[3].size == 5000
    for f, handle in zip(files, handles):
        assert storage.read_verified(handle) == f.read()
    assert location.stats.merged_files == 2 and location.stats.inlined_files == 1
    assert sorted(storage.list_files()) == sorted({handles[1].path, handles[3].path})
    # an altered segment is refused, naming the object and the byte range
    path = storage.path(handles[1].path)
    data = bytearray(open(path, "rb").read())
    data[5] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"merged \(bytes 0\+300\) is corrupt"):
        storage.read_verified(handles[1])
    assert storage.read_verified(handles[2]) == b"m" * 200  # the other segment is intact


def test_storage_pickles_with_its_transfer_options(tmp_path):
    import pickle

    options = TransferOptions(threads=2, inline_threshold=7)
    storage = CheckpointStorage(str(tmp_path), {"auto_mkdir": True}, options)
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.transfer == options and clone.storage_options == storage.storage_options
    assert cache_key("ab", 3) == "ab-3"
    assert issubclass(TransientStorageError, (KeyedStateError, ConnectionError))


def _segment(path: str, offset: int, length: int) -> StreamHandle:
    return StreamHandle(path, 100 * MiB, "0" * 16, segment=Segment(offset, length, "1" * 16))


def test_coalesce_groups_the_segments_of_one_object_up_to_a_hole_and_a_size():
    handles = [
        _segment("a", 0, 100),
        StreamHandle("whole", 50, "0" * 16),                  # a whole file: read alone
        _segment("a", 100 + COALESCE_HOLE_BYTES, 10),         # a hole of the limit: joins
        _segment("b", 0, 10),                                 # another object
        _segment("a", 110 + 2 * COALESCE_HOLE_BYTES + 1, 5),  # a hole one byte over: apart
        inline_handle(b"inline"),                             # no request at all
        _segment("a", 10 * MiB, COALESCE_RANGE_BYTES + 1),    # over the size limit: alone
    ]
    assert coalesce(handles) == [[0, 2], [4], [6], [3]]
    assert segments_range([handles[0], handles[2]]) == (0, 110 + COALESCE_HOLE_BYTES)
    assert coalesce(handles, hole=0) == [[0], [2], [4], [6], [3]]


def _merged_files(tmp_path) -> tuple[CheckpointStorage, list[StateFile], list[StreamHandle]]:
    """Behind the latency wrapper (no latency: counts only), so the store is remote and the
    file cache on: six small files merged into one object and one big file alone."""
    url, options = behind_latency(str(tmp_path / "root"), {},
                                  LatencyModel("free", first_byte_ms=0.0))
    storage = CheckpointStorage(url, options, TransferOptions(
        inline_threshold=0, merge_file_size=1000, merge_max_size=100_000,
        cache_dir=str(tmp_path / "cache")))
    files = [StateFile(f"f{i}.sst", True, data=bytes([65 + i]) * (100 + i), immutable=True)
             for i in range(6)] + [StateFile("big.sst", True, data=b"b" * 5000, immutable=True)]
    handles = storage.location(3, 0).put_files(files)
    return storage, files, handles


def test_read_all_and_download_all_read_a_merged_object_once_and_skip_cached_files(tmp_path):
    """Behind the latency wrapper (no latency: counts only) the store is remote: a restore's
    segments of one merged object are one ranged GET; each file is verified and enters the
    file cache, so a second read makes no request."""
    storage, files, handles = _merged_files(tmp_path)
    assert len({h.path for h in handles[:6]}) == 1 and handles[6].segment is None
    cache = storage.cache
    assert cache is not None
    cache.clear()
    stats = TransferStats()
    before = process_counts()
    assert storage.read_all(handles, stats=stats) == [f.read() for f in files]
    moved = process_counts() - before
    assert moved.requests() == moved.requests("read") == 2  # the merged object, the big file
    assert (stats.downloaded_objects, stats.downloaded_bytes) == (7, sum(len(f.read())
                                                                         for f in files))
    # Every file is in the cache now: downloading them again asks the store nothing.
    before = process_counts()
    items = [(h, str(tmp_path / "local" / f.name), True) for h, f in zip(handles, files)]
    storage.download_all(items, stats=stats)
    assert (process_counts() - before).requests() == 0
    assert stats.cache_hit_files == 7
    for (_, path, _), f in zip(items, files):
        assert open(path, "rb").read() == f.read()
    # Cold again: download_all reads the merged object once too; a corrupt segment is named.
    cache.clear()
    before = process_counts()
    storage.download_all(items)
    assert (process_counts() - before).requests("read") == 2
    cache.clear()
    path = storage.path(handles[2].path).split("://", 1)[-1]
    data = bytearray(open(path, "rb").read())
    data[handles[2].segment.offset] ^= 1  # type: ignore[union-attr]
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="is corrupt"):
        storage.read_all(handles)


def test_prefetch_fills_the_cache_in_bounded_batches_and_asks_nothing_twice(tmp_path,
                                                                            monkeypatch):
    """``CheckpointStorage.prefetch``: every stored file the cache lacks, verified, at most
    ``PREFETCH_BATCH_BYTES`` in memory at once (a merged object's segments still one read
    within a batch); a second prefetch asks the store nothing; a local disk has no cache."""
    import keyedstate.storage.checkpoint_storage as checkpoint_storage

    storage, files, handles = _merged_files(tmp_path)
    cache = storage.cache
    assert cache is not None
    cache.clear()
    reads: list[int] = []
    read_all = storage.read_all
    monkeypatch.setattr(storage, "read_all",
                        lambda hs, **kw: reads.append(len(hs)) or read_all(hs, **kw))
    monkeypatch.setattr(checkpoint_storage, "PREFETCH_BATCH_BYTES", 300)
    before = process_counts()
    assert storage.prefetch([*handles, inline_handle(b"inline")]) == sum(
        len(f.read()) for f in files)
    assert all(cache_key(h.digest, h.length) in cache for h in handles)
    assert reads == [3, 3, 1]  # files of 100-105 bytes until 300 are held, then the big one
    # one ranged read of the merged object per batch of its segments, one of the big file
    assert (process_counts() - before).requests("read") == 3
    before = process_counts()
    assert storage.prefetch(handles) == 0
    assert (process_counts() - before).requests() == 0
    local = CheckpointStorage(str(tmp_path / "local"))
    assert local.cache is None and local.prefetch(handles) == 0
