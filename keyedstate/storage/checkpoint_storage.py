"""Checkpoint storage over fsspec: a job's snapshot root on a local disk or any object store.

:class:`CheckpointStorage` reads and writes files of one snapshot root (layout in
:mod:`keyedstate.storage.layout`); :class:`~keyedstate.storage.location.CheckpointStorageLocation`
is what a backend writes one snapshot through. Every file written gets a :class:`StreamHandle` (relative path,
size, XXH64) and every read verifies it, so a truncated or altered file is never restored.

Object stores (``docs/object-storage.md``): every call is retried on transient errors
(:mod:`keyedstate.storage.transfer`), transfers of one snapshot or restore run in parallel,
small files are inlined into ``_metadata`` or merged into one object per snapshot and subtask
(:mod:`keyedstate.storage.location`), files already in the store are duplicated by the
store itself (:mod:`keyedstate.storage.duplication`: S3 ``CopyObject``, a hard link or reflink on one disk),
and restores read through a bounded per-process file cache (:mod:`keyedstate.storage.cache`).
Each storage object counts what went through this process in :attr:`CheckpointStorage.stats`.

``_metadata`` is committed atomically: on a local disk it is written to a temporary name and
renamed (``os.replace``); on an object store a single PUT is atomic by itself (readers see the
old object or the whole new one). Both objects pickle as their URL and options.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from keyedstate.errors import (
    CorruptCheckpointError,
    MissingCheckpointFileError,
    NoCheckpointError,
    StorageAccessError,
    StorageLocationError,
    TransientStorageError,
)
from keyedstate.storage.cache import FileCache, cache_key, process_file_cache
from keyedstate.storage.duplication import link_file
from keyedstate.storage.filesystem import connect, file_checksum, is_object_store, write_whole
from keyedstate.storage.handles import (
    CheckpointMetadata,
    StreamHandle,
    check_relative_path,
    content_checksum,
    deserialize_metadata,
    serialize_metadata,
)
from keyedstate.storage.layout import METADATA_FILE, checkpoint_dir_name, checkpoint_id_of_dir
from keyedstate.storage.location import CheckpointStorageLocation
from keyedstate.storage.transfer import (
    DEFAULT_TRANSFER,
    MiB,
    TransferOptions,
    TransferStats,
    parallel_map,
    with_retries,
)

T = TypeVar("T")

#: Segments of one merged object that a restore needs are read by one ranged GET when the
#: bytes between two of them (a segment no longer referenced, or another subtask's) are at most
#: this many: on S3 a request's first byte (~100 ms) is worth ~9 MB at one stream's 90 MB/s,
#: so a hole of 1 MiB (~12 ms) is cheaper than another round trip, even where the pool has a
#: thread free (pyarrow's ``CacheOptions`` coalesce a Parquet file's ranges the same way).
COALESCE_HOLE_BYTES = 1 * MiB
#: ... and at most this many bytes in one ranged GET: past about one first byte's worth of
#: transfer on one stream, two requests in parallel finish first.
COALESCE_RANGE_BYTES = 8 * MiB


def coalesce(handles: Sequence[StreamHandle], hole: int = COALESCE_HOLE_BYTES,
             limit: int = COALESCE_RANGE_BYTES) -> list[list[int]]:
    """Indexes of the segments among ``handles`` (whole files and inline files are left out)
    grouped into ranged reads: segments of one object, by offset, while the gap before the
    next one is at most ``hole`` bytes and the range stays within ``limit`` bytes (a segment
    larger than ``limit`` is a range of its own). Every group is one GET of
    :func:`segments_range`; groups of one are plain segment reads."""
    by_object: dict[str, list[int]] = {}
    for i, handle in enumerate(handles):
        if handle.data is None and handle.segment is not None:
            by_object.setdefault(handle.path, []).append(i)
    groups: list[list[int]] = []
    for members in by_object.values():
        members.sort(key=lambda i: _offset(handles[i]))
        group = [members[0]]
        start, end = _offset(handles[members[0]]), _end(handles[members[0]])
        for i in members[1:]:
            offset, stop = _offset(handles[i]), _end(handles[i])
            if offset - end <= hole and max(end, stop) - start <= limit:
                group.append(i)
                end = max(end, stop)
            else:
                groups.append(group)
                group, start, end = [i], offset, stop
        groups.append(group)
    return groups


def segments_range(handles: Sequence[StreamHandle]) -> tuple[int, int]:
    """``[start, end)`` of the object that holds every segment of ``handles``."""
    return min(_offset(h) for h in handles), max(_end(h) for h in handles)


def _offset(handle: StreamHandle) -> int:
    assert handle.segment is not None
    return handle.segment.offset


def _end(handle: StreamHandle) -> int:
    assert handle.segment is not None
    return handle.segment.offset + handle.segment.length


#: bytes :meth:`CheckpointStorage.prefetch` holds in memory at once
PREFETCH_BATCH_BYTES = 64 << 20


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
    def request_threads(self) -> int:
        """Threads for independent requests that are each a round trip (listings, small reads
        and deletes): :attr:`TransferOptions.threads` on a remote store, 1 on the local
        filesystem (no round trip to overlap)."""
        return 1 if self.is_local else self.transfer.threads

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
        """Write ``data`` at ``relative``: a reader sees all of it or nothing (a PUT on an
        object store; on the local disk :func:`~keyedstate.storage.filesystem.write_whole`),
        since another process may poll for it (an acknowledgement)."""
        path = self.path(relative)

        def put() -> None:
            self.ensure_parent(path)
            if self.is_local:
                write_whole(path, data)
            else:
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
        """Download ``(handle, local path, immutable)`` items, each verified, through the file
        cache unless ``cached`` is False: every request of the batch goes to one pool
        (``transfer.threads``) at once (:meth:`_fetch_plan`: segments of one merged object
        read together, the largest reads first)."""
        handles = [item[0] for item in items]

        def one(i: int) -> None:
            handle, local_path, immutable = items[i]
            self.download(handle, local_path, cached=cached, immutable=immutable, stats=stats)

        def ranged(group: list[int]) -> None:
            for i, data in zip(group, self._read_segments([handles[i] for i in group],
                                                          cached=cached, stats=stats)):
                local_path = items[i][1]
                os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
                with open(local_path, "wb") as f:
                    f.write(data)

        self._run_plan(self._fetch_plan(handles, cached), one, ranged)

    def read_all(self, handles: Sequence[StreamHandle], *, cached: bool = True,
                 stats: TransferStats | None = None) -> list[bytes]:
        """The bytes of every handle, in order, each verified (:meth:`read_verified`), through
        the file cache unless ``cached`` is False: one pool for every request, as
        :meth:`download_all`."""
        out: list[bytes] = [b""] * len(handles)

        def one(i: int) -> None:
            out[i] = self.read_verified(handles[i], cached=cached, stats=stats)

        def ranged(group: list[int]) -> None:
            for i, data in zip(group, self._read_segments([handles[i] for i in group],
                                                          cached=cached, stats=stats)):
                out[i] = data

        self._run_plan(self._fetch_plan(handles, cached), one, ranged)
        return out

    def prefetch(self, handles: Sequence[StreamHandle]) -> int:
        """Fetch into the process's file cache the stored files among ``handles`` that it does
        not hold, each verified, one :meth:`read_all` (one parallel batch) per
        :data:`PREFETCH_BATCH_BYTES` or so (a batch ends with the file that reaches it); a
        restore or catch-up in this process then takes them from the cache. Returns the bytes
        fetched; 0 on a local disk or with the cache off (no cache: nothing to fill)."""
        cache = self.cache
        if cache is None:
            return 0
        missing = list({cache_key(h.digest, h.length): h for h in handles
                        if h.data is None and cache_key(h.digest, h.length) not in cache
                        }.values())
        # At most PREFETCH_BATCH_BYTES in memory at once (a cache emptied since the copy was
        # made lacks the whole state's files); each batch still fetched in parallel.
        fetched, start = 0, 0
        while start < len(missing):
            end, size = start, 0
            while end < len(missing) and (end == start or size < PREFETCH_BATCH_BYTES):
                size += missing[end].length
                end += 1
            fetched += sum(len(data) for data in self.read_all(missing[start:end]))
            start = end
        return fetched

    def _fetch_plan(self, handles: Sequence[StreamHandle], cached: bool
                    ) -> list[tuple[int, list[int]]]:
        """The reads that fetch ``handles``, as ``(bytes, indexes)``, largest first (the
        longest transfers start first, so the last to end is as early as the pool allows):
        one per file, except that the segments of one merged object the file cache does not
        hold share ranged reads (:func:`coalesce`). A group of one index is a read of that
        file alone (inline files, cache hits: no request)."""
        cache = self.cache if cached else None
        alone: list[int] = []
        segments: list[int] = []
        for i, handle in enumerate(handles):
            if handle.data is None and handle.segment is not None and not (
                    cache is not None and cache_key(handle.digest, handle.length) in cache):
                segments.append(i)
            else:
                alone.append(i)
        plan = [(0 if handles[i].data is not None else handles[i].length, [i]) for i in alone]
        for group in coalesce([handles[i] for i in segments]):
            members = [segments[j] for j in group]
            start, end = segments_range([handles[i] for i in members])
            plan.append((end - start, members))
        plan.sort(key=lambda read: -read[0])
        return plan

    def _run_plan(self, plan: Sequence[tuple[int, list[int]]], one: Callable[[int], None],
                  ranged: Callable[[list[int]], None]) -> None:
        parallel_map(lambda read: one(read[1][0]) if len(read[1]) == 1 else ranged(read[1]),
                     plan, self.transfer.threads)

    def _read_segments(self, handles: Sequence[StreamHandle], *, cached: bool,
                       stats: TransferStats | None) -> list[bytes]:
        """The bytes of segments of one object, read by one ranged GET and each verified;
        ``stats`` counts each file's own bytes (as :meth:`read_verified` would), this
        storage's :attr:`stats` the bytes the GET moved, holes included."""
        first = handles[0]
        start, end = segments_range(handles)
        what = f"{self.url_of(first.path)} (bytes {start}+{end - start}, {len(handles)} files)"
        try:
            data = bytes(self.call(f"reading {what}", lambda: self.fs.cat_file(
                self.path(first.path), start=start, end=end)))
        except FileNotFoundError as exc:
            raise self._missing(first) from exc
        self.stats.add(downloaded_bytes=len(data), downloaded_objects=1)
        cache = self.cache if cached else None
        out = []
        for handle in handles:
            offset = _offset(handle) - start
            piece = data[offset:offset + handle.length]
            self._verify(handle, len(piece), content_checksum(piece))
            if stats is not None:
                stats.add(downloaded_bytes=len(piece), downloaded_objects=1)
            if cache is not None:
                cache.note_miss(len(piece))
                cache.put_bytes(cache_key(handle.digest, handle.length), piece)
            out.append(piece)
        return out

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

    def delete_many(self, relatives: Iterable[str]) -> None:
        """Delete files in one bulk request where the store has one (an object store's
        ``DeleteObjects``, 1,000 keys a request) instead of one request each; already-missing
        ones are fine, as for :meth:`delete`. On the local filesystem (no requests to save), or
        when the bulk call finds a file missing, it is :meth:`delete`."""
        relatives = list(relatives)
        if len(relatives) <= 1 or self.is_local:
            self.delete(relatives)
            return
        paths = [self.path(r) for r in relatives]
        try:
            self.call(f"deleting {len(paths)} files under {self.url}",
                      lambda: self.fs.rm(paths, recursive=False))
        except FileNotFoundError:  # a wrapper over a filesystem refuses a missing one
            self.delete(relatives)

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
            write_whole(path, data, durable=True)
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

    def checkpoint_dir_ids(self) -> list[int]:
        """Ids of every ``chk-<N>/`` under the root, complete or not, ascending."""
        try:
            entries = self.call(f"listing {self.url}",
                                lambda: self.fs.ls(self.root, detail=False))
        except FileNotFoundError:
            return []
        return sorted(i for e in entries if (i := checkpoint_id_of_dir(e)) is not None)

    def checkpoint_ids(self) -> list[int]:
        """Ids of checkpoints whose ``_metadata`` exists (committed), ascending."""
        return [i for i in self.checkpoint_dir_ids() if self.exists(self.metadata_path(i))]

    def location(self, checkpoint_id: int, subtask_index: int) -> CheckpointStorageLocation:
        return CheckpointStorageLocation(self, checkpoint_id, subtask_index)


__all__ = ["CheckpointStorage"]
