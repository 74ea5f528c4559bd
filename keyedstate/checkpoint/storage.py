"""Checkpoint storage over fsspec: a job's snapshot root on a local disk or any object store.

:class:`CheckpointStorage` reads and writes files of one snapshot root (layout in
:mod:`keyedstate.checkpoint.metadata`); :class:`CheckpointStorageLocation` is what a backend
writes one snapshot through. Every file written gets a :class:`StreamHandle` (relative path,
size, XXH64) and every read verifies it, so a truncated or altered file is never restored.

Object stores (``docs/object-storage.md``): every call is retried on transient errors
(:mod:`keyedstate.checkpoint.transfer`), transfers of one snapshot or restore run in parallel,
small files are inlined into ``_metadata`` or merged into one object per snapshot and subtask
(:meth:`CheckpointStorageLocation.put_files`), files already in the store are duplicated by the
store itself (:func:`duplicate_object`: S3 ``CopyObject``, a hard link or reflink on one disk),
and restores read through a bounded per-process file cache (:mod:`keyedstate.checkpoint.cache`).
Each storage object counts what went through this process in :attr:`CheckpointStorage.stats`.

``_metadata`` is committed atomically: on a local disk it is written to a temporary name and
renamed (``os.replace``); on an object store a single PUT is atomic by itself (readers see the
old object or the whole new one). Both objects pickle as their URL and options.
"""

from __future__ import annotations

import fcntl
import os
import posixpath
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import fsspec
import xxhash
from fsspec.implementations.local import LocalFileSystem

from keyedstate.checkpoint.cache import FileCache, cache_key, process_file_cache
from keyedstate.checkpoint.metadata import (
    CHECKPOINT_DIR_PREFIX,
    METADATA_FILE,
    CheckpointMetadata,
    Segment,
    StreamHandle,
    check_relative_path,
    checkpoint_dir_name,
    content_checksum,
    deserialize_metadata,
    inline_handle,
    serialize_metadata,
    shared_file_prefix,
)
from keyedstate.checkpoint.transfer import (
    DEFAULT_TRANSFER,
    TransferOptions,
    TransferStats,
    is_transient,
    parallel_map,
    with_retries,
)
from keyedstate.errors import (
    CorruptCheckpointError,
    MissingCheckpointFileError,
    NoCheckpointError,
    StorageAccessError,
    StorageLocationError,
    TransientStorageError,
)

T = TypeVar("T")

_CHUNK = 4 << 20
_CHK_RE = re.compile(rf"^{CHECKPOINT_DIR_PREFIX}(\d+)$")
#: fsspec protocols of object stores: no directories (``makedirs`` is skipped: s3fs would
#: create a missing bucket), whole-object PUTs, server-side copies.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl",
                                    "oss", "r2", "cos", "obs", "tos"})
#: Linux ioctl asking the file system for a copy-on-write clone (btrfs, XFS, ...).
_FICLONE = 0x40049409

# The fault-injecting wrapper of the tests and the chaos soak resolves in every process.
fsspec.register_implementation("ksfault", "keyedstate.checkpoint.faults.FaultInjectingFileSystem",
                               clobber=True)


def file_checksum(local_path: str) -> str:
    """XXH64 (hex) of a local file, streamed."""
    h = xxhash.xxh64()
    with open(local_path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(local_path: str) -> None:
    """Make a local file's bytes, or a rename in a local directory, durable: without it a
    power loss may undo the rename of ``_metadata`` after the checkpoint was reported complete.
    Not every platform can open a directory (Windows); there the rename is as durable as the
    OS makes it."""
    try:
        fd = os.open(local_path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is an object store (S3, GCS, Azure ...), seen through wrappers."""
    target = getattr(fs, "target_fs", None)
    if target is not None:
        return is_object_store(target)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in OBJECT_STORE_PROTOCOLS for p in protocols)


def connect(url: str, storage_options: Mapping[str, Any] | None = None
            ) -> tuple[fsspec.AbstractFileSystem, str]:
    """``(filesystem, path)`` of ``url`` for checkpoint and output files.

    fsspec's object-store filesystems (s3fs, gcsfs, adlfs) cache directory listings and answer
    ``info``, ``exists`` and ``copy`` of a path from a cached listing of its parent: a file
    that another process (an executor) wrote after this process listed the directory is then
    "missing" (seen in the S3 soak: a savepoint's server-side copy of a shared file the driver
    had listed the directory of before). Checkpoint files are written by many processes, so the
    listings cache is off unless ``storage_options`` set ``use_listings_cache`` themselves.
    """
    options = dict(storage_options or {})
    options.setdefault("use_listings_cache", False)
    return fsspec.core.url_to_fs(url, **options)


class CheckpointStorage:
    """One snapshot root (``url``), e.g. ``/data/ckpt``, ``file:///...``, ``s3://bucket/job``.

    ``storage_options`` go to fsspec (credentials, endpoint); ``transfer`` tunes retries,
    parallelism, inlining, merging and the file cache (:class:`TransferOptions`)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 transfer: TransferOptions | None = None) -> None:
        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.transfer = transfer or DEFAULT_TRANSFER
        #: what this object moved in this process (every copy counts its own)
        self.stats = TransferStats()
        self._fs: fsspec.AbstractFileSystem | None = None
        self._root: str | None = None
        #: (path, size, checksum) of files whose bytes were hashed against their handles when
        #: this object was made ready for a restore (:meth:`note_verified`)
        self._verified: frozenset[tuple[str, int, str]] = frozenset()

    def __reduce__(self) -> tuple[Any, ...]:
        # what travels to executors: the location, its options and the verified files
        return (CheckpointStorage, (self.url, self.storage_options, self.transfer),
                {"_verified": self._verified})

    def note_verified(self, handles: Iterable[StreamHandle]) -> None:
        """Record that the bytes of ``handles`` were just read and matched their size and
        checksum (a snapshot checked before a job starts from it). A restore that hard-links
        one of them from this local store (:meth:`download`) then checks its size only instead
        of hashing the same inode a second time in every subtask that restores it; copies and
        downloads are always hashed."""
        self._verified = self._verified | {(h.path, h.size, h.checksum) for h in handles
                                           if h.data is None and h.segment is None}

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.url!r})"

    # -- filesystem --------------------------------------------------------------------------

    def _connect(self) -> None:
        fs, root = connect(self.url, self.storage_options)
        self._fs, self._root = fs, root.rstrip("/")

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            self._connect()
        assert self._fs is not None
        return self._fs

    @property
    def root(self) -> str:
        if self._root is None:
            self._connect()
        assert self._root is not None
        return self._root

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def cache(self) -> FileCache | None:
        """The process's file cache for this store (None on a local disk or when disabled)."""
        if self.is_local:
            return None
        return process_file_cache(self.transfer.cache_bytes, self.transfer.cache_dir)

    @property
    def inline_threshold(self) -> int:
        return self.transfer.effective_inline_threshold(not self.is_local)

    @property
    def merge_file_size(self) -> int:
        return self.transfer.effective_merge_file_size(not self.is_local)

    def path(self, relative: str) -> str:
        """The filesystem path of a relative reference (refusing one that leaves the root)."""
        return f"{self.root}/{check_relative_path(relative)}"

    def url_of(self, relative: str) -> str:
        """An absolute path or URL for a relative reference (what listings show)."""
        return self.fs.unstrip_protocol(self.path(relative)) if not self.is_local \
            else self.path(relative)

    def describe(self, handle: StreamHandle) -> str:
        """How errors name a file reference: its URL (and byte range), or "inline"."""
        if handle.data is not None:
            return "an inline file of _metadata"
        where = self.url_of(handle.path)
        if handle.segment is not None:
            where += f" (bytes {handle.segment.offset}+{handle.segment.length})"
        return where

    def ensure_parent(self, path: str) -> None:
        """Create the folder of filesystem path ``path`` where folders exist (not on object
        stores: s3fs's ``makedirs`` costs a request and would create a missing bucket)."""
        if not is_object_store(self.fs):
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` retried on transient errors (:func:`with_retries`); refused credentials
        become :class:`StorageAccessError` naming ``what``."""
        try:
            return with_retries(what, fn, self.transfer,
                                on_retry=lambda exc: self.stats.add(retries=1))
        except PermissionError as exc:
            if isinstance(exc, StorageAccessError):
                raise
            raise StorageAccessError(
                f"{what}: {self.url} refused access ({exc}); check the credentials in "
                f"keyedstate.checkpointing.storage-options and the permissions on the location"
            ) from exc

    # -- plain file access ---------------------------------------------------------------------

    def write(self, relative: str, data: bytes) -> StreamHandle:
        path = self.path(relative)

        def put() -> None:
            self.ensure_parent(path)
            self.fs.pipe_file(path, data)

        self.call(f"writing {self.url_of(relative)}", put)
        self.stats.add(uploaded_bytes=len(data), uploaded_objects=1)
        return StreamHandle(relative, len(data), content_checksum(data))

    def upload(self, local_path: str, relative: str) -> StreamHandle:
        path = self.path(relative)
        checksum = file_checksum(local_path)
        size = os.path.getsize(local_path)

        def put() -> None:
            self.ensure_parent(path)
            self.fs.put_file(local_path, path)

        self.call(f"uploading {local_path} to {self.url_of(relative)}", put)
        self.stats.add(uploaded_bytes=size, uploaded_objects=1)
        return StreamHandle(relative, size, checksum)

    def exists(self, relative: str) -> bool:
        return bool(self.call(f"checking {self.url_of(relative)}",
                              lambda: self.fs.exists(self.path(relative))))

    def _missing(self, handle_or_path: StreamHandle | str) -> MissingCheckpointFileError:
        where = self.url_of(handle_or_path) if isinstance(handle_or_path, str) else \
            self.describe(handle_or_path)
        return MissingCheckpointFileError(
            f"{where} is missing; it was deleted outside keyedstate. Restore from another "
            f"checkpoint or savepoint"
        )

    def read(self, relative: str) -> bytes:
        try:
            data = bytes(self.call(f"reading {self.url_of(relative)}",
                                   lambda: self.fs.cat_file(self.path(relative))))
        except FileNotFoundError as exc:
            raise self._missing(relative) from exc
        self.stats.add(downloaded_bytes=len(data), downloaded_objects=1)
        return data

    def _fetch(self, handle: StreamHandle) -> bytes:
        """The file's bytes from the store (a range request for a segment), unverified."""
        path = self.path(handle.path)
        segment = handle.segment
        try:
            if segment is None:
                data = self.call(f"reading {self.describe(handle)}",
                                 lambda: self.fs.cat_file(path))
            else:
                data = self.call(f"reading {self.describe(handle)}", lambda: self.fs.cat_file(
                    path, start=segment.offset, end=segment.offset + segment.length))
        except FileNotFoundError as exc:
            raise self._missing(handle) from exc
        self.stats.add(downloaded_bytes=len(data), downloaded_objects=1)
        return bytes(data)

    def read_verified(self, handle: StreamHandle, *, cached: bool = False,
                      stats: TransferStats | None = None) -> bytes:
        """The file's bytes, checked against the handle's size and checksum. ``cached``: take
        them from (and keep them in) the process's file cache (restores do)."""
        if handle.data is not None:
            self._verify(handle, len(handle.data), content_checksum(handle.data))
            return handle.data
        cache = self.cache if cached else None
        key = cache_key(handle.digest, handle.length)
        if cache is not None:
            hit = cache.get_bytes(key)
            if hit is not None:
                if stats is not None:
                    stats.add(cache_hit_bytes=len(hit), cache_hit_files=1)
                return hit
        data = self._fetch(handle)
        self._verify(handle, len(data), content_checksum(data))
        if stats is not None:
            stats.add(downloaded_bytes=len(data), downloaded_objects=1)
        if cache is not None:
            cache.note_miss_bytes(len(data))
            cache.put_bytes(key, data)
        return data

    def download(self, handle: StreamHandle, local_path: str, *, cached: bool = False,
                 immutable: bool = False, stats: TransferStats | None = None) -> None:
        """Copy a referenced file to a local path and verify it. ``cached``: through the
        process's file cache; ``immutable``: the file is never modified in place (SST and
        heap files), so the cache may hand it out as a hard link, and a local store links
        it instead of copying it."""
        os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
        if handle.data is not None or handle.segment is not None:
            data = self.read_verified(handle, cached=cached, stats=stats)
            with open(local_path, "wb") as f:
                f.write(data)
            return
        if immutable and self.is_local and self._link_verified(handle, local_path, stats):
            return
        cache = self.cache if cached else None
        key = cache_key(handle.digest, handle.length)
        if cache is not None and cache.get_file(key, local_path, link=immutable):
            if stats is not None:
                stats.add(cache_hit_bytes=handle.length, cache_hit_files=1)
            return
        try:
            self.call(f"downloading {self.describe(handle)}",
                      lambda: self.fs.get_file(self.path(handle.path), local_path))
        except FileNotFoundError as exc:
            raise self._missing(handle) from exc
        size = os.path.getsize(local_path)
        self.stats.add(downloaded_bytes=size, downloaded_objects=1)
        if stats is not None:
            stats.add(downloaded_bytes=size, downloaded_objects=1)
        self._verify(handle, size, file_checksum(local_path))
        if cache is not None:
            cache.note_miss_bytes(size)
            cache.put_file(key, local_path, link=immutable)

    def _link_verified(self, handle: StreamHandle, local_path: str,
                       stats: TransferStats | None) -> bool:
        """Hard-link a file of this local store to ``local_path`` and verify it; False when
        the two paths are on different devices (or the file system has no hard links): the
        caller copies instead. Only for immutable files (SSTs): nothing writes to them in
        place, and deleting either name leaves the other whole, so a restored RocksDB and the
        checkpoint may share the inode. Counted as duplicated, not downloaded: no byte moved."""
        try:
            if not link_file(self.path(handle.path), local_path):
                return False
        except FileNotFoundError as exc:
            raise self._missing(handle) from exc
        size = os.path.getsize(local_path)
        if (handle.path, handle.size, handle.checksum) in self._verified:
            self._verify(handle, size, handle.digest)  # hashed before the job started
        else:
            self._verify(handle, size, file_checksum(local_path))
        if stats is not None:
            stats.add(duplicated_bytes=size, duplicated_objects=1)
        return True

    def download_all(self, items: Sequence[tuple[StreamHandle, str, bool]], *,
                     cached: bool = True, stats: TransferStats | None = None) -> None:
        """Download ``(handle, local path, immutable)`` items in parallel (``transfer.threads``),
        each verified; through the file cache unless ``cached`` is False."""
        parallel_map(lambda item: self.download(item[0], item[1], cached=cached,
                                                immutable=item[2], stats=stats),
                     items, self.transfer.threads)

    def _verify(self, handle: StreamHandle, size: int, checksum: str) -> None:
        if size != handle.length or checksum != handle.digest:
            raise CorruptCheckpointError(
                f"{self.describe(handle)} is corrupt: {size} bytes with checksum {checksum}, "
                f"expected {handle.length} bytes with checksum {handle.digest}. Restore from "
                f"another checkpoint or savepoint"
            )

    def delete(self, relatives: Iterable[str]) -> None:
        """Delete files; already-missing ones are fine (deletion is idempotent)."""
        for relative in relatives:
            path = self.path(relative)
            try:
                self.call(f"deleting {self.url_of(relative)}",
                          lambda path=path: self.fs.rm_file(path))  # type: ignore[misc]
            except FileNotFoundError:
                pass

    def delete_dir(self, relative: str) -> None:
        try:
            self.call(f"deleting {self.url_of(relative)}",
                      lambda: self.fs.rm(self.path(relative), recursive=True))
        except FileNotFoundError:
            pass

    def list_files(self, relative_dir: str = "") -> list[str]:
        """Every file below ``relative_dir`` (or the whole root), as relative paths."""
        base = self.path(relative_dir) if relative_dir else self.root
        try:
            found = self.call(f"listing {base}", lambda: self.fs.find(base))
        except FileNotFoundError:
            return []
        prefix = self.root.rstrip("/") + "/"
        return sorted(p[len(prefix):] for p in found if p.startswith(prefix))

    def sizes(self, relatives: Sequence[str]) -> dict[str, int | None]:
        """The size of every file in ``relatives`` (None: missing), cheaply: one listing per
        folder, folders in parallel; no byte is read."""
        folders: dict[str, set[str]] = {}
        for relative in relatives:
            folder, _, name = check_relative_path(relative).rpartition("/")
            folders.setdefault(folder, set()).add(name)

        def list_folder(folder: str) -> dict[str, int]:
            base = self.path(folder) if folder else self.root
            try:
                entries = self.call(f"listing {base}",
                                    lambda: self.fs.ls(base, detail=True, refresh=True))
            except FileNotFoundError:
                return {}
            out = {}
            for entry in entries:
                if entry.get("type") == "directory":
                    continue
                name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
                out[f"{folder}/{name}" if folder else name] = int(entry.get("size") or 0)
            return out

        found: dict[str, int] = {}
        for listing in parallel_map(list_folder, sorted(folders), self.transfer.threads):
            found.update(listing)
        return {r: found.get(r) for r in relatives}

    def check_access(self) -> None:
        """Fail fast, before any batch: the location must exist and accept this job's
        credentials. On a local disk the root (or its nearest existing parent) must be a
        writable directory (nothing is created); elsewhere a probe object is written under the
        root and deleted again. Raises :class:`StorageAccessError` (credentials, permissions),
        :class:`StorageLocationError` (a missing bucket or a file in the way) or
        :class:`TransientStorageError` (unreachable)."""
        if self.is_local:
            path = self.root
            while not os.path.exists(path) and os.path.dirname(path) != path:
                path = os.path.dirname(path)
            if not os.path.isdir(path):
                raise StorageLocationError(
                    f"{self.url}: {path} is not a directory; point "
                    f"execution.checkpointing.dir at a directory"
                )
            if not os.access(path, os.W_OK | os.X_OK):
                raise StorageAccessError(
                    f"{self.url}: {path} is not writable by this process; fix its permissions "
                    f"or choose another execution.checkpointing.dir"
                )
            return
        probe = f"_keyedstate-access-probe-{uuid.uuid4().hex}"
        try:
            self.write(probe, b"")
            self.delete([probe])
        except (StorageAccessError, TransientStorageError):
            raise
        except FileNotFoundError as exc:
            raise StorageLocationError(
                f"{self.url} does not exist ({exc}); create the bucket or container first "
                f"(keyedstate never creates one), or fix execution.checkpointing.dir"
            ) from exc
        except Exception as exc:
            if "credential" in type(exc).__name__.lower() or "credential" in str(exc).lower():
                raise StorageAccessError(
                    f"{self.url}: no usable credentials ({type(exc).__name__}: {exc}); set "
                    f"them in keyedstate.checkpointing.storage-options or the environment"
                ) from exc
            raise

    # -- checkpoints ---------------------------------------------------------------------------

    def metadata_path(self, checkpoint_id: int) -> str:
        return f"{checkpoint_dir_name(checkpoint_id)}/{METADATA_FILE}"

    def write_metadata(self, metadata: CheckpointMetadata, relative: str | None = None) -> str:
        """Commit ``_metadata`` atomically (the checkpoint is complete once this returns)."""
        relative = relative or self.metadata_path(metadata.checkpoint_id)
        data = serialize_metadata(metadata)
        path = self.path(relative)
        if self.is_local:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.inprogress"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                # A failed write leaves no temporary file behind (the rename never happened).
                if os.path.exists(tmp):
                    os.remove(tmp)
                raise
            fsync_path(os.path.dirname(path))
        else:
            def put() -> None:
                self.ensure_parent(path)
                self.fs.pipe_file(path, data)

            self.call(f"writing {self.url_of(relative)}", put)
            self.stats.add(uploaded_bytes=len(data), uploaded_objects=1)
        return relative

    def read_metadata(self, relative: str) -> CheckpointMetadata:
        try:
            data = bytes(self.call(f"reading {self.url_of(relative)}",
                                   lambda: self.fs.cat_file(self.path(relative))))
        except FileNotFoundError as exc:
            raise NoCheckpointError(f"no snapshot metadata at {self.url_of(relative)}") from exc
        return deserialize_metadata(data, source=self.url_of(relative))

    def checkpoint_ids(self) -> list[int]:
        """Ids of checkpoints whose ``_metadata`` exists (committed), ascending."""
        try:
            entries = self.call(f"listing {self.url}",
                                lambda: self.fs.ls(self.root, detail=False))
        except FileNotFoundError:
            return []
        ids = []
        for entry in entries:
            m = _CHK_RE.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if m and self.exists(f"{m.group(0)}/{METADATA_FILE}"):
                ids.append(int(m.group(1)))
        return sorted(ids)

    def location(self, checkpoint_id: int, subtask_index: int) -> CheckpointStorageLocation:
        return CheckpointStorageLocation(self, checkpoint_id, subtask_index)


# -- duplication ---------------------------------------------------------------------------------

def same_store(a: CheckpointStorage, b: CheckpointStorage) -> bool:
    """Whether one store holds both roots, so that it can copy between them by itself."""
    if a.is_local and b.is_local:
        return True
    return a.fs is b.fs or (type(a.fs) is type(b.fs) and a.storage_options == b.storage_options)


def link_file(src: str, dst: str) -> bool:
    """Make ``dst`` (replacing whatever is there) a hard link to ``src``; False when no link
    can be made (another device, a file system without hard links, no permission to link),
    ``dst`` then absent. :class:`FileNotFoundError` when ``src`` is missing."""
    if os.path.lexists(dst):
        os.remove(dst)
    try:
        os.link(src, dst)
    except OSError as exc:
        if not os.path.exists(src):
            raise FileNotFoundError(src) from exc
        return False
    return True


def _local_copy(src: str, dst: str) -> str:
    """Copy on one machine without moving the bytes through Python: a copy-on-write clone
    where the file system has them (btrfs, XFS: ``"reflink"``), else the kernel's copy
    (``shutil.copyfile`` uses ``sendfile`` on Linux: ``"copy"``)."""
    try:
        with open(src, "rb") as r, open(dst, "wb") as w:
            fcntl.ioctl(w.fileno(), _FICLONE, r.fileno())
        return "reflink"
    except OSError:
        shutil.copyfile(src, dst)
        return "copy"


def duplicate_object(source: CheckpointStorage, source_path: str, target: CheckpointStorage,
                     target_path: str, size: int, *, link: bool = True,
                     stats: TransferStats | None = None) -> str:
    """Duplicate one object (relative paths in each root) without re-encoding it; returns how:
    ``"link"`` (hard link, one local disk, when ``link``), ``"reflink"`` or ``"copy"`` (one
    local disk without linking: another device, no hard links, or ``link=False`` when the
    copy must not share an inode with its source), ``"server-copy"`` (the store copies, e.g.
    S3 ``CopyObject``; no byte passes through this process) or ``"stream"`` (between different
    stores: through this process). An existing target is replaced (a retried, interrupted
    duplication). The target's size is checked; its checksum is the source's, checked where
    it is read. Counted in ``target.stats`` and ``stats``."""
    src = source.path(source_path)
    dst = target.path(target_path)
    try:
        if source.is_local and target.is_local:
            os.makedirs(posixpath.dirname(dst), exist_ok=True)
            if os.path.lexists(dst):  # never write through an earlier attempt's link to src
                os.remove(dst)
            how = "link" if link and link_file(src, dst) else _local_copy(src, dst)
        elif same_store(source, target):
            def copy() -> None:
                target.ensure_parent(dst)
                target.fs.copy(src, dst)

            target.call(f"copying {source.url_of(source_path)} to {target.url_of(target_path)}",
                        copy)
            how = "server-copy"
        else:
            def stream() -> None:
                target.ensure_parent(dst)
                with source.fs.open(src, "rb") as r, target.fs.open(dst, "wb") as w:
                    shutil.copyfileobj(r, w, _CHUNK)

            target.call(f"copying {source.url_of(source_path)} to {target.url_of(target_path)}",
                        stream)
            how = "stream"
    except FileNotFoundError as exc:
        raise MissingCheckpointFileError(
            f"{source.url_of(source_path)} is missing; the snapshot is incomplete. Use another "
            f"checkpoint or savepoint"
        ) from exc
    written = int(target.call(f"checking {target.url_of(target_path)}",
                              lambda: target.fs.size(dst)))
    if written != size:
        raise CorruptCheckpointError(
            f"duplicating {source.url_of(source_path)} to {target.url_of(target_path)} gave "
            f"{written} bytes, the snapshot recorded {size}; the source is altered or the copy "
            f"failed. Retry, or use another checkpoint"
        )
    counts = (dict(uploaded_bytes=size, uploaded_objects=1, downloaded_bytes=size,
                   downloaded_objects=1) if how == "stream"
              else dict(duplicated_bytes=size, duplicated_objects=1))
    target.stats.add(**counts)
    if stats is not None:
        stats.add(**counts)
    return how


# -- one snapshot's files ------------------------------------------------------------------------

@dataclass(frozen=True)
class StateFile:
    """A file a snapshot stores: a local file (``local_path``) or bytes (``data``). ``shared``
    files may be re-referenced by later checkpoints; ``immutable`` ones (SST, heap files) may
    enter the file cache as hard links."""

    name: str
    shared: bool
    local_path: str | None = None
    data: bytes | None = None
    immutable: bool = False

    def size(self) -> int:
        return len(self.data) if self.data is not None else os.path.getsize(str(self.local_path))

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        with open(str(self.local_path), "rb") as f:
            return f.read()


class CheckpointStorageLocation:
    """Where one subtask writes one snapshot. Shared files go to ``shared/chk-<N>-sub-<i>-...``
    under fresh unique names (a name is never reused, so a retry can't clobber a referenced
    file); private files go to ``chk-<N>/sub-<i>/<uuid>-<name>``, unique for the same reason
    (and because an id repeated after a driver crash must not let a late task of the failed
    attempt overwrite the new attempt's file); snapshots written before, with private files at
    ``chk-<N>/sub-<i>/<name>``, are read as recorded. Remembers what it wrote (in this
    process), so an aborted snapshot can be cleaned up, and counts it in :attr:`stats`;
    pickles (sent to executors)."""

    def __init__(self, storage: CheckpointStorage, checkpoint_id: int, subtask_index: int) -> None:
        self.storage = storage
        self.checkpoint_id = checkpoint_id
        self.subtask_index = subtask_index
        self.written: list[str] = []
        #: what this snapshot moved (uploads, duplicates, inlined and merged files)
        self.stats = TransferStats()

    def _shared_name(self, name: str) -> str:
        # The checkpoint id leads the name: the coordinator reads it to tell new files from
        # re-referenced ones and to find what an aborted checkpoint wrote, even when the writer
        # was an executor's (pickled) copy of this location whose ``written`` it never sees.
        return (f"{shared_file_prefix(self.checkpoint_id)}sub-{self.subtask_index}-"
                f"{uuid.uuid4().hex}-{name}")

    def _private_name(self, name: str) -> str:
        # A fresh uuid per file, as for shared files: checkpoint ids can repeat across a
        # driver crash (a checkpoint that left no trace before the crash is triggered again),
        # and a task of the dead driver still running must never overwrite a file of the new
        # attempt. A late file lands under its own name, unreferenced: gc lists it.
        return (f"{checkpoint_dir_name(self.checkpoint_id)}/sub-{self.subtask_index}/"
                f"{uuid.uuid4().hex}-{name}")

    def write_shared(self, data: bytes, name: str) -> StreamHandle:
        return self._track(self.storage.write(self._shared_name(name), data))

    def upload_shared(self, local_path: str, name: str) -> StreamHandle:
        return self._track(self.storage.upload(local_path, self._shared_name(name)))

    def write_private(self, data: bytes, name: str) -> StreamHandle:
        return self._track(self.storage.write(self._private_name(name), data))

    def upload_private(self, local_path: str, name: str) -> StreamHandle:
        return self._track(self.storage.upload(local_path, self._private_name(name)))

    def _track(self, handle: StreamHandle) -> StreamHandle:
        self.written.append(handle.path)
        self.stats.add(uploaded_bytes=handle.size, uploaded_objects=1)
        return handle

    # -- many files: inline, merge, upload in parallel -----------------------------------------

    def put_files(self, files: Sequence[StateFile]) -> list[StreamHandle]:
        """Store the files of one snapshot; returns their handles, in order.

        Step 1. A private file below ``inline_threshold`` bytes is inlined (its bytes go
            into ``_metadata``; no object). Shared files never are: later checkpoints
            re-reference them, and an inline file's bytes would go into every later
            ``_metadata`` again (uploaded many times); small shared files are merged instead.
        Step 2. Files below ``merge_file_size`` (two or more) are packed into merged objects
            of at most ``merge_max_size`` in ``shared/`` (named for this checkpoint); each file
            is a segment of one. Private files may share an object with shared ones: the
            registry tracks the object as long as any checkpoint references a segment of it.
        Step 3. Every other file becomes its own object (shared or private).
        Steps 2 and 3 upload in parallel (``transfer.threads``); each upload is retried on
        transient errors. Every stored file also enters the process's file cache.
        """
        storage = self.storage
        inline_below, merge_below = storage.inline_threshold, storage.merge_file_size
        sizes = [f.size() for f in files]
        handles: list[StreamHandle | None] = [None] * len(files)
        # Step 1. Inline.
        for i, f in enumerate(files):
            if not f.shared and sizes[i] < inline_below:
                handles[i] = inline_handle(f.read())
                self.stats.add(inlined_bytes=sizes[i], inlined_files=1)
        # Step 2. Merge the small ones.
        small = [i for i, f in enumerate(files) if handles[i] is None and sizes[i] < merge_below]
        groups: list[list[int]] = []
        if len(small) >= 2:
            current: list[int] = []
            used = 0
            for i in small:
                if current and used + sizes[i] > storage.transfer.merge_max_size:
                    groups.append(current)
                    current, used = [], 0
                current.append(i)
                used += sizes[i]
            groups.append(current)
            groups = [g for g in groups if len(g) >= 2]
        merged = {i for g in groups for i in g}
        single = [i for i, h in enumerate(handles) if h is None and i not in merged]

        def store_group(group: list[int]) -> None:
            parts = [files[i].read() for i in group]
            data = b"".join(parts)
            obj = self.write_shared(data, "merged")
            offset = 0
            for i, part in zip(group, parts):
                handles[i] = StreamHandle(obj.path, obj.size, obj.checksum,
                                          segment=Segment(offset, len(part),
                                                          content_checksum(part)))
                offset += len(part)
            self.stats.add(merged_files=len(group))
            self._cache_bytes(parts)

        def store_one(i: int) -> None:
            f = files[i]
            if f.data is not None:
                handle = (self.write_shared if f.shared else self.write_private)(f.data, f.name)
                self._cache_bytes([f.data])
            else:
                assert f.local_path is not None
                handle = (self.upload_shared if f.shared else self.upload_private)(
                    f.local_path, f.name)
                cache = storage.cache
                if cache is not None:
                    cache.put_file(cache_key(handle.checksum, handle.size), f.local_path,
                                   link=f.immutable)
            handles[i] = handle

        jobs: list[Callable[[], None]] = [
            *(lambda g=g: store_group(g) for g in groups),
            *(lambda i=i: store_one(i) for i in single)]
        parallel_map(lambda job: job(), jobs, storage.transfer.threads)
        assert all(h is not None for h in handles)
        return [h for h in handles if h is not None]

    def _cache_bytes(self, parts: Sequence[bytes]) -> None:
        cache = self.storage.cache
        if cache is not None:
            for part in parts:
                cache.put_bytes(cache_key(content_checksum(part), len(part)), part)

    # -- files already in a store: duplicate them ----------------------------------------------

    def duplicate_files(self, source: CheckpointStorage,
                        files: Sequence[tuple[str, StreamHandle]]) -> list[StreamHandle]:
        """Copies of ``(name, handle)`` files of ``source`` as new shared files of this
        snapshot, made by the store itself (:func:`duplicate_object`: server-side copy, or a
        reflink / copy on one local disk, never a hard link: the copy must not share an inode
        with a snapshot that is not the job's). A merged object is duplicated once for all its
        segments; inline files stay inline. In parallel, retried; returns handles in order."""
        objects: dict[str, StreamHandle] = {}
        for _, handle in files:
            if handle.data is None:
                objects.setdefault(handle.path, handle.object_handle())
        names = {path: next(n for n, h in files if h.path == path) for path in objects}

        def copy(path: str) -> tuple[str, StreamHandle]:
            obj = objects[path]
            name = "merged" if any(h.path == path and h.segment is not None for _, h in files) \
                else posixpath.basename(names[path])
            new_path = self._shared_name(name)
            self.written.append(new_path)  # before the copy: an abort must find a partial one
            duplicate_object(source, path, self.storage, new_path, obj.size, link=False,
                             stats=self.stats)
            return path, StreamHandle(new_path, obj.size, obj.checksum)

        copies = dict(parallel_map(copy, sorted(objects), self.storage.transfer.threads))
        out = []
        for _, handle in files:
            if handle.data is not None:
                out.append(handle)
            else:
                new = copies[handle.path]
                out.append(StreamHandle(new.path, new.size, new.checksum, segment=handle.segment))
        return out


__all__ = [
    "CheckpointStorage", "CheckpointStorageLocation", "StateFile", "duplicate_object",
    "file_checksum", "is_object_store", "is_transient", "same_store",
]
