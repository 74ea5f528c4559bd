"""The driver's requests per batch, counted through the latency-shaping filesystem
(:mod:`keyedstate.testing.latency`; docs/benchmarks.md, "Checkpoints at an object store's
latency"): on an object store each is a round trip the batch waits for, so a request added
to a batch's protocol is a regression even where nothing fails. Counts, never times.

The subtasks' requests (their synchronous phase and, in the asynchronous mode, their uploads)
are counted apart: what is left of a ``process_batch`` call is the driver's (triggering,
completing, subsuming, committing the output)."""

from __future__ import annotations

import json
import time
from typing import Any

import pyarrow as pa
import pytest

from keyedstate.checkpoint.cleanup import Cleaner
from keyedstate.checkpoint.properties import STAGED
from keyedstate.config import JobConfig
from keyedstate.runtime.local import LocalJob
from keyedstate.runtime.subtask import BatchPlan
from keyedstate.runtime.uploads import wait_for_checkpoint
from keyedstate.testing.latency import RequestCounts, behind_latency, parse_latency, process_counts
from tests.runtime.test_local_job import INPUT, batches
from tests.spark.jobs import COUNT_SCHEMA, IDLE_SCHEMA, IdleCounts

pytestmark = pytest.mark.integration

#: The driver's requests of a batch in steady state (a checkpoint to subsume, a marker to
#: drop), by (kind, area), both modes: ``_metadata`` written, the subsumed checkpoint's
#: ``_metadata`` deleted, then its folder (a listing and one bulk delete), the files written
#: for the new checkpoint listed; the commit marker written, the staged folder and the stale
#: marker each listed and deleted. No HEAD: the marker of a checkpoint this driver just
#: completed can't exist yet. The staged files' reads (one each) are checked apart, the shared
#: files released (at most one bulk delete) too.
STEADY = {
    ("write", "metadata"): 1, ("delete", "metadata"): 1,
    ("list", "checkpoint"): 1, ("delete", "checkpoint"): 1,
    ("list", "shared"): 1,
    ("write", "commits"): 1, ("list", "commits"): 1, ("delete", "commits"): 1,
    ("list", "staging"): 1, ("delete", "staging"): 1,
}
#: On an object store the subsumed folder's listing runs beside its ``_metadata``'s delete
#: and what it found besides is deleted after (nothing, here): no folder delete.
#: The asynchronous mode adds, per subtask, its acknowledgement's read (one GET each, no HEAD
#: first) and one bulk delete of them all (no listing).
ASYNC_EXTRA = {("read", "checkpoint"): 2, ("delete", "checkpoint"): 1}


class CountingJob(LocalJob):
    """A local job counting its subtasks' requests apart (:attr:`subtasks`)."""

    subtasks: RequestCounts = RequestCounts()

    def _execute(self, plan: BatchPlan, batch: Any) -> list[Any]:
        if self._beside is not None:
            # The asynchronous mode completes checkpoints beside the subtasks: let it end
            # first, so that the counts of this process tell the two apart.
            self._beside.join()
        # And the clean-ups it handed off the batch's path (the asynchronous mode's cleaner):
        # they are the driver's requests of the batch before.
        self._wait_for_cleanups()
        before = process_counts()
        try:
            return super()._execute(plan, batch)
        finally:
            # Their uploads too (in the background in the asynchronous mode).
            wait_for_checkpoint(self.storage.url, plan.checkpoint_id)
            self.subtasks = self.subtasks + (process_counts() - before)


def driver_counts(job: CountingJob, table: pa.Table) -> RequestCounts:
    """The driver's requests of ``job.process_batch(table)``."""
    before, subtasks = process_counts(), job.subtasks
    job.process_batch(table)
    job._wait_for_cleanups()  # off the batch's path in the asynchronous mode, still its
    return process_counts() - before - (job.subtasks - subtasks)


def staged_files(job: LocalJob) -> int:
    latest = job.latest_checkpoint
    assert latest is not None
    return sum(len(paths) for paths in
               json.loads(latest.metadata.properties.get(STAGED, "{}")).values())


@pytest.mark.parametrize("async_upload", [False, True], ids=["sync", "async"])
def test_driver_requests_per_batch(store, async_upload):
    check_driver_requests(store, async_upload)


def test_driver_requests_per_batch_with_a_late_cleaner(store, monkeypatch):
    """The asynchronous mode's clean-ups start late, as on a loaded machine, after the next
    completion has begun: the counts stay the same. The acknowledgements kept for a batch
    are deleted before the completion that subsumes their checkpoint, never beside or after
    it (each would find files gone: a failed bulk delete, then one per file)."""
    run = Cleaner._run

    def late(self: Cleaner) -> None:
        time.sleep(0.3)
        run(self)

    monkeypatch.setattr(Cleaner, "_run", late)
    check_driver_requests(store, async_upload=True)


def check_driver_requests(store: Any, async_upload: bool) -> None:
    """Six batches of a RocksDB job at p=2; the last three's driver requests are
    :data:`STEADY` (and :data:`ASYNC_EXTRA`)."""
    url, options = behind_latency(store.url("ckpt"), store.options,
                                  parse_latency("first_byte_ms=0"))
    cfg = JobConfig(checkpoint_dir=url, storage_options=options, parallelism=2,
                    backend="rocksdb", watermark_column="ts", watermark_delay=1000,
                    late_events="side-output", async_upload=async_upload)
    expected = dict(STEADY)
    if store.kind == "s3":
        # No folders: the subsumed chk-<M>/ was listed beside its _metadata's delete and
        # held nothing else (no recursive delete).
        del expected[("delete", "checkpoint")]
    if async_upload:
        for cell, n in ASYNC_EXTRA.items():
            expected[cell] = expected.get(cell, 0) + n
    with CountingJob(IdleCounts(), key_columns=["user_id"], input_schema=INPUT,
                     output_schema=COUNT_SCHEMA, side_outputs={"idle": IDLE_SCHEMA},
                     config=cfg) as job:
        data = batches(6)
        for table in data[:3]:  # the first batches have nothing to subsume or drop yet
            job.process_batch(table)
        for table in data[3:]:
            counts = driver_counts(job, table)
            found = {(k, a): c.requests for (k, a), c in counts.cells.items()
                     if c.requests and k != "mkdir"}
            assert found.pop(("read", "staging"), 0) == staged_files(job)
            assert found.pop(("delete", "shared"), 0) <= 1
            assert found == expected
        job.flush()
        # Nothing of a subsumed checkpoint is left (on S3: its files deleted after the listing).
        latest = job.latest_checkpoint
        assert latest is not None
        assert job.storage.checkpoint_dir_ids() == [latest.checkpoint_id]
