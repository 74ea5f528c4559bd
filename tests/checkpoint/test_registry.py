"""The shared-state registry: its rules in isolation, then a Hypothesis state machine over the
real coordinator and real files (trigger, acknowledge, complete, abort, crash and recover)."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from keyedstate.checkpoint.coordinator import (
    CheckpointCoordinator,
    CompletedCheckpoint,
    PendingCheckpoint,
)
from keyedstate.checkpoint.registry import SharedStateRegistry
from keyedstate.errors import CheckpointAbortedError, CheckpointError, CorruptCheckpointError
from keyedstate.processor.inspection import find_garbage
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata, KeyedStateHandle, StreamHandle
from keyedstate.storage.layout import ABORTED_MARKER_FILE, checkpoint_id_of_shared_file
from tests.property_budget import budget

from . import make_handle


def stream(name: str, size: int = 1) -> StreamHandle:
    return StreamHandle(f"shared/{name}", size, f"{size:016x}")


def metadata(checkpoint_id: int, *names: str) -> CheckpointMetadata:
    handle = KeyedStateHandle("heap", 0, 0, 127, checkpoint_id, [],
                              {n: stream(n) for n in names}, {}, 0, 0)
    return CheckpointMetadata(checkpoint_id, 0, "heap", 1, 128, [], [handle])


# -- the rules ---------------------------------------------------------------------------------

def test_a_file_lives_until_its_last_user_is_subsumed() -> None:
    registry = SharedStateRegistry()
    registry.register_all(metadata(1, "a", "b"))
    registry.register_all(metadata(2, "b", "c"))
    registry.register_all(metadata(3, "c"))
    assert registry.get("shared/b") is not None
    assert registry.get("shared/b").last_used_checkpoint_id == 2  # type: ignore[union-attr]
    assert registry.get("shared/b").created_by_checkpoint_id == 1  # type: ignore[union-attr]
    assert registry.unregister_unused_state(2) == [stream("a")]
    assert registry.unregister_unused_state(3) == [stream("b")]
    assert sorted(registry) == ["shared/c"]
    assert registry.unregister_unused_state(3) == []


def test_not_owned_files_are_released_but_never_returned() -> None:
    registry = SharedStateRegistry()
    registry.register_all_after_restored(metadata(5, "user"), claim=False)
    registry.register_all(metadata(6, "user", "mine"))  # stays not owned
    entry = registry.get("shared/user")
    assert entry is not None and not entry.owned
    assert registry.unregister_unused_state(7) == [stream("mine")]
    assert "shared/user" not in registry and len(registry) == 0


def test_claimed_files_are_owned() -> None:
    registry = SharedStateRegistry()
    registry.register_all_after_restored(metadata(5, "x"), claim=True)
    assert registry.unregister_unused_state(6) == [stream("x")]


def test_a_shared_file_never_changes() -> None:
    registry = SharedStateRegistry()
    registry.register_reference(stream("a", 1), 1)
    with pytest.raises(CorruptCheckpointError, match="shared/a"):
        registry.register_reference(stream("a", 2), 2)


# -- the state machine -------------------------------------------------------------------------

class CheckpointMachine(RuleBasedStateMachine):
    """Simulated subtasks snapshot the way an incremental backend does: at trigger time each
    takes the last *completed* checkpoint as its base; when it acknowledges, it writes new
    shared files through ``pending.location(i)`` and re-references random files of that base.
    The model: the completed checkpoints, in order; the coordinator must retain the last
    ``num_retained`` of them and keep every file they reference, and nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="keyedstate-registry-")
        self.coordinator: CheckpointCoordinator | None = None
        self.completed: list[CompletedCheckpoint] = []
        self.bases: dict[int, CompletedCheckpoint | None] = {}
        self.dead: list[PendingCheckpoint] = []

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # num-retained 1 is the default and the one where the race of incremental checkpoints
    # deletes files.
    @initialize(num_retained=st.sampled_from([1, 1, 2, 3]), parallelism=st.integers(1, 3))
    def start(self, num_retained: int, parallelism: int) -> None:
        self.storage = CheckpointStorage(self.root)
        self.args: dict[str, Any] = dict(backend="heap", parallelism=parallelism,
                                         max_parallelism=8, key_types=["bigint"],
                                         num_retained=num_retained)
        self.coordinator = CheckpointCoordinator(self.storage, **self.args)

    @property
    def coord(self) -> CheckpointCoordinator:
        assert self.coordinator is not None
        return self.coordinator

    # -- helpers ---------------------------------------------------------------------------

    def live_shared(self) -> set[str]:
        """Shared files the model's retained checkpoints reference."""
        kept = self.completed[-self.args["num_retained"]:]
        return {f.path for c in kept for h in c.handles for f in h.shared.values()}

    def acknowledge(self, pending: PendingCheckpoint, index: int, data: st.DataObject) -> None:
        base = self.bases[pending.checkpoint_id]
        base_files = sorted({f for h in base.handles for f in h.shared.values()},
                            key=lambda f: f.path) if base else []
        # An incremental backend re-references its whole base, or after a compaction only
        # what the compaction left alone.
        if not base_files:
            reuse = []
        elif len(base_files) <= 4 and data.draw(st.booleans()):
            reuse = base_files
        else:
            reuse = data.draw(st.lists(st.sampled_from(base_files), unique=True, max_size=4))
        location = pending.location(index)
        shared = {f.path: f for f in reuse}
        for n in range(data.draw(st.integers(0, 2))):
            handle = location.write_shared(f"{pending.checkpoint_id}-{index}-{n}".encode(),
                                           f"{n}.sst")
            shared[handle.path] = handle
        private = {"meta": location.write_private(b"m", "meta")} \
            if data.draw(st.booleans()) else {}
        self.coord.acknowledge(pending, make_handle(self.coord, pending, index, shared, private))

    def acknowledge_all(self, pending: PendingCheckpoint, data: st.DataObject) -> bool:
        """Acknowledge the rest; True if Step 2 of complete() should accept the checkpoint."""
        for index in range(self.coord.parallelism):
            if index not in pending.acknowledged:
                self.acknowledge(pending, index, data)
        n = pending.checkpoint_id
        reused = {f.path for h in pending.acknowledged.values() for f in h.shared.values()
                  if checkpoint_id_of_shared_file(f.path) != n}
        return reused <= self.live_shared()

    def retire(self, pending: PendingCheckpoint) -> None:
        self.dead.append(pending)
        self.bases.pop(pending.checkpoint_id, None)

    def sync_aborted(self) -> None:
        for checkpoint_id in list(self.bases):
            if checkpoint_id not in {p.checkpoint_id for p in self.coord.pending}:
                self.bases.pop(checkpoint_id)

    # -- rules -----------------------------------------------------------------------------

    def trigger_one(self) -> PendingCheckpoint:
        pending = self.coord.trigger({"batch_id": str(len(self.completed))})
        self.bases[pending.checkpoint_id] = self.coord.latest_completed
        return pending

    @precondition(lambda self: self.coordinator is not None and len(self.coord.pending) < 3)
    @rule(concurrent=st.integers(1, 2))
    def trigger(self, concurrent: int) -> None:
        for _ in range(concurrent):
            self.trigger_one()

    @precondition(lambda self: self.coordinator is not None and any(
        not p.is_fully_acknowledged for p in self.coord.pending))
    @rule(data=st.data())
    def acknowledge_one(self, data: st.DataObject) -> None:
        pending = data.draw(st.sampled_from(
            [p for p in self.coord.pending if not p.is_fully_acknowledged]))
        index = data.draw(st.sampled_from(
            [i for i in range(self.coord.parallelism) if i not in pending.acknowledged]))
        self.acknowledge(pending, index, data)

    @precondition(lambda self: self.coordinator is not None)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        self.complete_one(data.draw(st.sampled_from(self.coord.pending or [self.trigger_one()])),
                          data)

    @precondition(lambda self: self.coordinator is not None)
    @rule(data=st.data())
    def concurrent_checkpoints(self, data: st.DataObject) -> None:
        """The race of incremental checkpoints: two checkpoints start on one base; the first to
        complete may subsume it, deleting files the second still references."""
        first, second = self.trigger_one(), self.trigger_one()
        self.complete_one(first, data)
        self.complete_one(second, data)

    def complete_one(self, pending: PendingCheckpoint, data: st.DataObject) -> None:
        if self.acknowledge_all(pending, data):
            self.completed.append(self.coord.complete(pending))
            event(f"completed, {len(self.coord.retained)} retained")
        else:
            event("refused: built on a deleted or unconfirmed base")
            with pytest.raises(CheckpointAbortedError, match="no retained checkpoint registers"):
                self.coord.complete(pending)
        self.retire(pending)
        self.sync_aborted()  # completing aborts older pending checkpoints

    @precondition(lambda self: self.coordinator is not None and bool(self.coord.pending))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        pending = data.draw(st.sampled_from(self.coord.pending))
        self.coord.abort(pending, "test")
        self.retire(pending)

    @precondition(lambda self: self.coordinator is not None)
    @rule(data=st.data())
    def finished_checkpoints_stay_finished(self, data: st.DataObject) -> None:
        if not self.dead:
            return
        pending = data.draw(st.sampled_from(self.dead))
        with pytest.raises(CheckpointError):
            self.coord.complete(pending)

    @precondition(lambda self: self.coordinator is not None)
    @rule(data=st.data(), steps_done=st.integers(0, 6))
    def crash_and_recover(self, data: st.DataObject, steps_done: int) -> None:
        """The driver dies, possibly in the middle of complete() and with other checkpoints
        pending; a new one recovers from storage alone."""
        mid_complete: bool = bool(self.coord.pending) and data.draw(st.booleans())
        if mid_complete:
            pending = data.draw(st.sampled_from(self.coord.pending))
            accepted = self.acknowledge_all(pending, data)
            steps = self.coord._complete_steps(pending)
            try:
                for _ in range(steps_done):
                    next(steps)
            except CheckpointAbortedError:
                assert not accepted
                event("crash: refused in Step 2")
            else:
                event(f"crash after step {steps_done}")
                if accepted and steps_done >= 3:
                    assert pending.completed is not None
                    self.completed.append(pending.completed)
        self.coordinator = None
        self.coordinator = CheckpointCoordinator.recover(self.storage, **self.args)
        # The only notes: checkpoints pending at the crash (chk-<N>/ without _metadata) that
        # recovery did not restore; never a corrupt or lost completed one.
        latest = self.coordinator.latest_completed
        for note in self.coordinator.recovery_notes:
            assert " has no _metadata: it never completed" in note, note
            assert latest is not None and f"recovered from checkpoint {latest.checkpoint_id}," \
                in note
        self.bases.clear()
        self.dead.clear()  # they belong to the dead coordinator

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def retained_checkpoints_are_the_model_s(self) -> None:
        if self.coordinator is None:
            return
        num_retained = self.args["num_retained"]
        retained = self.coord.retained
        assert len(retained) <= num_retained
        assert [c.checkpoint_id for c in retained] == \
            [c.checkpoint_id for c in self.completed[-num_retained:]]
        assert [c.metadata for c in retained] == [c.metadata for c in self.completed[-num_retained:]]

    @invariant()
    def no_retained_file_is_missing(self) -> None:
        if self.coordinator is None:
            return
        for checkpoint in self.coord.retained:
            assert self.storage.read_metadata(checkpoint.metadata_path) == checkpoint.metadata
            for f in checkpoint.metadata.files():
                self.storage.read_verified(f)

    @invariant()
    def no_unreferenced_file_is_left(self) -> None:
        if self.coordinator is None:
            return
        pending = {p.checkpoint_id for p in self.coord.pending}
        live = self.live_shared()
        for path in self.storage.list_files("shared"):
            assert path in live or checkpoint_id_of_shared_file(path) in pending, path
        files = self.storage.list_files()
        chk_dirs = {int(p.split("/")[0][4:]) for p in files
                    if p.startswith("chk-") and not p.endswith(f"/{ABORTED_MARKER_FILE}")}
        assert chk_dirs <= {c.checkpoint_id for c in self.coord.retained} | pending
        # Tombstones (aborted ids) only above every completed checkpoint: their ids are
        # never given out again; a later completed checkpoint removes it.
        tombstones = {int(p.split("/")[0][4:]) for p in files
                      if p.endswith(f"/{ABORTED_MARKER_FILE}")}
        latest = self.coord.latest_completed
        assert all(latest is None or i > latest.checkpoint_id for i in tombstones)
        assert find_garbage(self.storage).files == []


CheckpointMachine.TestCase.settings = settings(max_examples=budget(30), stateful_step_count=40,
                                               deadline=None)
TestCheckpointMachine = CheckpointMachine.TestCase
