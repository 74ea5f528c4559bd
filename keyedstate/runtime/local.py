"""An in-process runtime for one keyed operator: p subtasks checkpointed by a coordinator.

The engine-independent reference for what the Spark runtime does per micro-batch (one
checkpoint per batch, restore and rescale from the latest completed checkpoint). Tests,
benchmarks and ``keyedstate demo --local`` use it; it imports no pyspark.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.checkpoint.savepoint import write_native_savepoint
from keyedstate.config import RestoreMode, parse_restore_mode
from keyedstate.errors import NoCheckpointError
from keyedstate.keygroups import KeyGroupRange, check_parallelism, operator_index_for_key_group
from keyedstate.keys import KeySerializer
from keyedstate.runtime.startup import open_coordinator, start_job
from keyedstate.state.ttl import TtlTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import SnapshotFormat
from keyedstate.storage.transfer import TransferOptions

ProcessFn = Callable[[KeyedStateBackend, Any, Any], None]


class LocalKeyedOperator:
    """``parallelism`` keyed backends in this process, with a checkpoint coordinator.

    On construction it restores from the latest completed checkpoint in ``checkpoint_dir``
    (any fsspec URL) when there is one, at the given parallelism (rescaling if it changed).
    Otherwise, with ``restore_path``, it starts from that checkpoint or savepoint in
    ``restore_mode`` (:class:`~keyedstate.config.RestoreMode`, see
    :mod:`keyedstate.checkpoint.restore_modes`): every file of the snapshot is checked first
    (existence and size; checksums too on a local disk), then NO_CLAIM and LEGACY restore from
    it where it lies and their first checkpoint duplicates the restored files into this job's
    root (by the store itself: no upload), and CLAIM imports it as this job's first
    checkpoint. A job's own checkpoints always win over ``restore_path``; a job whose
    latest checkpoint lost its ``_metadata`` falls back to the newest complete one (a warning,
    and a line in ``coordinator.recovery_notes``), and one left with none raises
    :class:`~keyedstate.errors.MissingCheckpointFileError`: never an empty start. Without
    ``max_parallelism``, the state's is adopted. ``transfer`` tunes retries, parallel
    transfers, inlining, merging and the file cache (docs/object-storage.md). The storage is
    checked first: refused credentials or a missing bucket raise
    :class:`~keyedstate.errors.StorageAccessError` or
    :class:`~keyedstate.errors.StorageLocationError` before anything else happens.
    """

    def __init__(self, checkpoint_dir: str, *, key_types: Sequence[str],
                 backend: StateBackend | str = "rocksdb", parallelism: int = 2,
                 max_parallelism: int | None = None, num_retained: int = 1,
                 time_provider: TtlTimeProvider | None = None,
                 local_dir: str | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 restore_path: str | None = None,
                 restore_mode: RestoreMode | str = RestoreMode.NO_CLAIM,
                 transfer: TransferOptions | None = None) -> None:
        self.backend = load_backend(backend) if isinstance(backend, str) else backend
        self.parallelism = parallelism
        self.key_serializer = KeySerializer(list(key_types))
        self.storage = CheckpointStorage(checkpoint_dir, storage_options, transfer)
        self.time_provider = time_provider
        # None: the backends' default below the temp dir (one directory per process there,
        # removed with its process), not a new directory per operator that nothing removes.
        self.local_dir = local_dir
        self.num_retained = num_retained
        self.restore_mode = parse_restore_mode(restore_mode)
        # Steps 0-3 (runtime/startup.py): storage access, the restore snapshot (checked, then
        # claimed or kept), key groups, the coordinator; then the subtasks.
        start = start_job(self.storage, backend=self.backend.name,
                          key_types=self.key_serializer.type_strings, parallelism=parallelism,
                          max_parallelism=max_parallelism, num_retained=num_retained,
                          restore_path=restore_path, restore_mode=self.restore_mode,
                          storage_options=storage_options,
                          on_restore=lambda _: {"restored_from": str(restore_path)})
        self.max_parallelism = start.max_parallelism
        self.coordinator = start.coordinator
        #: the snapshot restored in NO_CLAIM or LEGACY mode, until the first checkpoint
        self.restored: ResolvedSnapshot | None = start.restored
        self.subtasks = self._open_subtasks()

    def _coordinator(self) -> CheckpointCoordinator:
        return open_coordinator(self.storage, backend=self.backend.name,
                                parallelism=self.parallelism,
                                max_parallelism=self.max_parallelism,
                                key_types=self.key_serializer.type_strings,
                                num_retained=self.num_retained)

    def _open_subtasks(self) -> list[KeyedStateBackend]:
        latest = self.coordinator.latest_completed
        handles = latest.metadata.handles if latest else ()
        storage, share = self.storage, True
        if latest is None and self.restored is not None:
            if self.restored.metadata.format is SnapshotFormat.CANONICAL:
                return self._load_canonical(self.restored)
            # NO_CLAIM / LEGACY: read the snapshot where it lies; reference none of its files.
            handles, storage, share = self.restored.metadata.handles, self.restored.storage, False
        return [
            self.backend.create_keyed_backend(
                subtask_index=i,
                key_group_range=KeyGroupRange.of_operator(self.max_parallelism,
                                                          self.parallelism, i),
                max_parallelism=self.max_parallelism,
                key_serializer=self.key_serializer,
                restore_handles=handles,
                storage=storage,
                share_restored_files=share,
                time_provider=self.time_provider,
                local_dir=self.local_dir,
            )
            for i in range(self.parallelism)
        ]

    def _load_canonical(self, snapshot: ResolvedSnapshot) -> list[KeyedStateBackend]:
        """Every subtask bulk-loaded from a canonical savepoint (any source backend)."""
        from keyedstate.processor.canonical import restore_canonical

        subtasks: list[KeyedStateBackend] = []
        try:
            for i in range(self.parallelism):
                subtasks.append(restore_canonical(
                    self.backend, snapshot, subtask_index=i,
                    key_group_range=KeyGroupRange.of_operator(self.max_parallelism,
                                                              self.parallelism, i),
                    max_parallelism=self.max_parallelism, key_serializer=self.key_serializer,
                    time_provider=self.time_provider, local_dir=self.local_dir))
        except BaseException:
            for sub in subtasks:
                sub.close()
            raise
        return subtasks

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
        # The job now depends on its own checkpoints only (NO_CLAIM's promise).
        self.restored = None
        return completed

    def savepoint(self, target: str) -> str:
        """A native savepoint of the latest completed checkpoint in ``target`` (see
        :func:`~keyedstate.checkpoint.savepoint.write_native_savepoint`); returns the path or
        URL of its ``_metadata``."""
        latest = self.coordinator.latest_completed
        if latest is None:
            raise NoCheckpointError(
                f"{self.storage.url} has no completed checkpoint yet: call checkpoint() first"
            )
        source = ResolvedSnapshot(self.storage, latest.metadata_path, latest.metadata)
        return write_native_savepoint(source, target, self.storage.storage_options)

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
