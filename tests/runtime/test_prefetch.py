"""In the asynchronous mode a worker prefetches into its file cache the files of the checkpoint
in flight that its stale copies lack (``runtime.prefetch``), so that a moved subtask's restore
on the task's path takes them from the cache instead of the store. Driven as
``tests/runtime/test_background_catch_up.py`` drives a stale copy: the local runtime, a copy
moved out of ``LIVE`` and back standing for another worker, and the process's file cache
emptied standing for that worker's (the local runtime's one process already cached what the
other subtask uploaded). The store is ``ksfault://`` with no fault planned: not a local disk,
so the file cache is on, as on an object store."""

from __future__ import annotations

from typing import Any

import pytest

import keyedstate.runtime.live_copies as live_copies
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.stats import subtask_stats_of
from keyedstate.config import JobConfig
from keyedstate.runtime.prefetch import prefetch_in_background, wait_for_prefetch
from keyedstate.runtime.uploads import read_ack
from keyedstate.storage.cache import FileCache, cache_key
from keyedstate.storage.handles import StreamHandle
from keyedstate.testing.faults import FaultPlan
from tests.runtime.test_background_catch_up import _in_flight, stale_beside_a_flight
from tests.runtime.test_local_job import batches, config, new_job, reference, rows

pytestmark = pytest.mark.integration


def _cached(cache: FileCache, streams: list[StreamHandle]) -> list[bool]:
    return [cache_key(s.digest, s.length) in cache for s in streams]


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetched", "not-prefetched"])
def test_a_moved_subtask_restores_from_the_prefetched_files(tmp_path: Any, backend: str,
                                                            prefetch: bool) -> None:
    """Subtask 0's stale copy (at checkpoint 1) is handed back while checkpoint 2 is in flight,
    the cache emptied. Prefetched: the cache then holds every stored file of subtask 0's ack,
    the copy is untouched, and the next batch's restore (RocksDB) or catch-up (heap) of
    subtask 0 misses nothing in the cache. Not prefetched (the control): it misses."""
    data = batches(3)
    faults = FaultPlan(tmp_path / "faults.json")
    cfg = config(tmp_path, backend=backend, async_upload=True,
                 checkpoint_dir=faults.url(str(tmp_path / "store" / "job")),
                 storage_options=faults.storage_options("file"))
    with new_job(cfg) as job:
        outputs, stale, checkpoint_id = stale_beside_a_flight(job, data)
        cache = job.storage.cache
        assert cache is not None
        cache.clear()
        ack = read_ack(job.storage, checkpoint_id, 0)
        assert ack is not None and ack.handle is not None
        streams = [s for s in ack.handle.streams() if s.data is None]
        assert streams
        if prefetch:
            prefetch_in_background(job.storage.url, job.start_id, job.storage, checkpoint_id, 2)
            wait_for_prefetch(60)
            assert all(_cached(cache, streams))
            assert live_copies.LIVE[(job.storage.url, 0)] is stale  # no copy touched
        else:
            assert not any(_cached(cache, streams))
        misses = cache.stats()["miss_bytes"]
        outputs.append(job.process_batch(data[2]))
        missed = cache.stats()["miss_bytes"] - misses
        outputs.append(job.flush())
        stats = subtask_stats_of(resolve_snapshot(job.storage.url, cfg.storage_options).metadata)
        outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data, backend)
    assert stats is not None and stats[0].restored and not stats[0].reused  # on its path
    assert (missed == 0) if prefetch else (missed > 0), missed


def test_a_prefetch_with_nothing_stale_starts_no_thread(tmp_path: Any) -> None:
    """A worker whose copies are all at the checkpoint (or that holds none of the job) has
    nothing to fetch, and a local disk has no cache to fill: no thread."""
    import keyedstate.runtime.prefetch as prefetch

    with new_job(config(tmp_path, backend="rocksdb", async_upload=True)) as job:
        for batch in batches(2):
            job.process_batch(batch)
        checkpoint_id = _in_flight(job)
        prefetch_in_background(job.storage.url, job.start_id, job.storage, checkpoint_id, 2)
        assert prefetch._current is None  # a local disk: the storage has no file cache
        prefetch_in_background("another-job", job.start_id, job.storage, checkpoint_id, 2)
        assert prefetch._current is None


def test_the_setting_defaults_to_on_where_copies_are_not_caught_up(tmp_path: Any) -> None:
    def cfg(**settings: object) -> JobConfig:
        return JobConfig.from_mapping({"execution.checkpointing.dir": str(tmp_path),
                                       **{f"keyedstate.{k}": v for k, v in settings.items()}})

    asynchronous = {"checkpointing.async-upload": True}
    assert cfg().background_prefetch is None and not cfg().prefetches_in_background
    assert cfg(**asynchronous).prefetches_in_background
    assert not cfg(**asynchronous, **{"live-copies.background-catch-up": True}
                   ).prefetches_in_background
    assert cfg(**asynchronous, **{"live-copies.background-catch-up": True,
                                  "live-copies.background-prefetch": True}
               ).prefetches_in_background
    assert not cfg(**asynchronous, **{"live-copies.background-prefetch": False}
                   ).prefetches_in_background
    # the synchronous mode has no acknowledgements to wait for
    assert not cfg(**{"live-copies.background-prefetch": True}).prefetches_in_background
