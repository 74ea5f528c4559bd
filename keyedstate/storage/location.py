"""Where one subtask writes one snapshot (:class:`CheckpointStorageLocation`) and the files
it stores (:class:`StateFile`): shared and private names, inlining, merging, duplication."""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from keyedstate.storage.cache import cache_key
from keyedstate.storage.duplication import duplicate_object
from keyedstate.storage.handles import (
    Segment,
    StreamHandle,
    content_checksum,
    inline_handle,
)
from keyedstate.storage.layout import checkpoint_dir_name, shared_file_prefix
from keyedstate.storage.transfer import TransferStats, parallel_map

if TYPE_CHECKING:  # annotations only: the storage builds its locations
    from keyedstate.storage.checkpoint_storage import CheckpointStorage



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


