"""State on object storage (docs/object-storage.md), the same tests on the local S3 server and on a
local directory: files move once, the store duplicates what it already holds, small files are
inlined or merged with exact references, restores read through the file cache, and every checkpoint,
restore and savepoint records what it moved."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from keyedstate import ListStateDescriptor, ValueStateDescriptor
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.savepoint import verify_snapshot_files
from keyedstate.errors import CorruptCheckpointError, MissingCheckpointFileError
from keyedstate.processor.inspection import find_garbage, show
from keyedstate.runtime.local import LocalKeyedOperator
from keyedstate.storage.cache import all_process_caches
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import checkpoint_id_of_shared_file
from keyedstate.storage.transfer import RESTORE_PREFIX, TransferStats
from tests.conftest import Store
from tests.s3.conftest import TRANSFER

pytestmark = pytest.mark.integration

BACKENDS = ["rocksdb", "heap"]
COUNT = ValueStateDescriptor("count", "bigint", default=0)
SEEN = ListStateDescriptor("seen", "string")
KEYS = [f"user-{i}" for i in range(2000)]


def add(sub: Any, key: str, value: int) -> None:
    sub.get_state(COUNT).update(sub.get_state(COUNT).value() + value)
    sub.get_state(SEEN).add(f"{key}:{value}")


def job(store: Store, name: str, backend: str, tmp_path: Any, *, parallelism: int = 2,
        **kwargs: Any) -> LocalKeyedOperator:
    return LocalKeyedOperator(store.url(name), key_types=["string"], backend=backend,
                              parallelism=parallelism, local_dir=str(tmp_path / f"work-{name}"),
                              storage_options=store.options, transfer=TRANSFER, **kwargs)


def counts(op: LocalKeyedOperator) -> dict[Any, int]:
    out = {}
    for sub in op.subtasks:
        for entry in sub.iter_entries("count"):
            out[op.key_serializer.deserialize(entry.key_bytes)] = entry.value
    return out


def transfer(metadata: Any, prefix: str = "transfer.") -> TransferStats:
    total = TransferStats.from_properties(metadata.properties, prefix)
    for handle in metadata.handles:
        total.merge(TransferStats.from_properties(handle.properties, prefix))
    return total


def new_objects(checkpoint: Any) -> set[str]:
    """Objects a checkpoint wrote: named for it in shared/, or in its chk-N/ folder."""
    n = checkpoint.checkpoint_id
    return {f.path for f in checkpoint.metadata.files()
            if checkpoint_id_of_shared_file(f.path) == n or f.path.startswith(f"chk-{n}/")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_file_is_stored_once_and_referenced_in_place(store, tmp_path, backend):
    op = job(store, "job", backend, tmp_path, num_retained=3)
    seen: set[str] = set()
    with op:
        for round_ in range(4):
            # a few keys change per round: the rest of the state is re-referenced
            keys = KEYS if round_ == 0 else KEYS[round_ * 10:round_ * 10 + 40]
            op.process(((k, round_ + 1) for k in keys), add)
            checkpoint = op.checkpoint()
            written = new_objects(checkpoint)
            referenced = {f.path for f in checkpoint.metadata.files()}
            # every object this checkpoint references that it did not write was written (and
            # uploaded) by an earlier one: nothing is uploaded twice, nothing is copied
            assert referenced - written <= seen
            assert not written & seen
            seen |= written
            stats = transfer(checkpoint.metadata)
            assert stats.duplicated_bytes == 0
            # no flood of small objects: at most 2 objects per subtask and checkpoint here
            assert stats.uploaded_objects <= 2 * op.parallelism
            if round_:
                assert checkpoint.metadata.incremental_size < checkpoint.metadata.full_size
        # inline and merged files are tracked exactly: gc finds nothing, restores are whole
        assert find_garbage(op.storage).files == []
        assert find_garbage(store.url("job"), store.options).files == []
        expected = counts(op)
    with job(store, "job", backend, tmp_path, parallelism=3) as again:
        assert counts(again) == expected


def test_small_files_are_inlined_or_merged_and_gc_sees_exact_references(store, tmp_path):
    with job(store, "job", "rocksdb", tmp_path, num_retained=1) as op:
        for round_ in range(3):
            op.process(((k, 1) for k in KEYS[: 200 * (round_ + 1)]), add)
            checkpoint = op.checkpoint()
            streams = [s for h in checkpoint.metadata.handles for s in h.streams()]
            inline = [s for s in streams if s.data is not None]
            segments = [s for s in streams if s.segment is not None]
            # RocksDB's CURRENT, MANIFEST, OPTIONS and the meta file are small: inline
            assert len(inline) >= 4 * op.parallelism
            # merged objects live in shared/ and the registry holds them while referenced
            for s in segments:
                assert s.path.startswith("shared/") and s.path in op.coordinator.registry
            summary = show(store.url("job"), store.options, state_sizes=False)["transfer"]
            assert summary["inline_files"] == len(inline)
            assert summary["objects"] == len({f.path for f in checkpoint.metadata.files()})
            # subsumed checkpoints' objects are gone, the retained one's are all there
            assert find_garbage(op.storage).files == []
            storage = CheckpointStorage(store.url("job"), store.options)
            on_store = {p for p in storage.list_files("shared")}
            assert on_store == {f.path for f in checkpoint.metadata.files()
                                if f.path.startswith("shared/")}
        expected = counts(op)
    with job(store, "job", "rocksdb", tmp_path, parallelism=1) as again:
        assert counts(again) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_savepoint_and_no_claim_restore_are_duplicated_by_the_store(store, tmp_path, backend):
    op = job(store, "job", backend, tmp_path)
    op.process(((k, 1) for k in KEYS), add)
    op.checkpoint()
    op.process(((k, 2) for k in KEYS[:100]), add)
    source = op.checkpoint()
    expected = counts(op)
    # A native savepoint: every object duplicated by the store, no byte through this process.
    metadata_url = op.savepoint(store.url("sp"))
    op.close()
    savepoint = resolve_snapshot(metadata_url, store.options).metadata
    stats = transfer(savepoint)
    assert stats.duplicated_objects == len({f.path for f in source.metadata.files()})
    assert stats.duplicated_bytes == sum(f.size for f in {f.path: f for f in
                                                          source.metadata.files()}.values())
    assert stats.uploaded_bytes == stats.downloaded_bytes == 0
    # A NO_CLAIM restore: its first checkpoint has the store duplicate the restored files into
    # the job's root; it uploads only what changed (here: nothing but private files).
    restored = job(store, "restored", backend, tmp_path, restore_path=store.url("sp"))
    assert counts(restored) == expected
    first = restored.checkpoint()
    moved = transfer(first.metadata)
    assert moved.duplicated_bytes > 0
    # no file the savepoint holds was uploaded again: what was uploaded is new content only
    # (private files, the new diff, RocksDB's OPTIONS file rewritten when the DB opened)
    held = {(s.digest, s.length) for h in savepoint.handles for s in h.streams()}
    new_content = sum(s.length for h in first.metadata.handles for s in h.streams()
                      if (s.digest, s.length) not in held and s.data is None)
    assert moved.uploaded_bytes <= new_content
    assert moved.duplicated_bytes >= sum(s.length for h in first.metadata.handles
                                         for s in h.shared.values()
                                         if (s.digest, s.length) in held and s.data is None)
    assert first.metadata.incremental_size == first.metadata.full_size  # all of it is new
    assert not {f.path for f in first.metadata.files()} & {f.path for f in savepoint.files()}
    restore = transfer(first.metadata, RESTORE_PREFIX)
    assert restore.downloaded_bytes + restore.cache_hit_bytes > 0
    # The job owns its copies: the savepoint can go; the next checkpoint is incremental.
    sp_storage = CheckpointStorage(store.url("sp"), store.options)
    sp_storage.delete(sp_storage.list_files())
    restored.process(((k, 3) for k in KEYS[:10]), add)
    later = restored.checkpoint()
    assert transfer(later.metadata).duplicated_bytes == 0
    assert later.metadata.incremental_size < later.metadata.full_size
    expected = counts(restored)
    restored.close()
    with job(store, "restored", backend, tmp_path, parallelism=3) as again:
        assert counts(again) == expected


def test_rescale_reuses_the_files_of_the_initial_handles(store, tmp_path):
    with job(store, "job", "rocksdb", tmp_path, parallelism=2) as op:
        op.process(((k, 1) for k in KEYS), add)
        op.checkpoint()
        expected = counts(op)
    # scale in: each new subtask starts from one old handle, clipped, and ingests the other
    with job(store, "job", "rocksdb", tmp_path, parallelism=1) as rescaled:
        assert counts(rescaled) == expected
        first = rescaled.checkpoint()
        # the initial handle's files are re-referenced in place (no re-upload, no copy)
        moved = transfer(first.metadata)
        assert moved.duplicated_bytes == 0
        assert first.metadata.incremental_size < first.metadata.full_size


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_with_a_warm_file_cache_downloads_nothing(store, tmp_path, backend):
    with job(store, "job", backend, tmp_path) as op:
        op.process(((k, 1) for k in KEYS), add)
        op.checkpoint()
    # A new executor: the cache is empty, the restore downloads.
    for cache in all_process_caches():
        cache.clear()
    with job(store, "job", backend, tmp_path) as cold:
        cold_stats = transfer(cold.checkpoint().metadata, RESTORE_PREFIX)
    # The same executor again: everything comes from its cache.
    with job(store, "job", backend, tmp_path) as warm:
        warm_stats = transfer(warm.checkpoint().metadata, RESTORE_PREFIX)
    if store.kind == "local":  # no cache for a local disk: it is the local copy already
        assert cold_stats.cache_hit_bytes == warm_stats.cache_hit_bytes == 0
        return
    # (a cold restore may still hit: files of equal content, e.g. RocksDB's OPTIONS of every
    # key-group shard of every subtask, are one cache entry; with 16 instances of ~25 KB
    # OPTIONS each, those hits can outweigh this small state's downloaded SSTs)
    assert cold_stats.downloaded_bytes > 0
    assert warm_stats.downloaded_bytes == 0
    # (the files the cold restore downloaded, and those its checkpoint wrote: a heap diff, or
    # a RocksDB shard the rolling compaction rewrote into fewer bytes than the files it
    # replaced, so only what the cold restore downloaded is a lower bound)
    assert warm_stats.cache_hit_bytes >= cold_stats.downloaded_bytes
    # Other tests of this process may own caches too: the figures are summed over all of them.
    stats = [c.stats() for c in all_process_caches()]
    assert sum(s["hits"] for s in stats) > 0 and sum(s["misses"] for s in stats) > 0


@pytest.mark.s3
def test_restore_check_reads_no_state_bytes_and_bad_files_are_refused(s3_bucket, tmp_path):
    url, options = s3_bucket
    store = Store("s3", url, options)
    with job(store, "job", "rocksdb", tmp_path) as op:
        op.process(((k, 1) for k in KEYS), add)
        op.checkpoint()
        op.savepoint(store.url("sp"))
    snapshot = resolve_snapshot(store.url("sp"), options)
    snapshot.storage.transfer = TRANSFER
    verify_snapshot_files(snapshot)
    assert snapshot.storage.stats.downloaded_bytes == 0  # sizes from listings only
    # A byte in the middle of the largest state file (a segment when files are merged) whose
    # content no other file of the snapshot has: bytes that another file has too (the OPTIONS
    # files of RocksDB's key-group shards, an SST two shards wrote alike) are one cache
    # entry, which the restore may verify from the other file and then serve correctly.
    refs = [h for handle in snapshot.metadata.handles
            for h in [*handle.shared.values(), *handle.private.values()] if h.path]

    def content(h: Any) -> tuple[str, int]:
        return (h.segment.checksum, h.segment.length) if h.segment else (h.checksum, h.size)

    alike = Counter(content(h) for h in refs)
    inside = max((h for h in refs if alike[content(h)] == 1), key=lambda h: content(h)[1])
    victim = inside.path
    start, length = ((inside.segment.offset, inside.segment.length)
                     if inside.segment is not None else (0, inside.size))
    data = bytearray(snapshot.storage.read(victim))
    data[start + length // 2] ^= 0xFF  # same size: only the checksum tells
    snapshot.storage.write(victim, bytes(data))
    for cache in all_process_caches():
        cache.clear()
    # refused at the latest when downloaded, before any state is used
    with pytest.raises(CorruptCheckpointError, match=victim):
        job(store, "job2", "rocksdb", tmp_path, restore_path=store.url("sp"))
    snapshot.storage.delete([victim])
    # a missing file is refused before anything is touched
    with pytest.raises(MissingCheckpointFileError, match=victim):
        job(store, "job3", "rocksdb", tmp_path, restore_path=store.url("sp"))
    assert CheckpointStorage(store.url("job3"), options).list_files() == []
