"""The heap state backend: keyed state as Python objects, incremental snapshots per FLIP-151.

State lives in dicts per state and key group (:mod:`.state_table`, :mod:`.states`), so an
access costs a dict lookup and never a serialization. Snapshots are full or incremental (:mod:`.snapshot`): an
incremental one writes the entries changed since the last *confirmed* snapshot, on top of that
snapshot's chain, plus images of the key groups whose latest image is oldest, about as many
entries as it changed (rolling materialization). No snapshot after the first writes the whole
state; every key group is imaged again within ``max_chain_length + 1`` checkpoints, which
bounds the files a restore replays (:mod:`.restore`).

This module is the configuration (:class:`HeapStateBackend`, which pickles under this path);
the keyed backend of one subtask is :mod:`.keyed_backend`.
"""


from __future__ import annotations

from typing import Any

from keyedstate.backends.base.backend import StateBackend, check_restore_handles
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.heap import sizes
from keyedstate.backends.heap.keyed_backend import DEFAULT_MAX_CHAIN_LENGTH, HeapKeyedStateBackend
from keyedstate.errors import ConfigurationError
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle


class HeapStateBackend(StateBackend):
    """Configuration of the heap backend (``state.backend.type: heap``). Pickles.

    ``incremental`` enables FLIP-151 incremental snapshots with rolling materialization;
    ``max_chain_length`` bounds the diffs a restore applies on top of a key group's image
    (0: every snapshot is full): each incremental snapshot images at least ``ceil(key groups
    / (max_chain_length + 1))`` key groups, oldest image first, so a chain holds at most
    ``max_chain_length + 1`` files.
    """

    name = "heap"

    def __init__(self, *, max_chain_length: int = DEFAULT_MAX_CHAIN_LENGTH,
                 incremental: bool = True) -> None:
        if not isinstance(max_chain_length, int) or isinstance(max_chain_length, bool) \
                or max_chain_length < 0:
            raise ConfigurationError(
                f"max_chain_length must be an int >= 0, got {max_chain_length!r}"
            )
        if not isinstance(incremental, bool):
            raise ConfigurationError(f"incremental must be True or False, got {incremental!r}")
        self.max_chain_length = max_chain_length
        self.incremental = incremental

    def __reduce__(self) -> tuple[Any, ...]:
        return (_heap_state_backend, (self.max_chain_length, self.incremental))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeapStateBackend) and \
            (other.max_chain_length, other.incremental) == (self.max_chain_length,
                                                            self.incremental)

    def __hash__(self) -> int:
        return hash((self.name, self.max_chain_length, self.incremental))

    def __repr__(self) -> str:
        return (f"HeapStateBackend(max_chain_length={self.max_chain_length}, "
                f"incremental={self.incremental})")

    state_sizes_method = "bytes of each state's sections in the heap files (footers)"

    def state_sizes(self, storage: CheckpointStorage, handle: KeyedStateHandle
                    ) -> dict[str, int]:
        return sizes.state_sizes(storage, handle)

    def create_keyed_backend(self, parameters: KeyedStateBackendParameters
                             ) -> HeapKeyedStateBackend:
        """See :meth:`StateBackend.create_keyed_backend`; ``local_dir`` is unused (no files)."""
        p = parameters
        backend = HeapKeyedStateBackend(
            subtask_index=p.subtask_index, key_group_range=p.key_group_range,
            max_parallelism=p.max_parallelism, key_serializer=p.key_serializer,
            time_provider=p.time_provider, max_chain_length=self.max_chain_length,
            incremental=self.incremental,
        )
        handles = check_restore_handles(self.name, p.key_group_range, p.max_parallelism,
                                        p.restore_handles)
        if handles:
            if p.storage is None:
                raise ConfigurationError(
                    f"subtask {p.subtask_index} got {len(handles)} snapshot handles to restore "
                    f"but no storage to read them from; pass storage=CheckpointStorage(...)"
                )
            backend.restore(handles, p.storage, p.share_restored_files)
        return backend


def _heap_state_backend(max_chain_length: int, incremental: bool) -> HeapStateBackend:
    return HeapStateBackend(max_chain_length=max_chain_length, incremental=incremental)
