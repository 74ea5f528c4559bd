"""The asynchronous phase on the local runtime (docs/checkpoints.md, "The asynchronous phase"):
uploads in the background, checkpoint N completed and its output committed during batch N+1,
the bound, stop and close, and a fault before and after each step, which discards what is in
flight and lets the job go on from the last completed checkpoint with nothing lost or doubled.

No timed assertions: the order of events (which batch a call completes) and the results."""

from __future__ import annotations

import datetime as dt
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from keyedstate.checkpoint.properties import BATCH_ID
from keyedstate.checkpoint.registry import SharedStateRegistry
from keyedstate.checkpoint.resolve import ResolvedSnapshot, resolve_snapshot
from keyedstate.checkpoint.stats import subtask_stats_of
from keyedstate.errors import CheckpointDiscardedError, KeyedStateError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.processor.canonical import read_range_tables
from keyedstate.processor.inspection import find_garbage
from keyedstate.runtime.live_copies import release_live
from keyedstate.runtime.local import LocalJob
from keyedstate.runtime.uploads import wait_for_job
from keyedstate.storage.layout import ACKS_DIR
from keyedstate.testing.faults import FaultPlan
from tests.runtime.test_local_job import INPUT, batches, config, new_job, rows
from tests.spark.jobs import COUNT_SCHEMA, IDLE_SCHEMA, IdleCounts

pytestmark = pytest.mark.integration

BACKENDS = ["rocksdb", "heap"]


def completed_batch(job: LocalJob) -> int | None:
    """The batch the job's latest completed checkpoint covers (None: none yet)."""
    latest = job.latest_checkpoint
    return None if latest is None else int(latest.metadata.properties[BATCH_ID])


def state_of(snapshot: ResolvedSnapshot) -> dict[str, list[dict[str, Any]]]:
    """Every state's rows and the timers of ``snapshot``, sorted."""
    everything = KeyGroupRange(0, snapshot.metadata.max_parallelism - 1)
    now = time.time_ns() // 1_000_000
    out = {}
    for name in ("count", "last", None):
        tables = list(read_range_tables(snapshot, everything, name, now_ms=now))
        found = pa.concat_tables(tables).to_pylist() if tables else []
        out[name or "timers"] = sorted(found, key=repr)
    return out


def latest_state(job: LocalJob) -> dict[str, list[dict[str, Any]]]:
    latest = job.latest_checkpoint
    assert latest is not None
    return state_of(ResolvedSnapshot(job.storage, latest.metadata_path, latest.metadata))


def synchronous_run(root: Path, data: list[pa.Table], backend: str
                    ) -> tuple[dict[str, list[tuple]], dict[str, list[dict[str, Any]]]]:
    """The synchronous mode's output over ``data`` (drained) and its state before the drain."""
    with new_job(config(root / "sync", backend=backend)) as job:
        outputs = [job.process_batch(t) for t in data]
        state = latest_state(job)
        outputs.append(job.drain())
    return rows(outputs), state


@pytest.mark.parametrize("bound", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_output_and_state_equal_the_synchronous_mode(tmp_path, backend, bound):
    data = batches(9)
    expected_rows, expected_state = synchronous_run(tmp_path, data, backend)
    cfg = config(tmp_path / "async", backend=backend, async_upload=True,
                 max_concurrent_checkpoints=bound)
    with new_job(cfg) as job:
        outputs, completed = [], []
        for table in data:
            outputs.append(job.process_batch(table))
            completed.append(completed_batch(job))
        # Each call completes the checkpoints beyond the bound: batch i's call leaves i-bound.
        assert completed == [None if i < bound else i - bound for i in range(len(data))]
        # The first calls committed nothing (their checkpoints were in flight).
        assert all(out["main"].num_rows == 0 for out in outputs[:bound])
        outputs.append(job.flush())
        assert completed_batch(job) == len(data) - 1
        assert latest_state(job) == expected_state
        outputs.append(job.drain())
        assert completed_batch(job) == len(data)  # a drain leaves nothing in flight
    assert rows(outputs) == expected_rows
    # Completed checkpoints keep no acknowledgements.
    assert not [p for p in job.storage.list_files() if f"/{ACKS_DIR}/" in p]


def run_through_failures(job: LocalJob, data: list[pa.Table]) -> tuple[list[Any], list[Any]]:
    """Every batch of ``data`` through ``job``, sending again what a failure discarded (from
    the job's batch id on, as a source replays); the outputs of the calls that returned, and
    the events: ("ok", batch) or (error class, discarded batches, the batch the job is at)."""
    outputs: list[Any] = []
    events: list[Any] = []
    i = job.last_batch_id + 1
    while i < len(data):
        try:
            outputs.append(job.process_batch(data[i]))
            events.append(("ok", i))
        except KeyedStateError as exc:
            events.append((type(exc).__name__, getattr(exc, "discarded_batches", None),
                           job.last_batch_id))
            outputs.append(job.last_outputs)  # committed by the call before it failed
        i = job.last_batch_id + 1
    outputs.append(job.flush())
    return outputs, events


def faulty_config(tmp_path: Path, backend: str, plan: FaultPlan, **changes: Any) -> Any:
    """The asynchronous mode's configuration with checkpoints behind ``plan``'s faults."""
    return config(tmp_path / "async", backend=backend, async_upload=True,
                  checkpoint_dir=plan.url(str(tmp_path / "store" / "job")),
                  storage_options=plan.storage_options("file"), transfer_attempts=1,
                  **changes)


def faulty_job(tmp_path: Path, backend: str, plan: FaultPlan) -> LocalJob:
    return new_job(faulty_config(tmp_path, backend, plan))


# Batch 3 is checkpoint 4 (ids start at 1, no aborts before it). A fault in a worker's upload
# fails batch 4's subtask that waits for it before its own snapshot (batch 4 never gets in
# flight); a fault in the driver's completion, beside batch 4's tasks, discards both (batch 4
# ran on checkpoint 4's state).
IN_THE_WORKER = [("CheckpointDiscardedError", [3], 2)]
IN_THE_DRIVER = [("CheckpointDiscardedError", [3, 4], 2)]
STEPS = {
    # After the upload, before the ack: the batch's staged output (written off the task).
    "staging": ("write", "staging/batch-3/", IN_THE_WORKER),
    # Before the upload: its first file is refused.
    "upload": ("write", "/shared/chk-4-", IN_THE_WORKER),
    # After the upload, before the ack: writing the ack is refused.
    "ack-write": ("write", f"chk-4/{ACKS_DIR}/subtask-1", IN_THE_WORKER),
    # After the ack: the driver can't read it.
    "ack-read": ("read", f"chk-4/{ACKS_DIR}/subtask-0", IN_THE_DRIVER),
    # The commit point: writing _metadata is refused.
    "metadata": ("write", "chk-4/_metadata", IN_THE_DRIVER),
    # After the checkpoint completed: the sink commit (reading the staged output) fails; the
    # checkpoint stays complete, the commit is retried first by the next call.
    "sink-commit": ("read", "staging/batch-3/", [("StorageAccessError", None, 4)]),
}


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fault_at_each_step(tmp_path, backend, step):
    """A refused call at each step of checkpoint 4 (batch 3): the call for batch 4 raises,
    the job goes on from the last completed checkpoint (the failed step discards batches 3
    and 4; a failed sink commit is retried and discards nothing), and the output and state
    equal the synchronous mode's, nothing lost or doubled."""
    data = batches(7)
    expected_rows, expected_state = synchronous_run(tmp_path, data, backend)
    op, match, expected_events = STEPS[step]
    plan = FaultPlan(tmp_path / "faults.json")
    plan.add(op, "denied", match=match)
    with faulty_job(tmp_path, backend, plan) as job:
        outputs, events = run_through_failures(job, data)
        assert plan.fired(), f"the fault on {match} never fired"
        # The failure surfaced in the call for batch 4, the batch after the failed checkpoint.
        assert events[:5] == [("ok", 0), ("ok", 1), ("ok", 2), ("ok", 3), *expected_events]
        assert [e for e in events[5:] if e[0] != "ok"] == []
        assert latest_state(job) == expected_state
        outputs.append(job.drain())
    assert rows(outputs) == expected_rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_clean_up_refused_after_the_commit_marker_is_left_to_gc(tmp_path, backend):
    """The clean-ups after a sink commit run on the loop's cleaner, off the batch's path: a
    refused delete of batch 3's staged files raises nothing, loses and doubles nothing, and
    leaves exactly those files, which gc finds; once the job is flushed every other batch's
    staged files are gone (the flush waits for the cleaner)."""
    data = batches(6)
    expected_rows, expected_state = synchronous_run(tmp_path, data, backend)
    plan = FaultPlan(tmp_path / "faults.json")
    plan.add("delete", "denied", match="staging/batch-3")
    with faulty_job(tmp_path, backend, plan) as job:
        outputs, events = run_through_failures(job, data)
        assert plan.fired(), "the staged files' delete was never refused"
        assert all(e[0] == "ok" for e in events), events
        assert latest_state(job) == expected_state
        staged = [p for p in job.storage.list_files() if p.startswith("staging/")]
        assert staged and all(p.startswith("staging/batch-3/") for p in staged)
        assert set(staged) <= set(find_garbage(job.storage).files)
        outputs.append(job.drain())
    assert rows(outputs) == expected_rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_registry_failure_discards_and_a_restart_agrees(tmp_path, backend, monkeypatch):
    """Checkpoint 4 (batch 3) fails at its registry step, after its ``_metadata`` was written
    (the registry is in memory: a bug or an exhausted process is what makes it raise): the
    call for batch 4 discards batches 3 and 4, and storage agrees, the checkpoint taken back,
    so a job restarted right then (as after a crash) is at batch 2 as well, and batches 3 on
    sent again give the synchronous mode's output and state, nothing lost or doubled."""
    data = batches(7)
    expected_rows, expected_state = synchronous_run(tmp_path, data, backend)
    register_all = SharedStateRegistry.register_all

    def failing(self: SharedStateRegistry, metadata: Any, *, owned: bool = True) -> None:
        if metadata.checkpoint_id == 4:
            raise OSError("the registry failed")
        register_all(self, metadata, owned=owned)

    monkeypatch.setattr(SharedStateRegistry, "register_all", failing)
    cfg = config(tmp_path / "async", backend=backend, async_upload=True)
    with new_job(cfg) as job:
        outputs = [job.process_batch(t) for t in data[:4]]
        with pytest.raises(CheckpointDiscardedError) as failed:
            job.process_batch(data[4])
        assert failed.value.discarded_batches == [3, 4]
        assert job.last_batch_id == 2
        outputs.append(job.last_outputs)  # what the failed call committed: nothing
        wait_for_job(job.storage.url)
        assert [p for p in job.storage.list_files() if p.startswith("chk-4/")] == [
            "chk-4/_aborted"]
        assert job.storage.list_files("staging/batch-3") == []
    monkeypatch.undo()
    with new_job(cfg) as restarted:
        assert restarted.last_batch_id == 2
        outputs += [restarted.process_batch(t) for t in data[3:]]
        outputs.append(restarted.flush())
        assert latest_state(restarted) == expected_state
        outputs.append(restarted.drain())
    assert rows(outputs) == expected_rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_upload_keeps_the_earlier_checkpoints_and_nothing_after(tmp_path, backend):
    """Checkpoint 4's upload fails: after the failure the job is at batch 2 exactly (its
    state is checkpoint 3's), checkpoint 4's directory holds only its tombstone, and batch 4's
    checkpoint (5) was aborted too."""
    data = batches(5)
    plan = FaultPlan(tmp_path / "faults.json")
    plan.add("write", "denied", match="/shared/chk-4-")
    with faulty_job(tmp_path, backend, plan) as job:
        for table in data[:4]:
            job.process_batch(table)
        with pytest.raises(CheckpointDiscardedError) as failed:
            job.process_batch(data[4])
        assert failed.value.discarded_batches == [3]
        assert failed.value.last_batch_id == job.last_batch_id == 2
        assert completed_batch(job) == 2
        assert job.latest_checkpoint is not None and job.latest_checkpoint.checkpoint_id == 3
        wait_for_job(job.storage.url)
        leftovers = [p for p in job.storage.list_files() if p.startswith(("chk-4/", "chk-5/"))]
        assert sorted(leftovers) == ["chk-4/_aborted", "chk-5/_aborted"]
        assert job.storage.list_files("staging/batch-3") == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_waits_for_the_checkpoint_in_flight(tmp_path, backend):
    data = batches(4)
    cfg = config(tmp_path / "async", backend=backend, async_upload=True)
    job = new_job(cfg)
    for table in data[:3]:
        job.process_batch(table)
    assert completed_batch(job) == 1  # batch 2 is in flight
    savepoint = job.stop(savepoint=str(tmp_path / "savepoint"))
    assert savepoint is not None
    assert completed_batch(job) == 2
    assert resolve_snapshot(savepoint).metadata.properties[BATCH_ID] == "2"
    # Batch 2's output was committed by the stop.
    assert {r["batch_id"] for r in job.last_outputs["main"].to_pylist()} == {2}
    with new_job(cfg) as restarted:
        assert restarted.last_batch_id == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_leaves_the_checkpoint_in_flight_incomplete(tmp_path, backend):
    """close() without stop is a crash's outcome: batch 2 in flight never completes; the
    restarted job is at batch 1, and batch 2 sent again gives the synchronous output."""
    data = batches(4)
    expected_rows, _ = synchronous_run(tmp_path, data, backend)
    cfg = config(tmp_path / "async", backend=backend, async_upload=True)
    with new_job(cfg) as job:
        outputs = [job.process_batch(t) for t in data[:3]]
    with new_job(cfg) as restarted:
        assert restarted.last_batch_id == 1
        outputs += [restarted.process_batch(t) for t in data[2:]]
        outputs.append(restarted.drain())
    assert rows(outputs) == expected_rows


def reused_or_restored(job: LocalJob) -> dict[int, list[tuple[bool, bool]]]:
    """Per batch of the retained checkpoints, each subtask's (reused its copy, restored)."""
    return {int(c.metadata.properties[BATCH_ID]): [(s.reused, s.restored)
                                                   for s in subtask_stats_of(c.metadata) or []]
            for c in job.coordinator.retained}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_subtask_without_its_live_copy_restores_from_the_acknowledgement(tmp_path, backend):
    """Batch 2 runs while checkpoint 2 (batch 1) is in flight and no live copy is left (a
    worker that does not hold it): each subtask restores from its acknowledgement of
    checkpoint 2, never from checkpoint 1; the output equals the synchronous mode's."""
    data = batches(4)
    expected_rows, expected_state = synchronous_run(tmp_path, data, backend)
    cfg = config(tmp_path / "async", backend=backend, async_upload=True, num_retained=10)
    with new_job(cfg) as job:
        outputs = [job.process_batch(t) for t in data[:2]]
        assert completed_batch(job) == 0
        wait_for_job(job.storage.url)
        release_live(job.storage.url, job.start_id)
        outputs += [job.process_batch(t) for t in data[2:]]
        outputs.append(job.flush())
        assert latest_state(job) == expected_state
        how = reused_or_restored(job)
        outputs.append(job.drain())
    assert rows(outputs) == expected_rows
    assert how[2] == [(False, True), (False, True)]  # restored, from checkpoint 2's acks
    assert how[3] == [(True, False), (True, False)]  # reused again


class BesideJob(LocalJob):
    """A local job that looks, when a batch's subtasks are about to run, at what the
    completion beside them did (it waits for it first): the batch the latest completed
    checkpoint covers and the batches whose output was delivered. On batch ``release_at`` it
    then closes the live copies, so that the subtasks restore."""

    release_at: int | None = None

    def _execute(self, plan: Any, batch: Any) -> list[Any]:
        assert self._beside is not None and self._beside is not threading.current_thread()
        self._beside.join()
        delivered = self._delivered.get("main")
        self.seen.append((plan.batch_id, completed_batch(self), sorted(
            {r["batch_id"] for r in delivered.to_pylist()} if delivered is not None else [])))
        if plan.batch_id == self.release_at:
            wait_for_job(self.storage.url)
            release_live(self.storage.url, self.start_id)
        return super()._execute(plan, batch)


def beside_job(cfg: Any) -> BesideJob:
    job = BesideJob(IdleCounts(), key_columns=["user_id"], input_schema=INPUT,
                    output_schema=COUNT_SCHEMA, side_outputs={"idle": IDLE_SCHEMA}, config=cfg)
    job.seen = []
    return job


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_checkpoint_in_flight_completes_beside_the_next_batchs_tasks(tmp_path, backend):
    """Checkpoint N (batch N-1) completes, and its output is committed, on a thread of its
    own while batch N's subtasks run (as Flink's JobManager completes a checkpoint while the
    tasks go on), not after them: when batch N's subtasks start, that thread may already have
    done it all. The output equals the synchronous mode's."""
    data = batches(4)
    expected_rows, _ = synchronous_run(tmp_path, data, backend)
    with beside_job(config(tmp_path / "async", backend=backend, async_upload=True)) as job:
        outputs = [job.process_batch(t) for t in data]
        outputs.append(job.drain())
        # The drain is batch 4.
        assert job.seen == [(0, None, []), (1, 0, [0]), (2, 1, [1]), (3, 2, [2]), (4, 3, [3])]
    assert rows(outputs) == expected_rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_subtask_restores_from_a_checkpoint_completed_beside_it(tmp_path, backend):
    """Batch 2's subtasks have no live copy and restore from checkpoint 3 (batch 1), which
    was in flight when the batch was planned and completes beside them, before they read
    its acknowledgements: these are kept until the next batch, so the subtasks restore from
    them (never from an older state); the next batch's completion deletes them."""
    data = batches(4)
    expected_rows, expected_state = synchronous_run(tmp_path, data, backend)
    cfg = config(tmp_path / "async", backend=backend, async_upload=True, num_retained=10)
    with beside_job(cfg) as job:
        job.release_at = 2
        outputs = [job.process_batch(t) for t in data]
        outputs.append(job.flush())
        assert job.seen[2] == (2, 1, [1])  # checkpoint 2 was complete when they restored
        assert latest_state(job) == expected_state
        how = reused_or_restored(job)
        outputs.append(job.drain())
    assert rows(outputs) == expected_rows
    assert how[2] == [(False, True), (False, True)]
    assert how[3] == [(True, False), (True, False)]
    assert not [p for p in job.storage.list_files() if f"/{ACKS_DIR}/" in p]


class FailInBatch(IdleCounts):
    """:class:`IdleCounts` that raises in batch ``fail_batch`` (None: never)."""

    def __init__(self, fail_batch: int | None) -> None:
        self.fail_batch = fail_batch

    def process_key(self, key: Any, rows: pa.Table, ctx: Any) -> list[dict[str, Any]]:
        if ctx.batch_id == self.fail_batch:
            raise ValueError(f"cannot handle batch {ctx.batch_id}")
        return super().process_key(key, rows, ctx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_batch_completes_the_checkpoint_in_flight(tmp_path, backend):
    """Batch 3's function raises while checkpoint 3 (batch 2) is in flight: the call raises
    the batch's failure, checkpoint 3 completes meanwhile (the job is at batch 2, as in the
    synchronous mode), and batch 3 sent again gives the synchronous output."""
    data = batches(5)
    expected_rows, _ = synchronous_run(tmp_path, data, backend)
    function = FailInBatch(3)
    cfg = config(tmp_path / "async", backend=backend, async_upload=True)
    with new_job(cfg, function) as job:
        outputs = [job.process_batch(t) for t in data[:3]]
        assert completed_batch(job) == 1
        with pytest.raises(KeyedStateError, match="cannot handle batch 3"):
            job.process_batch(data[3])
        assert completed_batch(job) == job.last_batch_id == 2
        outputs.append(job.last_outputs)  # batch 2's, committed by the failed call
        assert {r["batch_id"] for r in job.last_outputs["main"].to_pylist()} == {2}
        function.fail_batch = None
        outputs += [job.process_batch(t) for t in data[3:]]
        outputs.append(job.drain())
    assert rows(outputs) == expected_rows


class RecordingJob(LocalJob):
    """A local job whose loop records its checkpoints in flight in storage, as the driver's
    copy in a Spark Connect server does (it may end without completing them)."""

    def _records_in_flight(self) -> bool:
        return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_left_in_flight_are_completed_by_the_jobs_other_copy(tmp_path, backend):
    """Spark Connect's take-over, on the local runtime: a copy of the started job (pickled,
    as ``start()`` ships the driver to the Connect server) runs the batches and ends with two
    checkpoints in flight; the original, whose coordinator is as the start left it, completes
    them from their records and commits their output, once. Output and state equal the
    synchronous mode's."""
    data = batches(6)
    with new_job(config(tmp_path / "sync", backend=backend)) as job:
        expected = rows([job.process_batch(t) for t in data])
        expected_state = latest_state(job)
    cfg = config(tmp_path / "async", backend=backend, async_upload=True,
                 max_concurrent_checkpoints=2)
    with RecordingJob(IdleCounts(), key_columns=["user_id"], input_schema=INPUT,
                      output_schema=COUNT_SCHEMA, side_outputs={"idle": IDLE_SCHEMA},
                      config=cfg) as client:
        server = pickle.loads(pickle.dumps(client))
        outputs = [server.process_batch(t) for t in data]
        assert completed_batch(server) == 3  # batches 4 and 5 in flight
        records = [p for p in client.storage.list_files() if p.endswith(f"/{ACKS_DIR}/flight")]
        assert len(records) == 2
        assert client.latest_checkpoint is None
        done = client._take_over_in_flight(None)
        outputs.append(client._deliver())
        assert [s.batch_id for s in done] == [4, 5]
        assert rows(outputs) == expected
        assert latest_state(client) == expected_state
        assert (completed_batch(client), client.last_batch_id) == (5, 5)
        assert not [p for p in client.storage.list_files() if f"/{ACKS_DIR}/" in p]
        assert client._take_over_in_flight(None) == []  # nothing is left in flight


class ListenerFails(LocalJob):
    """A local job whose step 7 (:meth:`~keyedstate.runtime.async_loop.AsyncBatchLoop._completed`, where
    the Spark driver calls the user's batch listeners) raises once, on batch
    ``listener_fails_on``'s statistics."""

    listener_fails_on: int | None = None

    def _completed(self, stats: Any) -> None:
        super()._completed(stats)
        if stats.batch_id == self.listener_fails_on:
            self.listener_fails_on = None
            raise RuntimeError(f"the listener failed on batch {stats.batch_id}")


def listener_job(tmp_path: Path, backend: str, plan: FaultPlan, fails_on: int,
                 **changes: Any) -> ListenerFails:
    cfg = faulty_config(tmp_path, backend, plan, **changes)
    job = ListenerFails(IdleCounts(), key_columns=["user_id"], input_schema=INPUT,
                        output_schema=COUNT_SCHEMA, side_outputs={"idle": IDLE_SCHEMA},
                        config=cfg)
    job.listener_fails_on = fails_on
    return job


def notes(exc: BaseException) -> str:
    return " ".join(getattr(exc, "__notes__", []))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_listener_raising_beside_a_failed_batch_leaves_nothing_in_flight(tmp_path, backend):
    """Two checkpoints in flight; batch 3 fails (its subtasks wait for checkpoint 3's upload,
    refused) in the call that completed checkpoint 2 beside it, whose listener raises. The
    listener's error waits until checkpoint 3 is discarded: the call raises
    :class:`CheckpointDiscardedError` naming the listener's error, nothing is left in flight
    half done, and the job goes on from batch 1 with the synchronous mode's output."""
    data = batches(6)
    expected_rows, expected_state = synchronous_run(tmp_path, data, backend)
    plan = FaultPlan(tmp_path / "faults.json")
    plan.add("write", "denied", match="/shared/chk-3-")
    with listener_job(tmp_path, backend, plan, 1, max_concurrent_checkpoints=2) as job:
        outputs = [job.process_batch(t) for t in data[:3]]
        with pytest.raises(CheckpointDiscardedError) as failed:
            job.process_batch(data[3])
        assert plan.fired()
        assert failed.value.discarded_batches == [2]
        assert "the listener failed on batch 1" in notes(failed.value)
        assert job.last_batch_id == completed_batch(job) == 1
        outputs.append(job.last_outputs)  # batch 1's, committed by the failed call
        wait_for_job(job.storage.url)
        leftovers = [p for p in job.storage.list_files() if p.startswith(("chk-3/", "chk-4/"))]
        assert sorted(leftovers) == ["chk-3/_aborted", "chk-4/_aborted"]
        outputs += [job.process_batch(t) for t in data[2:]]
        outputs.append(job.flush())
        assert latest_state(job) == expected_state
        outputs.append(job.drain())
    assert rows(outputs) == expected_rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_listener_raising_beside_a_failed_completion_lets_it_discard(tmp_path, backend):
    """Batch 3's sink commit fails once (the call for batch 4 raises it); the call for batch
    5 commits it, whose listener raises, then fails to complete checkpoint 5 (its
    ``_metadata`` refused) beside batch 5's tasks. The discard comes first: the call raises
    :class:`CheckpointDiscardedError` for batches 4 and 5 naming the listener's error, and
    batches 4 on sent again give the synchronous mode's output and state."""
    data = batches(7)
    expected_rows, expected_state = synchronous_run(tmp_path, data, backend)
    plan = FaultPlan(tmp_path / "faults.json")
    plan.add("read", "denied", match="staging/batch-3/")
    plan.add("write", "denied", match="chk-5/_metadata")
    with listener_job(tmp_path, backend, plan, 3) as job:
        outputs = [job.process_batch(t) for t in data[:4]]
        with pytest.raises(KeyedStateError):
            job.process_batch(data[4])  # batch 3's sink commit failed; batch 4 is in flight
        outputs.append(job.last_outputs)
        with pytest.raises(CheckpointDiscardedError) as failed:
            job.process_batch(data[5])
        assert len(plan.fired()) == 2
        assert failed.value.discarded_batches == [4, 5]
        assert "the listener failed on batch 3" in notes(failed.value)
        assert job.last_batch_id == completed_batch(job) == 3
        outputs.append(job.last_outputs)  # batch 3's, committed by the failed call
        outputs += [job.process_batch(t) for t in data[4:]]
        outputs.append(job.flush())
        assert latest_state(job) == expected_state
        outputs.append(job.drain())
    assert rows(outputs) == expected_rows


def chain_text(exc: BaseException | None) -> str:
    """The messages of ``exc`` and of every exception it was raised from or during."""
    texts, seen, todo = [], set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        texts.append(str(e))
        todo += [e.__cause__, e.__context__]
    return " | ".join(texts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_subtasks_restoring_from_a_checkpoint_aborted_beside_them_fail_at_once(tmp_path,
                                                                                backend):
    """Checkpoint 3 (batch 2) fails at its commit point (``_metadata`` refused) beside batch
    3's tasks, whose subtasks restore from its acknowledgements (their live copies closed):
    its abort deletes them and leaves its tombstone, and the subtasks, finding it, fail the
    batch at once, not after the checkpoint timeout with "did not acknowledge". The call
    raises :class:`CheckpointDiscardedError` for batch 2; batches 2 on sent again give the
    synchronous mode's output and state."""
    data = batches(6)
    expected_rows, expected_state = synchronous_run(tmp_path, data, backend)
    plan = FaultPlan(tmp_path / "faults.json")
    plan.add("write", "denied", match="chk-3/_metadata")
    cfg = faulty_config(tmp_path, backend, plan, checkpoint_timeout=dt.timedelta(seconds=5))
    with beside_job(cfg) as job:
        job.release_at = 3
        outputs = [job.process_batch(t) for t in data[:3]]
        with pytest.raises(CheckpointDiscardedError) as failed:
            job.process_batch(data[3])
        assert plan.fired()
        assert failed.value.discarded_batches == [2]
        assert "checkpoint 3 was aborted while subtasks" in chain_text(failed.value)
        assert job.last_batch_id == completed_batch(job) == 1
        outputs.append(job.last_outputs)
        job.release_at = None
        outputs += [job.process_batch(t) for t in data[2:]]
        outputs.append(job.flush())
        assert latest_state(job) == expected_state
        outputs.append(job.drain())
    assert rows(outputs) == expected_rows
