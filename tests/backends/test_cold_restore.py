"""A restore on a worker without a copy: a cold file cache, every file from the store, behind a
latency model of 50 ms a request. Each backend fetches every file of every handle it restores
(RocksDB: every key-group shard, the ones it ingests too, and each handle's meta file; heap:
every chain) through one pool from the first request, so a rescaled restore of N files pays
about N / threads round trips, not one batch per shard or handle, and asks the store nothing
but GETs. Round trips (requests on the critical path) and the most requests in flight are
read from the latency filesystem's request log, where each request lasts at least the model's
50 ms; nothing is timed against a clock."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from keyedstate.backends.base.backend import StateBackend
from keyedstate.backends.heap import HeapStateBackend
from keyedstate.backends.rocksdb import RocksDBOptions, RocksDBStateBackend
from keyedstate.state.descriptors import ValueStateDescriptor
from keyedstate.storage.cache import all_process_caches
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle
from keyedstate.storage.transfer import TransferOptions
from keyedstate.testing.latency import (
    LatencyModel,
    RequestRecord,
    behind_latency,
    counts_of,
    peak_in_flight,
    read_request_log,
    round_trips,
)

from .contract.common import Harness

pytestmark = pytest.mark.integration

#: a request's first byte; no bandwidth limit, so every request lasts about as long
SLOW = LatencyModel("test-50ms", first_byte_ms=50.0)
#: the same store for writing the state: an object store to checkpoint storage, no waiting
FREE = LatencyModel("test-free", first_byte_ms=0.0)
VALUE = ValueStateDescriptor("v", "count bigint, note string")
OLD_PARALLELISM = 4


def _storage(tmp_path: Path, model: LatencyModel, threads: int,
             log_dir: str | None = None) -> CheckpointStorage:
    """The store behind ``model``; every file its own object (no inlining, no merging), so
    the restore has many files to fetch."""
    url, options = behind_latency(str(tmp_path / "store"), {}, model, log_dir)
    return CheckpointStorage(url, options, TransferOptions(threads=threads, inline_threshold=0,
                                                           merge_file_size=0))


def _values(backends: list[Any]) -> dict[tuple[int, bytes], Any]:
    return {(e.key_group, e.key_bytes): e.value for b in backends for e in b.iter_entries("v")}


def _cold_restore(tmp_path: Path, backend: StateBackend, threads: int
                  ) -> tuple[Any, list[KeyedStateHandle], list[RequestRecord]]:
    """Two checkpoints of a job at parallelism 4 (the second incremental), then, with every
    file cache cleared, subtask 0 of 1 restored from the second behind :data:`SLOW`; returns
    the restored backend, the handles and the restore's logged requests."""
    harness = Harness(backend, tmp_path)
    harness.storage = _storage(tmp_path, FREE, threads)
    log_dir = str(tmp_path / "requests")
    try:
        backends = harness.create_all(OLD_PARALLELISM)
        for round_, keys in ((1, range(2000)), (2, range(0, 2000, 3))):
            for key in keys:
                harness.at(backends, key).get_state(VALUE).update(
                    {"count": round_, "note": f"{key:08d}"})
            handles = harness.snapshot_all(backends)
        expected = _values(backends)
        for cache in all_process_caches():  # a worker that never saw these files
            cache.clear()
        harness.storage = _storage(tmp_path, SLOW, threads, log_dir)
        restored = harness.create(0, 1, handles=handles)
        assert _values([restored]) == expected
        return restored, handles, read_request_log(log_dir)
    finally:
        harness.close_all()


@pytest.mark.parametrize("threads", [4, 64])
@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_a_cold_restore_fetches_every_file_through_one_pool_at_once(tmp_path: Path,
                                                                   backend: str,
                                                                   threads: int) -> None:
    """Four handles into one subtask. RocksDB (two shards each, at most two instances): two
    shards opened, six ingested, each handle's meta file; before, the six to be ingested
    were downloaded one after another (a round trip or more each). Heap: four chains of two
    files; before, one chain after another (four round trips at least)."""
    state_backend: StateBackend = (
        RocksDBStateBackend(RocksDBOptions(key_group_shards=2), max_instances=2)
        if backend == "rocksdb" else HeapStateBackend())
    restored, handles, records = _cold_restore(tmp_path, state_backend, threads)
    counts = counts_of(records)
    files = counts.requests("read")
    stats = restored.restore_stats
    assert stats is not None
    # Nothing but GETs: no listing, no HEAD before the data, one GET per file (a file whose
    # content another one already brought into the cache, as RocksDB's OPTIONS of every
    # shard, is taken from there).
    assert counts.requests() == files == stats.downloaded_objects > 0
    stored = [s for h in handles for s in h.streams() if s.data is None]
    if backend == "rocksdb":  # every shard of every handle, opened or ingested
        assert restored.ingested_on_restore == 6
        assert files + stats.cache_hit_files == len(stored)
        assert files >= 8 * 2  # an SST and a MANIFEST per shard at least (CURRENT and
        # OPTIONS are often equal from shard to shard), the meta files
    else:  # every chain from the oldest of its key groups' images
        assert OLD_PARALLELISM <= files + stats.cache_hit_files <= len(stored)
    # Every GET issued as early as the pool allows: about files / threads on the critical
    # path (one more for a thread the machine's load held back), as many in flight as the
    # pool has threads.
    waves = math.ceil(files / threads)
    assert round_trips(records) <= waves + 1, (round_trips(records), files, threads)
    assert peak_in_flight(records) >= min(threads, files) // 2 + 1, peak_in_flight(records)
    phases = restored.restore_phases
    assert phases is not None and phases.download_s >= waves * SLOW.first_byte_s
    assert phases.open_s > 0
