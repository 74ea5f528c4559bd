"""Recovery's reading step: what a snapshot root holds, read from storage alone.

:meth:`~keyedstate.checkpoint.coordinator.CheckpointCoordinator.recover` is the entry point:
it reads the root here (step 1: the retained, older, unreadable and incomplete checkpoints,
raising before anything is deleted), then rebuilds its registry and store from what was read
and cleans up (steps 2-7, in the coordinator: they change its state). The constructor of a new
job uses :func:`lost_checkpoints` and :func:`highest_used_id` too. The rules are in
``docs/checkpoints.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from keyedstate.checkpoint.pending import CompletedCheckpoint
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    MaxParallelismMismatchError,
    MissingCheckpointFileError,
    NoCheckpointError,
    UnsafePathError,
)
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import (
    COMPLETED_MARKER_FILE,
    SHARED_DIR,
    checkpoint_id_of_shared_file,
)


@dataclass(frozen=True, slots=True)
class StoredCheckpoints:
    """What :func:`read_stored_checkpoints` found in a root."""

    #: every ``chk-<N>/`` id, ascending
    dir_ids: list[int]
    #: the newest ``num_retained`` readable checkpoints, oldest first
    retained: list[CompletedCheckpoint]
    #: the readable checkpoints older than those, newest first
    older: list[CompletedCheckpoint]
    #: checkpoint id -> why its ``_metadata`` can't be read
    unreadable: dict[int, str]
    #: ids of ``chk-<N>/`` without ``_metadata``, newest first
    incomplete: list[int]


def read_stored_checkpoints(storage: CheckpointStorage, num_retained: int) -> StoredCheckpoints:
    """Read ``_metadata`` newest first until ``num_retained`` are readable. Only corruption is
    skipped: I/O errors and a newer format version propagate. Raises
    :class:`CorruptCheckpointError` when checkpoints exist but none is readable, and
    :class:`MissingCheckpointFileError` when the root's
    :data:`~keyedstate.storage.layout.COMPLETED_MARKER_FILE` says the job completed
    checkpoints but none is left. Deletes nothing."""
    dir_ids = storage.checkpoint_dir_ids()
    retained: list[CompletedCheckpoint] = []
    older: list[CompletedCheckpoint] = []
    unreadable: dict[int, str] = {}
    incomplete: list[int] = []
    for checkpoint_id in reversed(dir_ids):
        path = storage.metadata_path(checkpoint_id)
        try:
            metadata = storage.read_metadata(path)
        except NoCheckpointError:
            incomplete.append(checkpoint_id)
            continue
        except (CorruptCheckpointError, UnsafePathError) as exc:
            unreadable[checkpoint_id] = str(exc)
            continue
        if metadata.checkpoint_id != checkpoint_id:
            unreadable[checkpoint_id] = (f"{storage.url_of(path)} describes checkpoint "
                                         f"{metadata.checkpoint_id}, not {checkpoint_id}")
            continue
        checkpoint = CompletedCheckpoint(checkpoint_id, metadata, path)
        (retained if len(retained) < num_retained else older).append(checkpoint)
    retained.reverse()
    if unreadable and not retained:
        raise CorruptCheckpointError(
            f"no checkpoint in {storage.url} can be read: "
            + "; ".join(unreadable[i] for i in sorted(unreadable, reverse=True))
            + ". Nothing was deleted. Put a good copy of the _metadata back, or restore "
            "the job from a savepoint into a new checkpoint directory "
            "(execution.state-recovery.path: the savepoint, execution.checkpointing.dir: "
            "a directory no job uses; here the job's own checkpoints win over a restore "
            "path), and keep this one for inspection (keyedstate checkpoints show)"
        )
    # A job that completed checkpoints but has none left lost them (deleted _metadata):
    # starting it from empty state would silently drop its state. Without the marker, a
    # chk-<N>/ without _metadata is a checkpoint that never completed.
    if not retained and storage.exists(COMPLETED_MARKER_FILE):
        raise lost_checkpoints(storage, incomplete)
    return StoredCheckpoints(dir_ids, retained, older, unreadable, incomplete)


def check_configuration(checkpoint: CompletedCheckpoint, storage: CheckpointStorage, *,
                        backend: str, max_parallelism: int, key_types: Sequence[str]) -> None:
    """Raise when the job's configuration doesn't fit a retained checkpoint (recovery's
    step 2): :class:`MaxParallelismMismatchError` for another max parallelism,
    :class:`ConfigurationError` for another backend or other key types."""
    metadata, where = checkpoint.metadata, storage.url_of(checkpoint.metadata_path)
    if metadata.max_parallelism != max_parallelism:
        raise MaxParallelismMismatchError(
            f"{where} was written with max parallelism {metadata.max_parallelism}, the job "
            f"is configured with {max_parallelism}. Key groups can't change in place: "
            f"configure max parallelism {metadata.max_parallelism}, or take a canonical "
            f"savepoint, rewrite it with the state processor API at max parallelism "
            f"{max_parallelism}, and start the job from that savepoint"
        )
    if metadata.backend != backend:
        raise ConfigurationError(
            f"{where} was written by the {metadata.backend!r} backend, the job is configured "
            f"with {backend!r}; use {metadata.backend!r}, or take a canonical savepoint "
            f"to change backends"
        )
    if metadata.key_types and key_types and metadata.key_types != key_types:
        raise ConfigurationError(
            f"{where} was written with key types {metadata.key_types}, the job declares "
            f"{key_types}; keys are stored in their types' encoding, so declare the "
            f"same key types (or migrate the state with the state processor API)"
        )


def lost_checkpoints(storage: CheckpointStorage, incomplete: Sequence[int]
                     ) -> MissingCheckpointFileError:
    """The error for a root whose completed checkpoints are all gone (marker, no _metadata)."""
    left = (", ".join(f"chk-{i}/" for i in sorted(incomplete, reverse=True))
            + " without _metadata" if incomplete else "no chk-<N>/ at all")
    highest = highest_used_id(storage, storage.list_files(SHARED_DIR))
    return MissingCheckpointFileError(
        f"{storage.url} lost its checkpoints: the job completed checkpoints before "
        f"({COMPLETED_MARKER_FILE} exists; ids used up to chk-{highest}), but no chk-<N>/_metadata "
        f"is left ({left}). Starting from empty state would silently drop the job's state; "
        f"nothing was deleted. Put the missing _metadata back, or restore the job from a "
        f"savepoint into a new checkpoint directory (to start from empty state here on "
        f"purpose, delete {storage.url_of(COMPLETED_MARKER_FILE)} and every chk-<N>/)"
    )


def highest_used_id(storage: CheckpointStorage, shared: Iterable[str],
                    dir_ids: Iterable[int] | None = None) -> int:
    """The highest checkpoint id in a ``chk-<N>/`` name or a shared file name (0 if none)."""
    ids = [*(storage.checkpoint_dir_ids() if dir_ids is None else dir_ids),
           *(i for p in shared if (i := checkpoint_id_of_shared_file(p)) is not None)]
    return max(ids, default=0)
