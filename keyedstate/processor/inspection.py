"""Looking into snapshots without changing them: listings, per-state sizes, garbage.

What ``keyedstate checkpoints list|show`` and ``keyedstate gc`` print. Everything here reads
only, except :func:`delete_garbage`, which deletes exactly the files a
:func:`find_garbage` report lists.

**Per-state sizes** are computed from the snapshot files, not recorded at snapshot time (the
backends' handles record bytes per file, not per state):

- ``rocksdb``: every state is a column family; its size is RocksDB's
  ``rocksdb.total-sst-files-size`` for that column family, read by opening each subtask's files
  read-only (symbolic links on a local disk, a download otherwise), summed over the RocksDB
  instances of a subtask that has several;
- ``heap``: every file's footer indexes its sections per state and key group; a state's size is
  the sum of its sections' lengths over the chain (full file and diffs);
- what no state owns (RocksDB's MANIFEST and OPTIONS, heap footers) is ``(other files)``, so the
  sizes add up to ``full_bytes``. Timers are the states ``_timers_event`` and ``_timers_proc``.

**Garbage** (:func:`find_garbage`, read-only, safe on the directory of a running job): files no
committed checkpoint references, under the layout keyedstate owns, and only those that can't
belong to work in flight:

- ``shared/chk-<N>-*`` and ``chk-<N>/``: unreferenced files of checkpoints up to the latest
  committed id (a pending checkpoint always has a higher id; ids only grow). A file under
  ``shared/`` without a checkpoint id in its name is not the layout's (e.g. a restored
  snapshot's the job does not own): never listed;
- ``staging/batch-<B>/`` (Spark jobs): staged outputs of batches up to the latest committed
  batch that no committed checkpoint still waits to commit (a checkpoint waits while its
  ``commits/`` marker is missing);
- ``commits/batch-<B>-chk-<N>``: sink-commit markers of checkpoints older than every committed
  one (the driver only ever consults the latest checkpoint's marker);
- never: ``_metadata`` files and what they reference, claim markers, ``taskowned/``, Spark's
  ``spark/`` offsets, or anything else outside the layout. A root with an unreadable committed
  ``_metadata`` is refused (what it references is unknown).

On a running job the checkpoints may move on while gc reads: a checkpoint subsumed between the
listing and the read of its ``_metadata`` is left out (the coordinator deletes its files), and
a candidate deleted meanwhile is not reported. Neither can make gc list a file a newer
checkpoint needs: those carry a higher id, or are referenced by a checkpoint read here.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from keyedstate.backends import backend_names, load_backend
from keyedstate.checkpoint.properties import BATCH_ID, STAGED
from keyedstate.checkpoint.resolve import ResolvedSnapshot, resolve_snapshot
from keyedstate.checkpoint.savepoint import unique_files, verify_snapshot_files
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    KeyedStateError,
    MissingCheckpointFileError,
    NoCheckpointError,
    UnsafePathError,
    UnsupportedFormatVersionError,
)
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import (
    CheckpointMetadata,
    SnapshotFormat,
    SnapshotKind,
    StreamHandle,
)
from keyedstate.storage.layout import (
    ASYNC_MARKER_FILE,
    CLAIM_MARKER_FILE,
    COMMITS_DIR,
    COMPLETED_MARKER_FILE,
    METADATA_FILE,
    SHARED_DIR,
    SPARK_OFFSETS_DIR,
    STAGING_DIR,
    TASK_OWNED_DIR,
    batch_id_of_staged_file,
    checkpoint_dir_name,
    checkpoint_id_of_commit_marker,
    checkpoint_id_of_shared_file,
    commit_marker,
)
from keyedstate.storage.transfer import RESTORE_PREFIX, TransferStats

# -- listings ------------------------------------------------------------------------------------

def _batch_id(metadata: CheckpointMetadata) -> int | None:
    value = metadata.properties.get(BATCH_ID)
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def describe(snapshot: ResolvedSnapshot) -> dict[str, Any]:
    """The listing object of one snapshot: ``id``, ``kind``, ``format``, ``batch_id``,
    ``timestamp_ms``, ``parallelism``, ``max_parallelism``, ``backend``, ``key_types``,
    ``incremental_bytes``, ``full_bytes``, ``metadata`` (its ``_metadata``) and ``files``:
    every file it references, as an absolute path or URL, sorted."""
    storage, metadata = snapshot.storage, snapshot.metadata
    return {
        "id": metadata.checkpoint_id,
        "kind": str(metadata.kind),
        "format": str(metadata.format),
        BATCH_ID: _batch_id(metadata),
        "timestamp_ms": metadata.timestamp_ms,
        "parallelism": metadata.parallelism,
        "max_parallelism": metadata.max_parallelism,
        "backend": metadata.backend,
        "key_types": list(metadata.key_types),
        "incremental_bytes": metadata.incremental_size,
        "full_bytes": metadata.full_size,
        "metadata": storage.url_of(snapshot.metadata_path),
        "files": sorted(storage.url_of(f.path) for f in unique_files(metadata)),
    }


#: The fields of a :func:`list_checkpoints` entry, readable or not (an unreadable one has
#: ``id``, ``metadata`` and ``error``, every other field None).
LISTING_FIELDS = ("id", "kind", "format", BATCH_ID, "timestamp_ms", "parallelism",
                  "max_parallelism", "backend", "key_types", "incremental_bytes", "full_bytes",
                  "metadata", "files", "error")

#: Names only a job's checkpoint directory holds (storage/layout.py): a directory with none of
#: them and something else in it is not one.
_JOB_DIRECTORY_NAMES = (SHARED_DIR, STAGING_DIR, COMMITS_DIR, TASK_OWNED_DIR,
                        COMPLETED_MARKER_FILE, ASYNC_MARKER_FILE, SPARK_OFFSETS_DIR)


def job_directory(directory: str, storage_options: Mapping[str, Any] | None = None,
                  *, what: str) -> CheckpointStorage:
    """The storage of ``directory`` once it is known to be a job's checkpoint directory (or a
    snapshot folder, which holds ``_metadata``): ``what`` (e.g. "no checkpoints to list") ends
    the message of the :class:`NoCheckpointError` raised for a path that does not exist, a
    file (a ``_metadata`` file included), or a non-empty directory that holds none of a job's
    layout (e.g. the parent of a checkpoint directory). An empty directory passes: a job that
    has not completed a checkpoint yet."""
    storage = CheckpointStorage(directory, storage_options)
    fs, root = storage.fs, storage.root
    if not storage.call(f"checking {storage.url}", lambda: fs.exists(root)):
        raise NoCheckpointError(f"{directory} does not exist: {what}")
    if storage.call(f"checking {storage.url}", lambda: fs.isfile(root)):
        hint = (f"; point at its job's checkpoint directory, "
                f"{directory.rstrip('/').rsplit('/', 2)[0]}"
                if directory.rstrip("/").endswith("/" + METADATA_FILE) else "")
        raise NoCheckpointError(f"{directory} is a file, not a checkpoint directory: "
                                f"{what}{hint}")
    if storage.exists(METADATA_FILE) or storage.checkpoint_dir_ids():
        return storage
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in storage.call(
        f"listing {storage.url}", lambda: fs.ls(root, detail=False))}
    if names and not names & set(_JOB_DIRECTORY_NAMES):
        raise NoCheckpointError(
            f"{directory} is not a job's checkpoint directory (no chk-N, no _metadata, none "
            f"of {', '.join(_JOB_DIRECTORY_NAMES)}): {what}; point at the directory a job's "
            f"execution.checkpointing.dir names")
    return storage


def unreadable_entry(checkpoint_id: int, metadata: str, error: str) -> dict[str, Any]:
    """The :func:`list_checkpoints` entry of a checkpoint whose ``_metadata`` can't be read:
    the fields of a readable one (:data:`LISTING_FIELDS`), None but ``id``, ``metadata`` and
    ``error``."""
    return {**dict.fromkeys(LISTING_FIELDS), "id": checkpoint_id, "metadata": metadata,
            "error": error}


def list_checkpoints(directory: str, storage_options: Mapping[str, Any] | None = None
                     ) -> list[dict[str, Any]]:
    """One :func:`describe` object per committed checkpoint of a job's checkpoint directory,
    ascending by id, each with ``error`` None (for a savepoint or ``chk-N`` directory, or a
    ``_metadata`` file: that snapshot). A checkpoint whose ``_metadata`` can't be read is
    listed with the same fields (:func:`unreadable_entry`), ``error`` saying why. A path that
    is not a checkpoint directory raises :class:`NoCheckpointError` (:func:`job_directory`;
    an empty directory lists nothing)."""
    if directory.rstrip("/").endswith("/" + METADATA_FILE):
        return [{**describe(resolve_snapshot(directory, storage_options)), "error": None}]
    storage = job_directory(directory, storage_options, what="no checkpoints to list")
    if storage.exists(METADATA_FILE):
        return [{**describe(resolve_snapshot(directory, storage_options)), "error": None}]
    out: list[dict[str, Any]] = []
    for checkpoint_id in storage.checkpoint_ids():
        path = storage.metadata_path(checkpoint_id)
        try:
            out.append({**describe(ResolvedSnapshot(storage, path, storage.read_metadata(path))),
                        "error": None})
        except (CorruptCheckpointError, UnsafePathError, UnsupportedFormatVersionError) as exc:
            out.append(unreadable_entry(checkpoint_id, storage.url_of(path),
                                        f"{type(exc).__name__}: {exc}"))
    return out


def _file_json(storage: CheckpointStorage, stream: StreamHandle) -> dict[str, Any]:
    """One file reference, the same fields for every kind: ``path`` (None for a file inline
    in ``_metadata``), ``size`` and ``checksum`` of the file itself, ``inline``, and for a
    segment of a merged object its ``offset`` and ``object_size`` (None otherwise)."""
    if stream.data is not None:
        return {"path": None, "size": stream.size, "checksum": stream.checksum, "inline": True,
                "offset": None, "object_size": None}
    merged = stream.segment is not None
    return {"path": storage.url_of(stream.path), "size": stream.length,
            "checksum": stream.digest, "inline": False,
            "offset": stream.segment.offset if stream.segment is not None else None,
            "object_size": stream.size if merged else None}


#: The transfer figures ``show`` reports, in order (see :class:`TransferStats`).
TRANSFER_FIELDS = ("uploaded_bytes", "uploaded_objects", "downloaded_bytes",
                   "downloaded_objects", "duplicated_bytes", "duplicated_objects",
                   "inlined_bytes", "inlined_files", "merged_files", "cache_hit_bytes",
                   "cache_hit_files", "retries")


def transfer_summary(metadata: CheckpointMetadata) -> dict[str, Any]:
    """What producing ``metadata`` moved, from the counts recorded in it: ``snapshot`` (what
    the snapshot itself uploaded, duplicated server-side, inlined: the subtasks' handles plus
    the driver's share, e.g. a savepoint's duplication) and ``restore`` (what the restores
    before it downloaded or took from executors' file caches; a CLAIM's duplication), each a
    dict of :data:`TRANSFER_FIELDS`, plus ``objects`` / ``inline_files`` / ``merged_objects``:
    how the snapshot's files are stored."""
    snapshot = TransferStats.from_properties(metadata.properties)
    restore = TransferStats.from_properties(metadata.properties, RESTORE_PREFIX)
    for handle in metadata.handles:
        snapshot.merge(TransferStats.from_properties(handle.properties))
        restore.merge(TransferStats.from_properties(handle.properties, RESTORE_PREFIX))
    streams = [s for h in metadata.handles for s in h.streams()]
    return {
        "snapshot": {k: getattr(snapshot, k) for k in TRANSFER_FIELDS},
        "restore": {k: getattr(restore, k) for k in TRANSFER_FIELDS},
        "objects": len(unique_files(metadata)),
        "inline_files": sum(1 for s in streams if s.data is not None),
        "merged_objects": len({s.path for s in streams if s.segment is not None}),
    }


def show(path: str, storage_options: Mapping[str, Any] | None = None, *,
         state_sizes: bool = True) -> dict[str, Any]:
    """:func:`describe` of the snapshot at ``path`` plus its ``properties``, ``transfer``
    (:func:`transfer_summary`: bytes uploaded, downloaded and duplicated server-side), one
    object per subtask handle under ``subtasks`` (key groups, bytes, states, every file with
    size and checksum, its transfer counts) and ``states``: each state's meta info and ``bytes`` (computed, see the module
    docstring; None with ``state_sizes=False`` or for a canonical savepoint), with
    ``state_sizes`` saying how they were obtained."""
    snapshot = resolve_snapshot(path, storage_options)
    storage, metadata = snapshot.storage, snapshot.metadata
    out = describe(snapshot)
    out["properties"] = dict(metadata.properties)
    out["transfer"] = transfer_summary(metadata)
    out["subtasks"] = [{
        "index": h.subtask_index,
        "key_group_start": h.key_group_start,
        "key_group_end": h.key_group_end,
        "checkpoint_id": h.checkpoint_id,
        "incremental_bytes": h.incremental_size,
        "full_bytes": h.full_size,
        "states": [s.name for s in h.states],
        "shared": {n: _file_json(storage, s) for n, s in sorted(h.shared.items())},
        "private": {n: _file_json(storage, s) for n, s in sorted(h.private.items())},
        "properties": dict(h.properties),
        "transfer": {
            "snapshot": TransferStats.from_properties(h.properties).as_dict(),
            "restore": TransferStats.from_properties(h.properties, RESTORE_PREFIX).as_dict(),
        },
    } for h in metadata.handles]
    sizes: dict[str, int] | None = None
    if not state_sizes:
        how = "not computed (--no-state-sizes)"
    elif metadata.format is not SnapshotFormat.NATIVE:
        how = "not computed for a canonical savepoint: its files are per state (see files)"
    else:
        sizes, how = _state_sizes_naming_damage(snapshot)
    infos = {s.name: s for h in metadata.handles for s in h.states}
    names = sorted(set(infos) | set(sizes or {}))
    out["states"] = [{
        "name": name,
        "kind": infos[name].kind if name in infos else None,
        "value_type": infos[name].value_type if name in infos else None,
        "user_key_type": infos[name].user_key_type if name in infos else None,
        "ttl_ms": infos[name].ttl_ms if name in infos else None,
        "bytes": None if sizes is None else sizes.get(name, 0),
    } for name in names]
    out["state_sizes"] = how
    return out


# -- per-state sizes -----------------------------------------------------------------------------

def compute_state_sizes(snapshot: ResolvedSnapshot) -> tuple[dict[str, int], str]:
    """Bytes per state name (plus :data:`OTHER_FILES`) over all subtasks, and how they were
    computed. Reads the snapshot's files (see the module docstring)."""
    sizes: dict[str, int] = defaultdict(int)
    name = snapshot.metadata.backend
    if name not in backend_names():
        raise ConfigurationError(f"per-state sizes of the {name!r} backend are unknown; "
                                 f"use --no-state-sizes")
    backend = load_backend(name)
    for handle in snapshot.metadata.handles:
        for state, size in backend.state_sizes(snapshot.storage, handle).items():
            sizes[state] += size
    return dict(sizes), f"computed: {backend.state_sizes_method}"


def _state_sizes_naming_damage(snapshot: ResolvedSnapshot) -> tuple[dict[str, int], str]:
    """:func:`compute_state_sizes`; if that fails, the snapshot's files are verified
    (:func:`~keyedstate.checkpoint.savepoint.verify_snapshot_files`, as a restore does) so
    that a damaged file is named as the snapshot's own file, not as the temporary copy the
    backend opened, with what works from there. Any other failure passes unchanged."""
    try:
        return compute_state_sizes(snapshot)
    except KeyedStateError as failure:
        try:
            verify_snapshot_files(snapshot, remedy=_remedy(snapshot))
        except (CorruptCheckpointError, MissingCheckpointFileError) as damage:
            raise damage from failure
        raise


def _remedy(snapshot: ResolvedSnapshot) -> str:
    """What works with a damaged snapshot, for :func:`show`'s error."""
    where = snapshot.storage.url_of(snapshot.metadata_path)
    if snapshot.metadata.kind is SnapshotKind.SAVEPOINT:
        way_out = ("Copy the file back from where the savepoint was copied from, if it was; "
                   "otherwise restore from another savepoint or a retained checkpoint of the "
                   "job")
    else:
        way_out = ("Restore from another retained checkpoint (keyedstate checkpoints list DIR) "
                   "or a savepoint")
    return (f"The {snapshot.metadata.kind} {where} can't be restored, nor its per-state sizes "
            f"computed. {way_out}; keyedstate checkpoints show --no-state-sizes shows the "
            f"rest without reading its files")


# -- garbage -------------------------------------------------------------------------------------

@dataclass
class GarbageReport:
    """What :func:`find_garbage` found: ``files`` (relative to ``storage``'s root) no committed
    checkpoint references, their total ``bytes``, and the ``latest_checkpoint_id`` it is
    relative to (None: no committed checkpoint, so nothing is known to be garbage)."""

    storage: CheckpointStorage
    latest_checkpoint_id: int | None
    files: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())

    def to_json(self) -> dict[str, Any]:
        return {"directory": self.storage.url, "latest_checkpoint_id": self.latest_checkpoint_id,
                "bytes": self.bytes,
                "files": [{"path": self.storage.url_of(p), "size": self.sizes.get(p, 0)}
                          for p in self.files]}


def _committed(storage: CheckpointStorage) -> dict[int, CheckpointMetadata]:
    committed: dict[int, CheckpointMetadata] = {}
    unreadable: dict[int, str] = {}
    for checkpoint_id in storage.checkpoint_ids():
        path = storage.metadata_path(checkpoint_id)
        try:
            committed[checkpoint_id] = storage.read_metadata(path)
        except NoCheckpointError:
            continue  # subsumed since the listing (a running job): no longer retained
        except (CorruptCheckpointError, UnsafePathError, UnsupportedFormatVersionError) as exc:
            unreadable[checkpoint_id] = f"{storage.url_of(path)} can't be read ({exc})"
    if unreadable:
        first = min(unreadable)
        names = ", ".join(f"chk-{i}" for i in sorted(unreadable))
        # The advice must work when followed: a job recovers here only from a readable
        # checkpoint, and sets an unreadable one newer than it aside until it is subsumed.
        if committed:
            way = (f"then run the job until it completes a checkpoint "
                   f"(execution.checkpointing.num-retained of them, if more than 1): recovery "
                   f"restores chk-{max(committed)} and keeps {names} aside until a newer "
                   f"checkpoint subsumes them, deleting them then")
        else:
            way = ("no checkpoint here is readable, so the job can't recover here either: "
                   "restore it from a savepoint into a new checkpoint directory, and delete "
                   "this one once it is of no more use")
        raise CorruptCheckpointError(
            f"{unreadable[first]}; gc needs every committed checkpoint to know what is "
            f"referenced, so nothing was collected. Inspect it (keyedstate checkpoints show); "
            f"{way}; or delete {names} yourself"
        )
    return committed


def find_garbage(directory: str | CheckpointStorage,
                 storage_options: Mapping[str, Any] | None = None) -> GarbageReport:
    """Files under a job's checkpoint directory (a URL, or its :class:`CheckpointStorage`)
    that no committed checkpoint references and no work in flight may still write or need
    (rules in the module docstring). Reads only. The one garbage finder: ``keyedstate gc``,
    the chaos soak and the tests use it. Raises :class:`ConfigurationError` for a savepoint
    directory (a savepoint is deleted as a whole, by its owner) and
    :class:`CorruptCheckpointError` for an unreadable ``_metadata``."""
    storage = (directory if isinstance(directory, CheckpointStorage)
               else CheckpointStorage(directory, storage_options))
    if storage.exists(METADATA_FILE):
        where = directory if isinstance(directory, str) else storage.url
        raise ConfigurationError(
            f"{where} is one snapshot (a savepoint, or one checkpoint's chk-N folder), not a "
            f"job's checkpoint directory: gc never collects from a savepoint (it is yours, "
            f"whole); point gc at a job's checkpoint directory"
        )
    # Step 1. Every committed checkpoint and what it references.
    committed = _committed(storage)
    if not committed:
        return GarbageReport(storage, None)
    latest, lowest = max(committed), min(committed)
    keep: set[str] = set()
    for checkpoint_id, metadata in committed.items():
        keep.add(storage.metadata_path(checkpoint_id))
        keep.add(f"{checkpoint_dir_name(checkpoint_id)}/{CLAIM_MARKER_FILE}")
        keep.update(f.path for f in metadata.files())
    # Step 2. The snapshot layout, up to the latest committed id.
    candidates = [p for p in storage.list_files(SHARED_DIR)
                  if (i := checkpoint_id_of_shared_file(p)) is not None and i <= latest]
    for checkpoint_id in storage.checkpoint_dir_ids():
        if checkpoint_id <= latest:
            candidates += storage.list_files(checkpoint_dir_name(checkpoint_id))
    garbage = [p for p in candidates if p not in keep]
    # Step 3. A Spark job's staged outputs and sink-commit markers.
    latest_batch = _batch_id(committed[latest])
    if latest_batch is not None:
        waiting: set[str] = set()
        for checkpoint_id, metadata in committed.items():
            batch = _batch_id(metadata)
            if batch is not None and not storage.exists(commit_marker(batch, checkpoint_id)):
                for paths in json.loads(metadata.properties.get(STAGED, "{}")).values():
                    waiting.update(paths)
        for p in storage.list_files(STAGING_DIR):
            staged_for = batch_id_of_staged_file(p)
            if staged_for is not None and staged_for <= latest_batch and p not in waiting:
                garbage.append(p)
        for p in storage.list_files(COMMITS_DIR):
            marked = checkpoint_id_of_commit_marker(p)
            if marked is not None and marked < lowest:
                garbage.append(p)
    # Step 4. Sizes, from listings; a file gone since (deleted by the running job) is no
    # longer garbage to report.
    found = storage.sizes(garbage)
    sizes = {p: size for p, size in found.items() if size is not None}
    return GarbageReport(storage, latest, sorted(sizes), sizes)


def delete_garbage(report: GarbageReport,
                   progress: Callable[[int, int], None] | None = None) -> int:
    """Delete exactly the files of ``report`` (already-missing ones are fine), then the
    directories left empty by it on a local disk; returns how many files were deleted."""
    storage = report.storage
    for n, path in enumerate(report.files, 1):
        storage.delete([path])
        if progress:
            progress(n, len(report.files))
    if storage.is_local:
        folders = {os.path.dirname(storage.path(p)) for p in report.files}
        for folder in sorted(folders, key=len, reverse=True):
            while folder.startswith(storage.root + "/") and folder != storage.root:
                top = folder[len(storage.root) + 1:]
                if "/" not in top and top in (SHARED_DIR, STAGING_DIR, COMMITS_DIR):
                    break  # the layout's own folders stay
                try:
                    os.rmdir(folder)
                except OSError:
                    break  # not empty
                folder = os.path.dirname(folder)
    return len(report.files)
