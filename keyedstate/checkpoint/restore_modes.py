"""Restore modes (Flink's ``RecoveryClaimMode``): who owns the snapshot a new job starts from.

Every reference in a job's ``_metadata`` is relative to the job's own root and may not leave it
(:func:`keyedstate.storage.handles.check_relative_path`). A job therefore never references
a file of a snapshot in another directory; the three modes differ in who deletes what:

- ``NO_CLAIM`` (default): the job restores from the snapshot where it lies and its first
  checkpoint is full, so it references none of the snapshot's files; the snapshot stays the
  user's and is never deleted. Several jobs may start from one snapshot.
- ``CLAIM``: the job takes ownership. :func:`claim_snapshot` marks the snapshot as claimed
  (``_claimed`` beside its ``_metadata``, naming the job), duplicates its files into the job's
  root (hard links on one disk, server-side copies on an object store) and commits them as the
  job's first checkpoint ``chk-<M>`` (M = the snapshot's checkpoint id), whose ``_metadata``
  records the snapshot in :data:`CLAIMED_FROM`. The job then runs as if it had written that
  checkpoint: the next checkpoint is incremental on top of it, and when ``chk-<M>`` is subsumed
  the coordinator deletes the original snapshot (:func:`dispose_claimed_snapshot`) before
  ``chk-<M>`` itself. A second job may not start from a claimed snapshot
  (:class:`SnapshotClaimedError`).
- ``LEGACY`` (deprecated, :class:`DeprecationWarning`): never deleted; within the rule above it
  restores as ``NO_CLAIM`` does.

Decisions and their reasons: ``docs/restore-modes.md``.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
import warnings
from typing import Any, Mapping, Sequence

import msgspec
import pyarrow as pa

from keyedstate.checkpoint.properties import CLAIMED_FROM, RESTORE_MODE
from keyedstate.checkpoint.resolve import ResolvedSnapshot, resolve_snapshot
from keyedstate.checkpoint.savepoint import (
    CONTEXT_DIR,
    Progress,
    duplicate_all,
    portable_properties,
    relocate_handles,
    root_url,
    unique_files,
    verify_snapshot_files,
)
from keyedstate.config import RestoreMode, parse_restore_mode
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    JobMismatchError,
    MaxParallelismMismatchError,
    NoCheckpointError,
    SerializationError,
    SnapshotClaimedError,
    UnsafePathError,
)
from keyedstate.serde import type_ddl, type_from_string
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import (
    CheckpointMetadata,
    KeyedStateHandle,
    SnapshotFormat,
    SnapshotKind,
    StreamHandle,
)
from keyedstate.storage.layout import (
    CHECKPOINT_DIR_PREFIX,
    CLAIM_MARKER_FILE,
    SHARED_DIR,
    checkpoint_dir_name,
)
from keyedstate.storage.transfer import RESTORE_PREFIX, TransferStats

logger = logging.getLogger(__name__)



class ClaimMarker(msgspec.Struct, frozen=True):
    """Content of ``_claimed``: the root of the job that owns the snapshot."""

    owner: str
    timestamp_ms: int


def _marker_path(snapshot: ResolvedSnapshot) -> str:
    folder = posixpath.dirname(snapshot.metadata_path)
    return f"{folder}/{CLAIM_MARKER_FILE}" if folder else CLAIM_MARKER_FILE


def claim_owner(snapshot: ResolvedSnapshot) -> str | None:
    """The root of the job that claimed ``snapshot``, or None if no job did."""
    path = _marker_path(snapshot)
    try:
        data = snapshot.storage.read(path)
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=ClaimMarker).owner
    except msgspec.DecodeError as exc:
        raise CorruptCheckpointError(
            f"{snapshot.storage.url_of(path)} is not a keyedstate claim marker ({exc}); "
            f"remove it only if no job owns the snapshot"
        ) from exc


def _check_not_claimed_by_other(snapshot: ResolvedSnapshot, job: CheckpointStorage) -> None:
    owner = claim_owner(snapshot)
    if owner is not None and owner != root_url(job):
        raise SnapshotClaimedError(
            f"{snapshot.storage.url_of(snapshot.metadata_path)} was restored in CLAIM mode by "
            f"the job in {owner}, which owns it and deletes it once subsumed; a second job can't "
            f"start from it. Start from a checkpoint of that job, or from a savepoint of it"
        )


def latest_readable_checkpoint(storage: CheckpointStorage
                               ) -> tuple[str, CheckpointMetadata] | None:
    """The relative ``_metadata`` path and content of the newest readable checkpoint in a
    job's root (the one recovery restores), None if none; reads only."""
    for checkpoint_id in reversed(storage.checkpoint_ids()):
        path = storage.metadata_path(checkpoint_id)
        try:
            return path, storage.read_metadata(path)
        except (CorruptCheckpointError, UnsafePathError, NoCheckpointError):
            continue
    return None


def max_parallelism_of_job(storage: CheckpointStorage) -> int | None:
    """The max parallelism of the newest readable checkpoint in a job's root (None if none):
    a job whose max parallelism is not configured keeps the one its state was written with,
    as Flink does."""
    latest = latest_readable_checkpoint(storage)
    return None if latest is None else latest[1].max_parallelism


def open_restore_snapshot(job: CheckpointStorage, restore_path: str, mode: RestoreMode | str,
                          *, max_parallelism: int | None, backend: str | None = None,
                          key_types: Sequence[str] | None = None,
                          storage_options: Mapping[str, Any] | None = None,
                          progress: Progress | None = None) -> ResolvedSnapshot:
    """Resolve and check the snapshot a new job (root ``job``) starts from. Reads only.

    Step 1. Resolve ``restore_path`` (a checkpoint directory, ``chk-N``, savepoint, _metadata).
    Step 2. A configured ``max_parallelism`` must be the snapshot's
        (:class:`MaxParallelismMismatchError`, pointing to the way out); None adopts it. A
        native snapshot must come from the job's ``backend`` (:class:`ConfigurationError`; a
        canonical savepoint changes backends); any snapshot must be keyed by the job's
        ``key_types`` (:class:`JobMismatchError`, both named in Spark DDL).
    Step 3. No other job may have claimed it (:class:`SnapshotClaimedError`), in any mode: its
        owner deletes it once subsumed. CLAIM needs a native snapshot.
    Step 4. Every file exists with its recorded size, and on a local disk its recorded
        checksum (:class:`MissingCheckpointFileError`, :class:`CorruptCheckpointError`); on an
        object store checksums are verified where the files are downloaded, before any state
        is used (:func:`~keyedstate.checkpoint.savepoint.verify_snapshot_files`).
    Step 5. LEGACY warns (:class:`DeprecationWarning`).
    """
    mode = parse_restore_mode(mode)
    # Step 1. Resolve.
    snapshot = resolve_snapshot(restore_path, storage_options, job.transfer)
    metadata = snapshot.metadata
    where = snapshot.storage.url_of(snapshot.metadata_path)
    # Step 2. Key groups can't change in place.
    if max_parallelism is not None and metadata.max_parallelism != max_parallelism:
        raise MaxParallelismMismatchError(
            f"{where} was taken with max parallelism {metadata.max_parallelism}, the job is "
            f"configured with {max_parallelism}. Set pipeline.max-parallelism to "
            f"{metadata.max_parallelism} (or leave it unset to adopt it), or take a canonical "
            f"savepoint, rewrite it at max parallelism {max_parallelism} with the state "
            f"processor API (SavepointReader / SavepointWriter) and start from that"
        )
    if metadata.format is SnapshotFormat.NATIVE:
        if backend is not None and metadata.backend != backend:
            raise ConfigurationError(
                f"{where} was written by the {metadata.backend!r} backend, the job uses "
                f"{backend!r}; set state.backend.type to {metadata.backend!r}, or take a "
                f"canonical savepoint of it (keyedstate savepoint create --format canonical), "
                f"which any backend restores"
            )
    # Any format: keys are stored (native) or written (canonical) in their types' encoding.
    if key_types and metadata.key_types and not same_key_types(metadata.key_types, key_types):
        raise JobMismatchError(
            f"{where} is keyed by key types {ddl_types(metadata.key_types)}, the job by "
            f"{ddl_types(key_types)}; keys are stored in their types' encoding, so key the job "
            f"by columns of the same types (or migrate the state with the state processor "
            f"API: SavepointReader / SavepointWriter)"
        )
    # Step 3. Ownership.
    _check_not_claimed_by_other(snapshot, job)
    if mode is RestoreMode.CLAIM and metadata.format is not SnapshotFormat.NATIVE:
        raise ConfigurationError(
            f"{where} is a {metadata.format} savepoint; CLAIM takes over a backend's native "
            f"files. Restore it in NO_CLAIM mode (the default)"
        )
    # Step 4. Every file, before anything is touched.
    verify_snapshot_files(snapshot, progress)
    # Step 5. LEGACY is deprecated.
    if mode is RestoreMode.LEGACY:
        warnings.warn(
            "restore mode LEGACY is deprecated: ownership of the snapshot is unclear. keyedstate "
            "restores it as NO_CLAIM (first checkpoint full, the snapshot never deleted); use "
            "NO_CLAIM, or CLAIM to hand the snapshot over to the job",
            DeprecationWarning, stacklevel=3)
    return snapshot


def _parsed_types(types: Sequence[str]) -> list[pa.DataType | str]:
    out: list[pa.DataType | str] = []
    for text in types:
        try:
            out.append(type_from_string(text))
        except SerializationError:
            out.append(text)  # unreadable here: compared as written
    return out


def same_key_types(recorded: Sequence[str], job: Sequence[str]) -> bool:
    """Whether two spellings of key types name the same types (Spark DDL ``bigint`` and
    Arrow's ``int64``, as a canonical savepoint records it, are one type). True when a type
    can't be read here: the restore checks again, per key."""
    first, second = _parsed_types(recorded), _parsed_types(job)
    if any(isinstance(t, str) for t in [*first, *second]):
        return True
    return first == second


def ddl_types(types: Sequence[str]) -> list[str]:
    """Key types in Spark DDL (``bigint``, ``string``), the job's spelling, whichever spelling
    recorded them; a type that can't be read here as recorded."""
    return [t if isinstance(t, str) else type_ddl(t) for t in _parsed_types(types)]


def _write_marker(snapshot: ResolvedSnapshot, job: CheckpointStorage) -> None:
    """Create ``_claimed`` naming ``job``; another owner's marker raises. On a local disk the
    file is created exclusively (O_EXCL), so of two racing claims one fails; an object store
    without conditional writes only reads the marker back (best effort, documented)."""
    storage, path, owner = snapshot.storage, _marker_path(snapshot), root_url(job)
    data = msgspec.json.encode(ClaimMarker(owner, time.time_ns() // 1_000_000))
    if storage.is_local:
        try:
            fd = os.open(storage.path(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            _check_not_claimed_by_other(snapshot, job)
            return
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return
    _check_not_claimed_by_other(snapshot, job)
    storage.write(path, data)
    _check_not_claimed_by_other(snapshot, job)


def claim_snapshot(snapshot: ResolvedSnapshot, job: CheckpointStorage,
                   properties: Mapping[str, str], *,
                   progress: Progress | None = None) -> str:
    """Take ownership of ``snapshot`` (checked by :func:`open_restore_snapshot`) for the job
    whose root is ``job``: it becomes the job's first checkpoint. Returns the relative path of
    that checkpoint's ``_metadata`` in ``job``.

    Step 1. Write the claim marker beside the snapshot's ``_metadata`` (another job's marker:
        :class:`SnapshotClaimedError`; this job's own, from an interrupted claim, is reused).
    Step 2. Duplicate the snapshot's files into the job's root as checkpoint M (the snapshot's
        id): shared files to ``shared/chk-M-claimed-sub-<i>-<name>`` (later checkpoints may
        re-reference them), private ones to ``chk-M/sub-<i>/<name>``.
    Step 3. Write ``chk-M/_metadata`` (kind checkpoint, ``properties`` over the snapshot's,
        :data:`CLAIMED_FROM`): the claim is complete. A crash before this leaves the
        snapshot intact and claimed by this job; starting the job again claims it again.
    """
    if job.checkpoint_ids():
        raise ConfigurationError(
            f"{job.url} already holds checkpoints; a snapshot is claimed by a new job only"
        )
    metadata = snapshot.metadata
    checkpoint_id = metadata.checkpoint_id
    # Step 1. The marker.
    _write_marker(snapshot, job)

    # Step 2. The files, under this job's layout.
    def new_path(handle: KeyedStateHandle, kind: str, stream: StreamHandle) -> str:
        name = posixpath.basename(stream.path)
        if kind == "shared":
            return (f"{SHARED_DIR}/{CHECKPOINT_DIR_PREFIX}{checkpoint_id}-claimed-"
                    f"sub-{handle.subtask_index}-{name}")
        return f"{checkpoint_dir_name(checkpoint_id)}/sub-{handle.subtask_index}/{name}"

    handles, mapping = relocate_handles(metadata, new_path)
    sizes = {f.path: f.size for f in unique_files(metadata)}
    stats = TransferStats()
    duplicate_all(snapshot.storage, job, mapping, sizes, progress, stats)
    # Step 3. Commit as the job's checkpoint, with what the duplication cost.
    merged = portable_properties(metadata.properties)
    merged.update(properties)
    merged.update(stats.to_properties(RESTORE_PREFIX))
    merged[CLAIMED_FROM] = snapshot.storage.url_of(snapshot.metadata_path)
    merged[RESTORE_MODE] = str(RestoreMode.CLAIM)
    imported = msgspec.structs.replace(
        metadata, handles=[msgspec.structs.replace(h, checkpoint_id=checkpoint_id)
                           for h in handles],
        kind=SnapshotKind.CHECKPOINT, format=SnapshotFormat.NATIVE, properties=merged)
    return job.write_metadata(imported)


def _other_checkpoints_files(storage: CheckpointStorage, except_path: str) -> set[str]:
    """Files referenced by the committed checkpoints of ``storage`` other than ``except_path``
    (a claimed checkpoint of another job shares files with its neighbours)."""
    keep: set[str] = set()
    for checkpoint_id in storage.checkpoint_ids():
        path = storage.metadata_path(checkpoint_id)
        if path == except_path:
            continue
        try:
            keep.update(f.path for f in storage.read_metadata(path).files())
        except (CorruptCheckpointError, UnsafePathError, NoCheckpointError):
            # Unknown references: keep every shared file rather than guess.
            keep.update(storage.list_files(SHARED_DIR))
    return keep


def _remove_empty_dirs(storage: CheckpointStorage) -> None:
    if not storage.is_local:
        return  # object stores have no directories
    for folder, _, _ in sorted(os.walk(storage.root), key=lambda w: -len(w[0])):
        try:
            os.rmdir(folder)
        except OSError:
            pass  # not empty


def dispose_claimed_snapshot(metadata_url: str, owner: CheckpointStorage) -> bool:
    """Delete a snapshot the job in ``owner`` claimed, now that the checkpoint it became is
    subsumed; returns whether anything was deleted. Idempotent (a crash half-way repeats it
    on recovery).

    Step 1. Read the snapshot; gone already: done.
    Step 2. Its marker must name ``owner``; else nothing is deleted (someone released the
        claim by hand, or another job owns it) and a warning is logged.
    Step 3. Delete its files, except files another committed checkpoint of the same root
        references (a claimed ``chk-N`` of another job's directory).
    Step 4. Delete its ``_metadata``, then the marker, a savepoint's job context
        (:data:`~keyedstate.checkpoint.savepoint.CONTEXT_DIR`) and its now empty folders.
    """
    # Step 1. Read it.
    try:
        snapshot = resolve_snapshot(metadata_url, owner.storage_options)
    except NoCheckpointError:
        return False
    storage = snapshot.storage
    # Step 2. Only our own claim is ours to delete.
    owner_url = claim_owner(snapshot)
    if owner_url != root_url(owner):
        logger.warning("not deleting %s: it is claimed by %s, not by this job (%s)",
                       metadata_url, owner_url or "no job", root_url(owner))
        return False
    # Step 3. Its files.
    in_checkpoint_root = posixpath.dirname(snapshot.metadata_path) != ""
    keep = _other_checkpoints_files(storage, snapshot.metadata_path) if in_checkpoint_root \
        else set()
    storage.delete(f.path for f in unique_files(snapshot.metadata) if f.path not in keep)
    # Step 4. _metadata, marker, folders.
    storage.delete([snapshot.metadata_path])
    storage.delete([_marker_path(snapshot)])
    if in_checkpoint_root:
        storage.delete_dir(posixpath.dirname(snapshot.metadata_path))
    else:
        storage.delete_dir(CONTEXT_DIR)
        _remove_empty_dirs(storage)
    logger.info("deleted %s, claimed by %s and now subsumed", metadata_url, root_url(owner))
    return True

