"""Native savepoints: a snapshot's own files, duplicated into one self-contained directory.

A native savepoint holds the state backend's files exactly as a checkpoint wrote them (SST
files and RocksDB's MANIFEST, or heap chain files), never re-encoded. Unlike a checkpoint, whose
shared files sit in the job's ``shared/`` folder and may be used by several checkpoints, a
savepoint owns a copy of everything it needs, in one directory::

    <target>/_metadata          kind=savepoint, format=native; written last, atomically
    <target>/sub-<i>/<file>     the files of subtask i's handle, under their source names
    <target>/_claimed           only while a job that restored it in CLAIM mode owns it

Every reference in ``_metadata`` is relative to ``<target>``: moving or copying the directory
keeps it restorable. keyedstate never deletes a savepoint, except one a job claimed
(:mod:`keyedstate.checkpoint.restore_modes`).

Files are duplicated the cheapest way the storage offers (:func:`duplicate_file`): a hard link
on one local disk, a server-side copy on an object store (S3 ``CopyObject``), a streamed copy
between different filesystems. Taking a savepoint of a running job is duplicating its latest
completed checkpoint, which is exactly its committed state: the job does not stop.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import msgspec
import xxhash

from keyedstate.checkpoint.metadata import (
    METADATA_FILE,
    CheckpointMetadata,
    KeyedStateHandle,
    SnapshotFormat,
    SnapshotKind,
    StreamHandle,
)
from keyedstate.checkpoint.resolve import ResolvedSnapshot, resolve_snapshot
from keyedstate.checkpoint.storage import CheckpointStorage
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    MissingCheckpointFileError,
    SnapshotExistsError,
)

#: ``progress(bytes_done, bytes_total)``, called as files are duplicated or verified.
Progress = Callable[[int, int], None]

#: Properties that only mean something inside the job that wrote them (live-copy tokens, the
#: staged outputs of the batch): never carried into another snapshot root.
JOB_LOCAL_PROPERTIES = ("tokens", "staged")
#: ``_metadata`` property of a savepoint naming the snapshot it was duplicated from.
PROP_SAVEPOINT_OF = "savepoint_of"

_CHUNK = 4 << 20
_REMOTE_WORKERS = 8


def root_url(storage: CheckpointStorage) -> str:
    """The absolute path or URL of a storage root (how one job names another in markers)."""
    return storage.root if storage.is_local else storage.fs.unstrip_protocol(storage.root)


def unique_files(metadata: CheckpointMetadata) -> list[StreamHandle]:
    """Every file ``metadata`` references, once each (a path may appear in several handles,
    always with the same size and checksum, else :class:`CorruptCheckpointError`)."""
    seen: dict[str, StreamHandle] = {}
    for handle in metadata.files():
        known = seen.setdefault(handle.path, handle)
        if (known.size, known.checksum) != (handle.size, handle.checksum):
            raise CorruptCheckpointError(
                f"the snapshot references {handle.path} twice with different sizes or "
                f"checksums; its _metadata is inconsistent. Use another checkpoint or savepoint"
            )
    return list(seen.values())


# -- verification --------------------------------------------------------------------------------

def _checksum_of(storage: CheckpointStorage, handle: StreamHandle) -> tuple[int, str]:
    h = xxhash.xxh64()
    size = 0
    try:
        with storage.fs.open(storage.path(handle.path), "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
    except FileNotFoundError as exc:
        raise MissingCheckpointFileError(
            f"{storage.url_of(handle.path)} is missing; the snapshot is incomplete (a file was "
            f"deleted or the directory copied partly). Restore from another checkpoint or "
            f"savepoint, or copy the missing file back"
        ) from exc
    return size, h.hexdigest()


def verify_snapshot_files(snapshot: ResolvedSnapshot, progress: Progress | None = None) -> None:
    """Check every file of ``snapshot`` against its recorded size and XXH64, reading each once.

    Raises :class:`MissingCheckpointFileError` or :class:`CorruptCheckpointError` naming the
    first bad file. Reads only: call it before any state or file is touched, so a restore from
    a damaged savepoint fails before it starts. Files of a remote snapshot are read in
    parallel.
    """
    storage = snapshot.storage
    files = unique_files(snapshot.metadata)
    total = sum(f.size for f in files)
    done = 0

    def check(handle: StreamHandle) -> StreamHandle:
        size, checksum = _checksum_of(storage, handle)
        if (size, checksum) != (handle.size, handle.checksum):
            raise CorruptCheckpointError(
                f"{storage.url_of(handle.path)} is altered: {size} bytes with checksum "
                f"{checksum}, the snapshot recorded {handle.size} bytes with checksum "
                f"{handle.checksum}. Restore from another checkpoint or savepoint"
            )
        return handle

    if storage.is_local:
        results = map(check, files)
        for handle in results:
            done += handle.size
            if progress:
                progress(done, total)
        return
    with ThreadPoolExecutor(_REMOTE_WORKERS) as pool:
        for handle in pool.map(check, files):
            done += handle.size
            if progress:
                progress(done, total)


# -- duplication ---------------------------------------------------------------------------------

def _same_filesystem(a: CheckpointStorage, b: CheckpointStorage) -> bool:
    return a.fs is b.fs or (type(a.fs) is type(b.fs)
                            and a.storage_options == b.storage_options)


def duplicate_file(source: CheckpointStorage, source_path: str, target: CheckpointStorage,
                   target_path: str, size: int) -> str:
    """Duplicate one file (relative paths in each root) without re-encoding it; returns how:
    ``"link"`` (hard link, one local disk), ``"copy"`` (local copy when linking is not
    possible: another device, or a filesystem without links), ``"server-copy"`` (the object
    store copies, e.g. S3 ``CopyObject``; no byte passes through this process) or
    ``"stream"`` (between different filesystems). An existing target file is replaced (a
    retried, interrupted duplication). The target's size is checked; its checksum is the
    source's, checked on restore."""
    src = source.path(source_path)
    dst = target.path(target_path)
    target.fs.makedirs(posixpath.dirname(dst), exist_ok=True)
    try:
        if source.is_local and target.is_local:
            if os.path.lexists(dst):
                os.remove(dst)
            try:
                os.link(src, dst)
                how = "link"
            except OSError as exc:
                if not os.path.exists(src):
                    raise FileNotFoundError(src) from exc
                shutil.copyfile(src, dst)
                how = "copy"
        elif _same_filesystem(source, target):
            target.fs.copy(src, dst)
            how = "server-copy"
        else:
            with source.fs.open(src, "rb") as r, target.fs.open(dst, "wb") as w:
                shutil.copyfileobj(r, w, _CHUNK)
            how = "stream"
    except FileNotFoundError as exc:
        raise MissingCheckpointFileError(
            f"{source.url_of(source_path)} is missing; the snapshot is incomplete. Use another "
            f"checkpoint or savepoint"
        ) from exc
    written = int(target.fs.size(dst))
    if written != size:
        raise CorruptCheckpointError(
            f"duplicating {source.url_of(source_path)} to {target.url_of(target_path)} gave "
            f"{written} bytes, the snapshot recorded {size}; the source is altered or the copy "
            f"failed. Retry, or use another checkpoint"
        )
    return how


def relocate_handles(metadata: CheckpointMetadata,
                     new_path: Callable[[KeyedStateHandle, str, StreamHandle], str]
                     ) -> tuple[list[KeyedStateHandle], dict[str, str]]:
    """The handles of ``metadata`` with every file path replaced by
    ``new_path(handle, kind, file)`` (``kind`` is ``"shared"`` or ``"private"``) and
    ``incremental_size`` set to ``full_size``, and the mapping old path -> new path. A path referenced twice keeps its first new path; two
    different files never get the same new path (a numeric suffix separates them)."""
    mapping: dict[str, str] = {}
    taken: set[str] = set()

    def place(handle: KeyedStateHandle, kind: str, stream: StreamHandle) -> StreamHandle:
        if stream.path not in mapping:
            wanted = candidate = new_path(handle, kind, stream)
            n = 1
            while candidate in taken:
                candidate, n = f"{wanted}-{n}", n + 1
            mapping[stream.path] = candidate
            taken.add(candidate)
        return StreamHandle(mapping[stream.path], stream.size, stream.checksum)

    # Every file is new in its new root: what the snapshot "wrote" there is all of it.
    handles = [
        msgspec.structs.replace(
            h, shared={n: place(h, "shared", s) for n, s in h.shared.items()},
            private={n: place(h, "private", s) for n, s in h.private.items()},
            incremental_size=h.full_size)
        for h in metadata.handles
    ]
    return handles, mapping


def duplicate_all(source: CheckpointStorage, target: CheckpointStorage,
                  mapping: Mapping[str, str], sizes: Mapping[str, int],
                  progress: Progress | None = None) -> dict[str, int]:
    """Duplicate every ``source path -> target path`` of ``mapping``; returns how many files
    went each way (``{"link": 12, ...}``). Remote copies run in parallel."""
    total = sum(sizes[p] for p in mapping)
    done = 0
    counts: dict[str, int] = {}

    def one(item: tuple[str, str]) -> tuple[str, str]:
        return item[0], duplicate_file(source, item[0], target, item[1], sizes[item[0]])

    workers = 1 if source.is_local and target.is_local else _REMOTE_WORKERS
    with ThreadPoolExecutor(workers) as pool:
        for path, how in pool.map(one, sorted(mapping.items())):
            counts[how] = counts.get(how, 0) + 1
            done += sizes[path]
            if progress:
                progress(done, total)
    return counts


# -- savepoints ----------------------------------------------------------------------------------

def _savepoint_path(handle: KeyedStateHandle, kind: str, stream: StreamHandle) -> str:
    return f"sub-{handle.subtask_index}/{posixpath.basename(stream.path)}"


def check_savepoint_target(target: CheckpointStorage) -> None:
    """Raise :class:`SnapshotExistsError` if ``target`` already holds a snapshot."""
    if target.exists(METADATA_FILE):
        raise SnapshotExistsError(
            f"{target.url_of(METADATA_FILE)} exists: {target.url} already holds a savepoint, and "
            f"keyedstate never overwrites one. Choose a new directory (or delete that savepoint "
            f"yourself if you no longer need it)"
        )


def write_native_savepoint(source: ResolvedSnapshot, target: str,
                           storage_options: Mapping[str, Any] | None = None, *,
                           progress: Progress | None = None) -> str:
    """Write a native savepoint of ``source`` (a resolved checkpoint or savepoint) into the
    directory ``target``; returns the absolute path or URL of its ``_metadata``.

    Step 1. Refuse, before writing anything: a ``target`` holding a savepoint
        (:class:`SnapshotExistsError`), a canonical ``source`` (its files are not a backend's
        native files) and a ``target`` that is the source's own root.
    Step 2. Plan: every file of subtask i goes to ``sub-<i>/<its file name>``.
    Step 3. Duplicate every file (:func:`duplicate_file`; sizes checked).
    Step 4. Write ``_metadata`` (kind savepoint, format native, the handles' paths rewritten)
        atomically: the savepoint exists exactly when this returns. An interrupted run leaves
        files without ``_metadata``, which a retry into the same target replaces.

    The source must stay as it is while this runs (a running job: hold off subsumption, as
    :meth:`keyedstate.spark.job.KeyedJobDriver.savepoint` does).
    """
    storage = CheckpointStorage(target, storage_options)
    metadata = source.metadata
    # Step 1. Refusals.
    check_savepoint_target(storage)
    if metadata.format is not SnapshotFormat.NATIVE:
        raise ConfigurationError(
            f"{source.storage.url_of(source.metadata_path)} is a {metadata.format} savepoint; a "
            f"native savepoint is made from a checkpoint or a native savepoint. Copy the "
            f"directory instead, or restore it and take a native savepoint of that job"
        )
    if root_url(storage) == root_url(source.storage):
        raise ConfigurationError(
            f"{target} is the source snapshot's own directory; write the savepoint to a new "
            f"directory"
        )
    # Step 2. Plan the layout.
    handles, mapping = relocate_handles(metadata, _savepoint_path)
    sizes = {f.path: f.size for f in unique_files(metadata)}
    # Step 3. Duplicate.
    duplicate_all(source.storage, storage, mapping, sizes, progress)
    # Step 4. Commit.
    properties = {k: v for k, v in metadata.properties.items() if k not in JOB_LOCAL_PROPERTIES}
    properties[PROP_SAVEPOINT_OF] = source.storage.url_of(source.metadata_path)
    savepoint = msgspec.structs.replace(
        metadata, timestamp_ms=time.time_ns() // 1_000_000, handles=handles,
        kind=SnapshotKind.SAVEPOINT, format=SnapshotFormat.NATIVE, properties=properties)
    return storage.url_of(storage.write_metadata(savepoint, METADATA_FILE))


def create_native_savepoint(source_snapshot_path: str, target: str,
                            storage_options: Mapping[str, Any] | None = None, *,
                            progress: Progress | None = None) -> str:
    """A native savepoint, taken offline, of the snapshot at ``source_snapshot_path`` (a job's
    checkpoint directory: its latest checkpoint; a ``chk-N`` folder; a savepoint folder; or a
    ``_metadata`` file), written to ``target``; returns the path or URL of its ``_metadata``.
    See :func:`write_native_savepoint`."""
    source = resolve_snapshot(source_snapshot_path, storage_options)
    return write_native_savepoint(source, target, storage_options, progress=progress)
