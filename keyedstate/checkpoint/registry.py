"""The shared-state registry: which shared files are still needed, and when one may go.

Flink's ``SharedStateRegistryImpl`` as it works today (not the reference counts of the 2017
blog post "Managing Large State in Apache Flink: An Intro to Incremental Checkpointing", which
it replaced): every shared file, keyed by its path relative to the snapshot root, remembers
the *last* checkpoint that used it. When checkpoints are subsumed,
the coordinator passes the lowest retained checkpoint id; every file last used below it is
referenced by no retained checkpoint (ids only grow, and a checkpoint uses a file only if it
registered it), so it is dropped and, if owned, deleted.

Files of a snapshot the job was restored from in NO_CLAIM or LEGACY mode belong to the user:
they are registered with ``owned=False`` and are dropped from the registry but never deleted.
An entry once not owned stays not owned, even when a later checkpoint references the file.

The registry is pure bookkeeping: it never touches storage. It returns what to delete and the
coordinator deletes it, after ``_metadata`` of the checkpoint that made it unneeded is durable.
It lives on the driver and is not thread-safe (one coordinator per job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Iterator

from keyedstate.errors import CorruptCheckpointError
from keyedstate.storage.handles import CheckpointMetadata, StreamHandle
from keyedstate.storage.layout import checkpoint_id_of_shared_file


@dataclass(slots=True)
class SharedStateEntry:
    """One registered shared file.

    ``created_by_checkpoint_id`` is the first checkpoint that registered it,
    ``last_used_checkpoint_id`` the latest; ``owned`` False means never delete it.
    """

    handle: StreamHandle
    created_by_checkpoint_id: int
    last_used_checkpoint_id: int
    owned: bool = True


class SharedStateRegistry:
    """Shared files of the retained checkpoints (Flink's ``SharedStateRegistry``)."""

    def __init__(self) -> None:
        self._entries: dict[str, SharedStateEntry] = {}

    # -- registration --------------------------------------------------------------------------

    def register_reference(self, handle: StreamHandle, checkpoint_id: int,
                           *, owned: bool = True) -> SharedStateEntry:
        """Record that checkpoint ``checkpoint_id`` uses ``handle``.

        Called only once the checkpoint is complete (its ``_metadata`` is durable), so an
        unconfirmed checkpoint never keeps a file alive. A path registered before must carry
        the same size and checksum (shared files are immutable):
        :class:`CorruptCheckpointError` otherwise (the coordinator checks this before the
        commit, so it never fires after one). ``owned=False`` marks the file as the user's for good.
        """
        entry = self._entries.get(handle.path)
        if entry is None:
            entry = SharedStateEntry(handle, checkpoint_id, checkpoint_id, owned)
            self._entries[handle.path] = entry
            return entry
        if (entry.handle.size, entry.handle.checksum) != (handle.size, handle.checksum):
            raise CorruptCheckpointError(
                f"shared file {handle.path} is registered with {entry.handle.size} bytes and "
                f"checksum {entry.handle.checksum}, but checkpoint {checkpoint_id} references it "
                f"with {handle.size} bytes and checksum {handle.checksum}; shared files are "
                f"immutable, so the backend wrote a different file under a used name (a bug)"
            )
        entry.last_used_checkpoint_id = max(entry.last_used_checkpoint_id, checkpoint_id)
        entry.owned = entry.owned and owned
        return entry

    def register_all(self, metadata: CheckpointMetadata, *, owned: bool = True) -> None:
        """Register every shared object of a completed checkpoint (or of a restored
        snapshot): its shared files and the merged objects holding its small files (inline
        files have no object; :meth:`KeyedStateHandle.registered_files`)."""
        for handle in metadata.handles:
            for stream in handle.registered_files():
                self.register_reference(stream, metadata.checkpoint_id, owned=owned)

    def register_all_after_restored(self, metadata: CheckpointMetadata, *, claim: bool) -> None:
        """The restore-mode hook (Flink's ``registerAllAfterRestored``): CLAIM takes ownership
        of the restored snapshot's shared files; NO_CLAIM and LEGACY (``claim=False``) register
        them so later checkpoints may reference them, but never delete them."""
        self.register_all(metadata, owned=claim)

    def check_reference(self, handle: StreamHandle,
                        unconfirmed: Collection[int] = ()) -> str | None:
        """Why a new checkpoint may not re-reference ``handle`` (a file it did not write), or
        None. It must be registered, so that a retained checkpoint keeps it alive, with the same
        size and checksum. Flink refuses a placeholder of unknown state the same way: the
        backend built on an unconfirmed checkpoint (one of ``unconfirmed``, the pending ids)
        or on a subsumed one whose file is deleted (the race of incremental checkpoints). The
        reason starts with the file's path."""
        entry = self._entries.get(handle.path)
        if entry is None:
            writer = checkpoint_id_of_shared_file(handle.path)
            why = (f"it was written for checkpoint {writer}, which has not completed (an "
                   f"unconfirmed base)" if writer in unconfirmed else
                   "its checkpoints were subsumed or aborted and it may be deleted")
            return (f"{handle.path}, a shared file no retained checkpoint registers: {why}. "
                    f"The backend must build its next snapshot on its last confirmed checkpoint")
        if (entry.handle.size, entry.handle.checksum) != (handle.size, handle.checksum):
            return (f"{handle.path} with {handle.size} bytes and checksum {handle.checksum}, "
                    f"but it is registered with {entry.handle.size} bytes and checksum "
                    f"{entry.handle.checksum}; shared files are immutable")
        return None

    # -- release -------------------------------------------------------------------------------

    def unregister_unused_state(self, lowest_retained_checkpoint_id: int) -> list[StreamHandle]:
        """Drop every entry last used below ``lowest_retained_checkpoint_id`` and return the
        owned ones: files no retained checkpoint references, which the caller deletes."""
        released: list[StreamHandle] = []
        for path in [p for p, e in self._entries.items()
                     if e.last_used_checkpoint_id < lowest_retained_checkpoint_id]:
            entry = self._entries.pop(path)
            if entry.owned:
                released.append(entry.handle)
        return released

    # -- queries -------------------------------------------------------------------------------

    def get(self, path: str) -> SharedStateEntry | None:
        """The entry of a registered path, else None."""
        return self._entries.get(path)

    def __contains__(self, path: object) -> bool:
        return path in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> Iterable[SharedStateEntry]:
        return self._entries.values()

    def __repr__(self) -> str:
        not_owned = sum(1 for e in self._entries.values() if not e.owned)
        return f"SharedStateRegistry({len(self._entries)} files, {not_owned} not owned)"
