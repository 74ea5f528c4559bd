"""A checkpoint in flight and the retained completed checkpoints (Flink's
``PendingCheckpoint``, ``CompletedCheckpoint`` and ``CompletedCheckpointStore``)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from keyedstate.errors import CheckpointProtocolError, KeyGroupRangeError
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata, KeyedStateHandle
from keyedstate.storage.location import CheckpointStorageLocation


def check_subtask_index(index: int, parallelism: int, checkpoint_id: int) -> None:
    if not 0 <= index < parallelism:
        raise KeyGroupRangeError(
            f"subtask index {index} is out of range for parallelism {parallelism} "
            f"(checkpoint {checkpoint_id}); the handle or location belongs to another job layout"
        )



@dataclass(frozen=True, slots=True)
class CompletedCheckpoint:
    """A checkpoint whose ``_metadata`` is durable; ``metadata_path`` is relative to the root."""

    checkpoint_id: int
    metadata: CheckpointMetadata
    metadata_path: str

    @property
    def handles(self) -> list[KeyedStateHandle]:
        return self.metadata.handles

    def referenced_paths(self) -> set[str]:
        """``_metadata`` and every file its handles reference."""
        return {self.metadata_path, *(f.path for f in self.metadata.files())}


class CompletedCheckpointStore:
    """The retained completed checkpoints, oldest first (Flink's ``CompletedCheckpointStore``);
    keeps at most ``num_retained`` (``execution.checkpointing.num-retained``)."""

    def __init__(self, num_retained: int) -> None:
        self.num_retained = num_retained
        self._checkpoints: list[CompletedCheckpoint] = []

    def add_checkpoint_and_subsume_oldest(
            self, checkpoint: CompletedCheckpoint) -> list[CompletedCheckpoint]:
        """Add the newest checkpoint; return the ones it subsumes (oldest first)."""
        if self._checkpoints and checkpoint.checkpoint_id <= self._checkpoints[-1].checkpoint_id:
            raise CheckpointProtocolError(
                f"checkpoint {checkpoint.checkpoint_id} is not newer than the latest completed "
                f"checkpoint {self._checkpoints[-1].checkpoint_id}; ids must grow"
            )
        self._checkpoints.append(checkpoint)
        excess = max(0, len(self._checkpoints) - self.num_retained)
        subsumed, self._checkpoints = self._checkpoints[:excess], self._checkpoints[excess:]
        return subsumed

    @property
    def latest(self) -> CompletedCheckpoint | None:
        return self._checkpoints[-1] if self._checkpoints else None

    @property
    def retained(self) -> list[CompletedCheckpoint]:
        return list(self._checkpoints)

    @property
    def lowest_retained_id(self) -> int | None:
        return self._checkpoints[0].checkpoint_id if self._checkpoints else None


class PendingCheckpoint:
    """A triggered checkpoint collecting one handle per subtask (Flink's ``PendingCheckpoint``).

    Ends either completed (:attr:`completed` set) or aborted (:attr:`failure_reason` set).
    """

    def __init__(self, storage: CheckpointStorage, checkpoint_id: int, timestamp_ms: int,
                 parallelism: int, properties: Mapping[str, str]) -> None:
        self.storage = storage
        self.checkpoint_id = checkpoint_id
        self.timestamp_ms = timestamp_ms
        self.parallelism = parallelism
        self.properties = dict(properties)
        self._acknowledged: dict[int, KeyedStateHandle] = {}
        self._locations: dict[int, CheckpointStorageLocation] = {}
        self.completed: CompletedCheckpoint | None = None
        self.failure_reason: str | None = None

    def location(self, subtask_index: int) -> CheckpointStorageLocation:
        """Where subtask ``subtask_index`` writes its snapshot (the same object on every call,
        so what it writes in this process is remembered for :meth:`~CheckpointCoordinator.abort`;
        a pickled copy's writes are found by their file names)."""
        check_subtask_index(subtask_index, self.parallelism, self.checkpoint_id)
        if subtask_index not in self._locations:
            self._locations[subtask_index] = self.storage.location(self.checkpoint_id,
                                                                   subtask_index)
        return self._locations[subtask_index]

    @property
    def acknowledged(self) -> Mapping[int, KeyedStateHandle]:
        return MappingProxyType(self._acknowledged)

    @property
    def is_fully_acknowledged(self) -> bool:
        return len(self._acknowledged) == self.parallelism

    @property
    def is_aborted(self) -> bool:
        return self.failure_reason is not None

    @property
    def is_completed(self) -> bool:
        return self.completed is not None

    def written_here(self) -> list[str]:
        """Files written through this process's locations."""
        return [p for loc in self._locations.values() for p in loc.written]

    def __repr__(self) -> str:
        state = ("completed" if self.is_completed else "aborted" if self.is_aborted
                 else f"{len(self._acknowledged)}/{self.parallelism} acknowledged")
        return f"PendingCheckpoint({self.checkpoint_id}, {state})"
