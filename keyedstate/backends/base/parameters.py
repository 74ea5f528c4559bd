"""What a keyed state backend is created with: one parameters object (Flink's
``KeyedStateBackendParameters``), so that a new parameter is added in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.state.ttl import TtlTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle


@dataclass(frozen=True)
class KeyedStateBackendParameters:
    """One subtask's keyed backend: its index and key groups, the key serializer, and what to
    restore from.

    ``restore_handles`` are read from ``storage`` (required when there are any): every handle
    whose key-group range overlaps ``key_group_range`` is used (rescaling), others are ignored.
    ``share_restored_files`` False means the first snapshot after the restore must not
    reference restored files (NO_CLAIM: it duplicates them into the job's own root).
    ``time_provider`` is the TTL clock (system time when None); ``local_dir`` the parent of
    the backend's working directory (the temp dir when None)."""

    subtask_index: int
    key_group_range: KeyGroupRange
    max_parallelism: int
    key_serializer: KeySerializer
    restore_handles: Sequence[KeyedStateHandle] = ()
    storage: CheckpointStorage | None = None
    share_restored_files: bool = True
    time_provider: TtlTimeProvider | None = None
    local_dir: str | None = None
