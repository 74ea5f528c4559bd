"""Find the snapshot a path names: a checkpoint directory, a ``chk-N`` folder, a savepoint
folder, or a ``_metadata`` file. Every file reference of a snapshot is relative to its root:
the job's checkpoint directory for ``chk-N``, the savepoint folder for a savepoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from keyedstate.errors import NoCheckpointError
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata
from keyedstate.storage.layout import METADATA_FILE, checkpoint_id_of_dir
from keyedstate.storage.transfer import TransferOptions


@dataclass(frozen=True)
class ResolvedSnapshot:
    storage: CheckpointStorage  # the snapshot's root
    metadata_path: str  # relative to the root
    metadata: CheckpointMetadata


def resolve_snapshot(path: str, storage_options: Mapping[str, Any] | None = None,
                     transfer: TransferOptions | None = None) -> ResolvedSnapshot:
    """The snapshot at ``path`` (for a job's checkpoint directory: its latest checkpoint);
    ``transfer`` tunes how its files are read (a restoring job passes its own)."""
    url = str(path).rstrip("/")
    if url.endswith("/" + METADATA_FILE):
        url = url[: -len(METADATA_FILE) - 1]
    head, _, name = url.rpartition("/")
    if checkpoint_id_of_dir(name) is not None and head:
        root = CheckpointStorage(head, storage_options, transfer)
        relative = f"{name}/{METADATA_FILE}"
        return ResolvedSnapshot(root, relative, root.read_metadata(relative))
    root = CheckpointStorage(url, storage_options, transfer)
    if root.exists(METADATA_FILE):
        return ResolvedSnapshot(root, METADATA_FILE, root.read_metadata(METADATA_FILE))
    ids = root.checkpoint_ids()
    if not ids:
        raise NoCheckpointError(
            f"{path} holds no checkpoint or savepoint (no _metadata, no chk-N/_metadata)"
        )
    relative = root.metadata_path(ids[-1])
    return ResolvedSnapshot(root, relative, root.read_metadata(relative))
