"""Tests of the checkpoint protocol (``keyedstate/checkpoint/``): the coordinator, the shared-state
registry, statistics, restore modes and savepoints (``_metadata`` and storage: ``tests/storage/``).

Helpers shared by these tests: a simulated subtask that snapshots the way an incremental
backend does (new files through the pending checkpoint's location, re-referenced files of its
base), with real files in a temporary directory; nothing is mocked.
"""

from __future__ import annotations

from typing import Iterable

from keyedstate.checkpoint.coordinator import CheckpointCoordinator, PendingCheckpoint
from keyedstate.keygroups import KeyGroupRange
from keyedstate.storage.handles import KeyedStateHandle, StreamHandle


def make_handle(coordinator: CheckpointCoordinator, pending: PendingCheckpoint, index: int,
                shared: dict[str, StreamHandle],
                private: dict[str, StreamHandle] | None = None) -> KeyedStateHandle:
    """Subtask ``index``'s handle for ``pending`` over the given files."""
    kgr = KeyGroupRange.of_operator(coordinator.max_parallelism, coordinator.parallelism, index)
    private = private or {}
    files = [*shared.values(), *private.values()]
    return KeyedStateHandle(
        backend=coordinator.backend, subtask_index=index, key_group_start=kgr.start,
        key_group_end=kgr.end, checkpoint_id=pending.checkpoint_id, states=[],
        shared=dict(shared), private=dict(private), full_size=sum(f.size for f in files),
        incremental_size=sum(f.size for f in files if f.path.startswith(
            (f"shared/chk-{pending.checkpoint_id}-", f"chk-{pending.checkpoint_id}/"))),
    )


def snapshot(coordinator: CheckpointCoordinator, pending: PendingCheckpoint, index: int, *,
             new: Iterable[str] = ("sst",), reuse: Iterable[StreamHandle] = (),
             private: bool = True) -> KeyedStateHandle:
    """Write ``new`` shared files (and one private file) through ``pending.location(index)``
    and return a handle that also re-references ``reuse``."""
    location = pending.location(index)
    shared = {h.path: h for h in reuse}
    for name in new:
        handle = location.write_shared(f"{pending.checkpoint_id}/{index}/{name}".encode(), name)
        shared[handle.path] = handle
    files = {"meta": location.write_private(b"meta", "meta")} if private else {}
    return make_handle(coordinator, pending, index, shared, files)


def acknowledge_all(coordinator: CheckpointCoordinator, pending: PendingCheckpoint, *,
                    new: Iterable[str] = ("sst",),
                    reuse: Iterable[StreamHandle] = ()) -> None:
    """Every subtask not yet in snapshots and acknowledges (``reuse`` goes to subtask 0)."""
    reuse = list(reuse)
    for index in range(coordinator.parallelism):
        if index not in pending.acknowledged:
            coordinator.acknowledge(pending, snapshot(coordinator, pending, index, new=new,
                                                      reuse=reuse if index == 0 else ()))


def shared_files(coordinator: CheckpointCoordinator) -> list[str]:
    return coordinator.storage.list_files("shared")
