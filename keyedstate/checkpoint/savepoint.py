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

import json
import os
import posixpath
import shutil
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

import msgspec
import xxhash

from keyedstate.checkpoint.properties import CONTEXT, SAVEPOINT_OF, portable_properties
from keyedstate.checkpoint.resolve import ResolvedSnapshot, resolve_snapshot
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    MissingCheckpointFileError,
    SnapshotExistsError,
    TargetNotEmptyError,
)
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.duplication import duplicate_object
from keyedstate.storage.handles import (
    CheckpointMetadata,
    KeyedStateHandle,
    SnapshotFormat,
    SnapshotKind,
    StreamHandle,
)
from keyedstate.storage.layout import METADATA_FILE
from keyedstate.storage.transfer import (
    TransferStats,
    parallel_map,
    strip_transfer_properties,
)

#: ``progress(bytes_done, bytes_total)``, called as files are duplicated or verified.
Progress = Callable[[int, int], None]
#: What a savepoint carries besides the state (a runtime's job context: its sources'
#: positions, output not yet committed): called with the savepoint's storage after the state's
#: files are in and before ``_metadata`` is written; writes its files under
#: :data:`CONTEXT_DIR` (paths relative to the savepoint, so it stays relocatable) and returns
#: the ``_metadata`` properties naming them.
Attach = Callable[[CheckpointStorage], Mapping[str, str]]
#: Where a savepoint keeps the job context an :data:`Attach` wrote; deleted with a claimed
#: savepoint.
CONTEXT_DIR = "context"

_CHUNK = 4 << 20
_REMOTE_WORKERS = 8


def attach_context(attach: Attach | None, storage: CheckpointStorage) -> dict[str, str]:
    """Run ``attach`` into the savepoint ``storage``; its properties, with :data:`CONTEXT`
    naming them."""
    if attach is None:
        return {}
    attached = dict(attach(storage))
    return {**attached, CONTEXT: json.dumps(sorted(attached))} if attached else {}


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

#: What a damaged snapshot's error advises by default (a caller that knows better passes its
#: own ``remedy`` to :func:`verify_snapshot_files`).
RESTORE_ELSEWHERE = "Restore from another checkpoint or savepoint"


def _checksum_of(storage: CheckpointStorage, handle: StreamHandle, remedy: str
                 ) -> tuple[int, str]:
    h = xxhash.xxh64()
    size = 0
    try:
        with storage.fs.open(storage.path(handle.path), "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
    except FileNotFoundError as exc:
        raise _missing(storage, handle, remedy) from exc
    return size, h.hexdigest()


def _missing(storage: CheckpointStorage, handle: StreamHandle, remedy: str
             ) -> MissingCheckpointFileError:
    copy_back = (", or copy the missing file back" if remedy == RESTORE_ELSEWHERE else "")
    return MissingCheckpointFileError(
        f"{storage.url_of(handle.path)} is missing; the snapshot is incomplete (a file was "
        f"deleted or the directory copied partly). {remedy}{copy_back}"
    )


def _altered(storage: CheckpointStorage, handle: StreamHandle, size: int,
             checksum: str | None, remedy: str) -> CorruptCheckpointError:
    found = f"{size} bytes" + ("" if checksum is None else f" with checksum {checksum}")
    return CorruptCheckpointError(
        f"{storage.url_of(handle.path)} is altered: {found}, the snapshot recorded "
        f"{handle.size} bytes with checksum {handle.checksum}. {remedy}"
    )


def verify_snapshot_files(snapshot: ResolvedSnapshot, progress: Progress | None = None, *,
                          checksums: bool | None = None,
                          remedy: str = RESTORE_ELSEWHERE) -> None:
    """Check every object of ``snapshot`` before anything is touched: it exists and has its
    recorded size and, with ``checksums``, its recorded XXH64.

    ``checksums`` None (the default) reads and hashes every file only on a local disk; on an
    object store it checks existence and size from listings (one request per folder, in
    parallel), so no byte of the state passes through this process. The checksum of every
    file is then verified where its bytes are read anyway: when a backend downloads it to
    restore, before any state is used (``docs/object-storage.md``).

    Raises :class:`MissingCheckpointFileError` or :class:`CorruptCheckpointError` naming the
    first bad file and ending with ``remedy`` (what to do about it); reads only. Hashed files are noted on ``snapshot.storage``
    (:meth:`~keyedstate.storage.checkpoint_storage.CheckpointStorage.note_verified`): the restores
    that hard-link them then check their sizes only.
    """
    storage = snapshot.storage
    files = unique_files(snapshot.metadata)
    total = sum(f.size for f in files)
    if checksums is None:
        checksums = storage.is_local
    if not checksums:
        sizes = storage.sizes([f.path for f in files])
        done = 0
        for handle in files:
            found = sizes[handle.path]
            if found is None:
                raise _missing(storage, handle, remedy)
            if found != handle.size:
                raise _altered(storage, handle, found, None, remedy)
            done += handle.size
            if progress:
                progress(done, total)
        return
    done = 0

    def check(handle: StreamHandle) -> StreamHandle:
        size, checksum = _checksum_of(storage, handle, remedy)
        if (size, checksum) != (handle.size, handle.checksum):
            raise _altered(storage, handle, size, checksum, remedy)
        return handle

    for handle in parallel_map(check, files, storage.request_threads):
        done += handle.size
        if progress:
            progress(done, total)
    storage.note_verified(files)


# -- duplication ---------------------------------------------------------------------------------

def duplicate_file(source: CheckpointStorage, source_path: str, target: CheckpointStorage,
                   target_path: str, size: int) -> str:
    """Duplicate one file (relative paths in each root) without re-encoding it; returns how:
    ``"link"`` (hard link, one local disk), ``"copy"`` / ``"reflink"`` (local copy when linking
    is not possible: another device, or a filesystem without links), ``"server-copy"`` (the
    object store copies, e.g. S3 ``CopyObject``; no byte passes through this process) or
    ``"stream"`` (between different filesystems). See
    :func:`keyedstate.storage.duplication.duplicate_object`."""
    return duplicate_object(source, source_path, target, target_path, size)


def relocate_handles(metadata: CheckpointMetadata,
                     new_path: Callable[[KeyedStateHandle, str, StreamHandle], str]
                     ) -> tuple[list[KeyedStateHandle], dict[str, str]]:
    """The handles of ``metadata`` with every object path replaced by
    ``new_path(handle, kind, file)`` (``kind`` is ``"shared"`` or ``"private"``),
    ``incremental_size`` set to ``full_size`` and the transfer counts dropped, and the mapping
    old path -> new path. A path referenced twice (a merged object's segments too) keeps its
    first new path; two different objects never get the same new path (a numeric suffix
    separates them). Inline files stay as they are."""
    mapping: dict[str, str] = {}
    taken: set[str] = set()

    def place(handle: KeyedStateHandle, kind: str, stream: StreamHandle) -> StreamHandle:
        if stream.data is not None:
            return stream
        if stream.path not in mapping:
            wanted = candidate = new_path(handle, kind, stream)
            n = 1
            while candidate in taken:
                candidate, n = f"{wanted}-{n}", n + 1
            mapping[stream.path] = candidate
            taken.add(candidate)
        return msgspec.structs.replace(stream, path=mapping[stream.path])

    # Every file is new in its new root: what the snapshot "wrote" there is all of it.
    handles = [
        msgspec.structs.replace(
            h, shared={n: place(h, "shared", s) for n, s in h.shared.items()},
            private={n: place(h, "private", s) for n, s in h.private.items()},
            incremental_size=h.full_size,
            properties=strip_transfer_properties(h.properties))
        for h in metadata.handles
    ]
    return handles, mapping


def duplicate_all(source: CheckpointStorage, target: CheckpointStorage,
                  mapping: Mapping[str, str], sizes: Mapping[str, int],
                  progress: Progress | None = None,
                  stats: TransferStats | None = None) -> dict[str, int]:
    """Duplicate every ``source path -> target path`` of ``mapping``; returns how many files
    went each way (``{"link": 12, ...}``) and counts the bytes in ``stats``. Remote copies run
    in parallel (``target.transfer.threads``)."""
    total = sum(sizes[p] for p in mapping)
    done = 0
    counts: dict[str, int] = {}

    def one(item: tuple[str, str]) -> tuple[str, str]:
        return item[0], duplicate_object(source, item[0], target, item[1], sizes[item[0]],
                                         stats=stats)

    local = source.is_local and target.is_local
    workers = 1 if local else max(target.transfer.threads, _REMOTE_WORKERS)
    for path, how in parallel_map(one, sorted(mapping.items()), workers):
        counts[how] = counts.get(how, 0) + 1
        done += sizes[path]
        if progress:
            progress(done, total)
    return counts


# -- savepoints ----------------------------------------------------------------------------------

def _savepoint_path(handle: KeyedStateHandle, kind: str, stream: StreamHandle) -> str:
    return f"sub-{handle.subtask_index}/{posixpath.basename(stream.path)}"


def check_savepoint_target(target: CheckpointStorage) -> None:
    """The one rule for where a snapshot is written (native and canonical savepoints, from
    every API and the command line): ``target`` must not exist yet, or be an empty directory
    (on an object store: a prefix without objects). Reads only.

    Raises :class:`SnapshotExistsError` if it holds a snapshot (a ``_metadata``) and
    :class:`TargetNotEmptyError` if it holds anything else (another job's checkpoint
    directory, an interrupted write's files, anything) or is a file: a savepoint written there
    would mix with files keyedstate did not write, which a later write or a clean-up on failure
    could replace or delete."""
    fs, root = target.fs, target.root
    if not target.call(f"checking {target.url}", lambda: fs.exists(root)):
        return
    if target.call(f"checking {target.url}", lambda: fs.isfile(root)):
        raise TargetNotEmptyError(
            f"{target.url} is a file; a savepoint is a directory of its own. Choose a new "
            f"directory")
    listed = target.call(f"listing {target.url}",
                         lambda: fs.ls(root, detail=False, refresh=True))
    # An object store may list a folder's own marker object: it is not content.
    entries = sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed
                     if str(p).rstrip("/") != root.rstrip("/"))
    if not entries:
        return
    if METADATA_FILE in entries:
        raise SnapshotExistsError(
            f"{target.url_of(METADATA_FILE)} exists: {target.url} already holds a savepoint, and "
            f"keyedstate never overwrites one. Choose a new directory (or delete that savepoint "
            f"yourself if you no longer need it)"
        )
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3
                                      else "")
    raise TargetNotEmptyError(
        f"{target.url} is not empty ({shown}); a savepoint is written only into a new or empty "
        f"directory, so that nothing in it is replaced or deleted. Choose a new directory (a "
        f"directory an interrupted savepoint left behind: delete it yourself first)"
    )


def _first_missing_dir(storage: CheckpointStorage) -> str | None:
    """On a local disk, the outermost directory of ``storage``'s root that does not exist yet
    (what a write into it creates); None if the root exists or elsewhere (no directories)."""
    if not storage.is_local:
        return None
    path, missing = os.path.abspath(storage.root), None
    while not os.path.lexists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


@contextmanager
def new_snapshot_target(target: CheckpointStorage) -> Iterator[None]:
    """Write a snapshot into ``target`` inside this block: on entry the target is checked
    (:func:`check_savepoint_target`: new or empty); if the block raises, everything under it is
    deleted again (it was empty, so all of it is this write's), and on a local disk the
    directories the write created too, so a failed write leaves the target as it found it.

    Two writers racing for one new target are not told apart: don't point two at once at the
    same directory."""
    check_savepoint_target(target)
    created = _first_missing_dir(target)
    try:
        yield
    except BaseException:
        _discard(target, created)
        raise


def _discard(target: CheckpointStorage, created: str | None) -> None:
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
    elif target.is_local:
        root = target.root
        for name in os.listdir(root) if os.path.isdir(root) else []:
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
    else:
        target.delete(target.list_files())


def check_outside_source(source: ResolvedSnapshot, target: CheckpointStorage) -> None:
    """Refuse (:class:`ConfigurationError`) a ``target`` that is the source snapshot's own
    directory or lies inside it: deleting the source (a subsumed checkpoint, ``gc``, a claimed
    savepoint) would delete the savepoint too."""
    src, dst = root_url(source.storage).rstrip("/"), root_url(target).rstrip("/")
    if dst == src:
        raise ConfigurationError(
            f"{target.url} is the source snapshot's own directory; write the savepoint to a new "
            f"directory"
        )
    if dst.startswith(src + "/"):
        raise ConfigurationError(
            f"{target.url} lies inside the source snapshot's own directory {src}: removing that "
            f"snapshot (or the job's clean-up of it) would remove the savepoint too. Write the "
            f"savepoint to a directory of its own"
        )


def write_native_savepoint(source: ResolvedSnapshot, target: str,
                           storage_options: Mapping[str, Any] | None = None, *,
                           progress: Progress | None = None, attach: Attach | None = None) -> str:
    """Write a native savepoint of ``source`` (a resolved checkpoint or savepoint) into the
    directory ``target``; returns the absolute path or URL of its ``_metadata``.

    Step 1. Refuse, before writing anything: a ``target`` that is the source's own root or
        lies inside it, a canonical ``source`` (its files are not a backend's native files),
        and a ``target`` that is neither new nor empty (:func:`check_savepoint_target`:
        :class:`SnapshotExistsError`, :class:`TargetNotEmptyError`).
    Step 2. Verify the source's files (:func:`verify_snapshot_files`, as a restore does: on a
        local disk every file against its size and XXH64, on an object store its size), so a
        damaged source fails here, naming the file, not when the savepoint is restored.
    Step 3. Plan: every file of subtask i goes to ``sub-<i>/<its file name>``.
    Step 4. Duplicate every file (:func:`duplicate_file`; sizes checked), then let
        ``attach`` add the job context it carries.
    Step 5. Write ``_metadata`` (kind savepoint, format native, the handles' paths rewritten)
        atomically: the savepoint exists exactly when this returns. If any step after the
        refusals fails, everything written under ``target`` is deleted again, and the
        directories the write created (:func:`new_snapshot_target`); only a killed process
        leaves files without ``_metadata``, and the target is then refused until the user
        deletes them.

    The source must stay as it is while this runs (a running job: hold off subsumption, as
    :meth:`keyedstate.spark.driver.KeyedJobDriver.savepoint` does).
    """
    storage = CheckpointStorage(target, storage_options)
    metadata = source.metadata
    # Step 1. Refusals.
    check_outside_source(source, storage)
    if metadata.format is not SnapshotFormat.NATIVE:
        raise ConfigurationError(
            f"{source.storage.url_of(source.metadata_path)} is a {metadata.format} savepoint; a "
            f"native savepoint is made from a checkpoint or a native savepoint. Copy the "
            f"directory instead, or restore it and take a native savepoint of that job"
        )
    with new_snapshot_target(storage):
        # Step 2. Verify the source: a savepoint of damaged files would fail only when restored.
        verify_snapshot_files(source, progress)
        # Step 3. Plan the layout.
        handles, mapping = relocate_handles(metadata, _savepoint_path)
        sizes = {f.path: f.size for f in unique_files(metadata)}
        # Step 4. Duplicate (the store copies; bytes through this process are counted).
        stats = TransferStats()
        duplicate_all(source.storage, storage, mapping, sizes, progress, stats)
        attached = attach_context(attach, storage)
        # Step 5. Commit, with what it cost.
        properties = portable_properties(metadata.properties)
        properties.update(attached)
        properties[SAVEPOINT_OF] = source.storage.url_of(source.metadata_path)
        properties.update(stats.to_properties())
        savepoint = msgspec.structs.replace(
            metadata, timestamp_ms=time.time_ns() // 1_000_000, handles=handles,
            kind=SnapshotKind.SAVEPOINT, format=SnapshotFormat.NATIVE, properties=properties)
        return storage.url_of(storage.write_metadata(savepoint, METADATA_FILE))


def create_native_savepoint(source_snapshot_path: str, target: str,
                            storage_options: Mapping[str, Any] | None = None, *,
                            progress: Progress | None = None, attach: Attach | None = None
                            ) -> str:
    """A native savepoint, taken offline, of the snapshot at ``source_snapshot_path`` (a job's
    checkpoint directory: its latest checkpoint; a ``chk-N`` folder; a savepoint folder; or a
    ``_metadata`` file), written to ``target``; returns the path or URL of its ``_metadata``.
    See :func:`write_native_savepoint`."""
    source = resolve_snapshot(source_snapshot_path, storage_options)
    return write_native_savepoint(source, target, storage_options, progress=progress,
                                  attach=attach)
