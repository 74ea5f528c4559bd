"""An in-process runtime for one keyed operator: p subtasks checkpointed by a coordinator.

The engine-independent reference for what the Spark runtime does per micro-batch (one
checkpoint per batch, restore and rescale from the latest completed checkpoint). Tests,
benchmarks and ``keyedstate demo --local`` use it; it imports no pyspark.
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable, Iterable, Sequence

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from keyedstate.checkpoint.storage import CheckpointStorage
from keyedstate.keygroups import (
    KeyGroupRange,
    check_parallelism,
    compute_default_max_parallelism,
    operator_index_for_key_group,
)
from keyedstate.keys import KeySerializer
from keyedstate.state.ttl import TtlTimeProvider

ProcessFn = Callable[[KeyedStateBackend, Any, Any], None]


class LocalKeyedOperator:
    """``parallelism`` keyed backends in this process, with a checkpoint coordinator.

    On construction it restores from the latest completed checkpoint in ``checkpoint_dir``
    (any fsspec URL) when there is one, at the given parallelism (rescaling if it changed).
    """

    def __init__(self, checkpoint_dir: str, *, key_types: Sequence[str],
                 backend: StateBackend | str = "rocksdb", parallelism: int = 2,
                 max_parallelism: int | None = None, num_retained: int = 1,
                 time_provider: TtlTimeProvider | None = None,
                 local_dir: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.backend = load_backend(backend) if isinstance(backend, str) else backend
        self.max_parallelism = max_parallelism or compute_default_max_parallelism(parallelism)
        check_parallelism(parallelism, self.max_parallelism)
        self.parallelism = parallelism
        self.key_serializer = KeySerializer(list(key_types))
        self.storage = CheckpointStorage(checkpoint_dir, storage_options)
        self.time_provider = time_provider
        self.local_dir = local_dir or tempfile.mkdtemp(prefix="keyedstate-local-")
        self.num_retained = num_retained
        self.coordinator = self._coordinator()
        self.subtasks = self._open_subtasks()

    def _coordinator(self) -> CheckpointCoordinator:
        args: dict[str, Any] = dict(
            backend=self.backend.name, parallelism=self.parallelism,
            max_parallelism=self.max_parallelism, key_types=self.key_serializer.type_strings,
            num_retained=self.num_retained)
        if self.storage.checkpoint_ids():
            return CheckpointCoordinator.recover(self.storage, **args)
        return CheckpointCoordinator(self.storage, **args)

    def _open_subtasks(self) -> list[KeyedStateBackend]:
        latest = self.coordinator.latest_completed
        handles = latest.metadata.handles if latest else ()
        return [
            self.backend.create_keyed_backend(
                subtask_index=i,
                key_group_range=KeyGroupRange.of_operator(self.max_parallelism,
                                                          self.parallelism, i),
                max_parallelism=self.max_parallelism,
                key_serializer=self.key_serializer,
                restore_handles=handles,
                storage=self.storage,
                time_provider=self.time_provider,
                local_dir=self.local_dir,
            )
            for i in range(self.parallelism)
        ]

    def subtask_for(self, key: Any) -> tuple[KeyedStateBackend, int]:
        kg = self.key_serializer.key_group(key, self.max_parallelism)
        return self.subtasks[operator_index_for_key_group(self.max_parallelism,
                                                          self.parallelism, kg)], kg

    def process(self, records: Iterable[tuple[Any, Any]], fn: ProcessFn) -> None:
        """Call ``fn(backend, key, value)`` for each record with the key made current."""
        for key, value in records:
            sub, kg = self.subtask_for(key)
            sub.set_current_key(key, kg)
            fn(sub, key, value)

    def checkpoint(self, properties: dict[str, str] | None = None) -> CompletedCheckpoint:
        """Snapshot every subtask and commit the checkpoint (aborting it on any failure)."""
        pending = self.coordinator.trigger(properties)
        try:
            for sub in self.subtasks:
                result = sub.snapshot(pending.checkpoint_id,
                                      pending.location(sub.subtask_index))
                self.coordinator.acknowledge(pending, result.materialize())
            completed = self.coordinator.complete(pending)
        except BaseException:
            self.coordinator.abort(pending, "a subtask failed to snapshot")
            for sub in self.subtasks:
                sub.notify_checkpoint_aborted(pending.checkpoint_id)
            raise
        for sub in self.subtasks:
            sub.notify_checkpoint_complete(completed.checkpoint_id)
        return completed

    def rescale(self, parallelism: int) -> None:
        """Restore every subtask from the latest completed checkpoint at a new parallelism."""
        check_parallelism(parallelism, self.max_parallelism)
        self.close_subtasks()
        self.parallelism = parallelism
        self.coordinator = self._coordinator()
        self.subtasks = self._open_subtasks()

    def close_subtasks(self) -> None:
        for sub in self.subtasks:
            sub.close()
        self.subtasks = []

    def close(self) -> None:
        self.close_subtasks()

    def __enter__(self) -> LocalKeyedOperator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
