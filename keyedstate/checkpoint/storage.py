"""Checkpoint storage over fsspec: a job's snapshot root on a local disk or any object store.

:class:`CheckpointStorage` reads and writes files of one snapshot root (layout in
:mod:`keyedstate.checkpoint.metadata`); :class:`CheckpointStorageLocation` is what a backend
writes one snapshot through. Every file written gets a :class:`StreamHandle` (relative path,
size, XXH64) and every read verifies it, so a truncated or altered file is never restored.

``_metadata`` is committed atomically: on a local disk it is written to a temporary name and
renamed (``os.replace``); on an object store a single PUT is atomic by itself (readers see the
old object or the whole new one). Both objects pickle as their URL and options.
"""

from __future__ import annotations

import os
import re
import uuid
from typing import Any, Iterable, Mapping

import fsspec
import xxhash
from fsspec.implementations.local import LocalFileSystem

from keyedstate.checkpoint.metadata import (
    CHECKPOINT_DIR_PREFIX,
    METADATA_FILE,
    CheckpointMetadata,
    StreamHandle,
    check_relative_path,
    checkpoint_dir_name,
    content_checksum,
    deserialize_metadata,
    serialize_metadata,
    shared_file_prefix,
)
from keyedstate.errors import (
    CorruptCheckpointError,
    MissingCheckpointFileError,
    NoCheckpointError,
)

_CHUNK = 4 << 20
_CHK_RE = re.compile(rf"^{CHECKPOINT_DIR_PREFIX}(\d+)$")


def file_checksum(local_path: str) -> str:
    """XXH64 (hex) of a local file, streamed."""
    h = xxhash.xxh64()
    with open(local_path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(local_dir: str) -> None:
    """Make a rename in ``local_dir`` durable: without it a power loss may undo the rename of
    ``_metadata`` after the checkpoint was reported complete. Not every platform can open a
    directory (Windows); there the rename is as durable as the OS makes it."""
    try:
        fd = os.open(local_dir, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointStorage:
    """One snapshot root (``url``), e.g. ``/data/ckpt``, ``file:///...``, ``s3://bucket/job``."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._fs: fsspec.AbstractFileSystem | None = None
        self._root: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (CheckpointStorage, (self.url, self.storage_options))

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.url!r})"

    # -- filesystem --------------------------------------------------------------------------

    def _connect(self) -> None:
        fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
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

    def path(self, relative: str) -> str:
        """The filesystem path of a relative reference (refusing one that leaves the root)."""
        return f"{self.root}/{check_relative_path(relative)}"

    def url_of(self, relative: str) -> str:
        """An absolute path or URL for a relative reference (what listings show)."""
        return self.fs.unstrip_protocol(self.path(relative)) if not self.is_local \
            else self.path(relative)

    # -- plain file access ---------------------------------------------------------------------

    def write(self, relative: str, data: bytes) -> StreamHandle:
        path = self.path(relative)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(path, data)
        return StreamHandle(relative, len(data), content_checksum(data))

    def upload(self, local_path: str, relative: str) -> StreamHandle:
        path = self.path(relative)
        checksum = file_checksum(local_path)
        size = os.path.getsize(local_path)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.put_file(local_path, path)
        return StreamHandle(relative, size, checksum)

    def exists(self, relative: str) -> bool:
        return bool(self.fs.exists(self.path(relative)))

    def read(self, relative: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self.path(relative)))
        except FileNotFoundError as exc:
            raise MissingCheckpointFileError(
                f"{self.url_of(relative)} is missing; it was deleted outside keyedstate. "
                f"Restore from another checkpoint or savepoint"
            ) from exc

    def read_verified(self, handle: StreamHandle) -> bytes:
        """The file's bytes, checked against the handle's size and checksum."""
        data = self.read(handle.path)
        self._verify(handle, len(data), content_checksum(data))
        return data

    def download(self, handle: StreamHandle, local_path: str) -> None:
        """Copy a referenced file to a local path and verify it."""
        os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
        try:
            self.fs.get_file(self.path(handle.path), local_path)
        except FileNotFoundError as exc:
            raise MissingCheckpointFileError(
                f"{self.url_of(handle.path)} is missing; it was deleted outside keyedstate. "
                f"Restore from another checkpoint or savepoint"
            ) from exc
        self._verify(handle, os.path.getsize(local_path), file_checksum(local_path))

    def _verify(self, handle: StreamHandle, size: int, checksum: str) -> None:
        if size != handle.size or checksum != handle.checksum:
            raise CorruptCheckpointError(
                f"{self.url_of(handle.path)} is corrupt: {size} bytes with checksum {checksum}, "
                f"expected {handle.size} bytes with checksum {handle.checksum}. Restore from "
                f"another checkpoint or savepoint"
            )

    def delete(self, relatives: Iterable[str]) -> None:
        """Delete files; already-missing ones are fine (deletion is idempotent)."""
        for relative in relatives:
            try:
                self.fs.rm_file(self.path(relative))
            except FileNotFoundError:
                pass

    def delete_dir(self, relative: str) -> None:
        try:
            self.fs.rm(self.path(relative), recursive=True)
        except FileNotFoundError:
            pass

    def list_files(self, relative_dir: str = "") -> list[str]:
        """Every file below ``relative_dir`` (or the whole root), as relative paths."""
        base = self.path(relative_dir) if relative_dir else self.root
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        prefix = self.root.rstrip("/") + "/"
        return sorted(p[len(prefix):] for p in found if p.startswith(prefix))

    # -- checkpoints ---------------------------------------------------------------------------

    def metadata_path(self, checkpoint_id: int) -> str:
        return f"{checkpoint_dir_name(checkpoint_id)}/{METADATA_FILE}"

    def write_metadata(self, metadata: CheckpointMetadata, relative: str | None = None) -> str:
        """Commit ``_metadata`` atomically (the checkpoint is complete once this returns)."""
        relative = relative or self.metadata_path(metadata.checkpoint_id)
        data = serialize_metadata(metadata)
        path = self.path(relative)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if self.is_local:
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
            _fsync_dir(os.path.dirname(path))
        else:
            self.fs.pipe_file(path, data)
        return relative

    def read_metadata(self, relative: str) -> CheckpointMetadata:
        try:
            data = bytes(self.fs.cat_file(self.path(relative)))
        except FileNotFoundError as exc:
            raise NoCheckpointError(f"no snapshot metadata at {self.url_of(relative)}") from exc
        return deserialize_metadata(data, source=self.url_of(relative))

    def checkpoint_ids(self) -> list[int]:
        """Ids of checkpoints whose ``_metadata`` exists (committed), ascending."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        ids = []
        for entry in entries:
            m = _CHK_RE.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if m and self.fs.exists(f"{self.root}/{m.group(0)}/{METADATA_FILE}"):
                ids.append(int(m.group(1)))
        return sorted(ids)

    def location(self, checkpoint_id: int, subtask_index: int) -> CheckpointStorageLocation:
        return CheckpointStorageLocation(self, checkpoint_id, subtask_index)


class CheckpointStorageLocation:
    """Where one subtask writes one snapshot. Shared files go to ``shared/chk-<N>-sub-<i>-...``
    under fresh unique names (a name is never reused, so a retry can't clobber a referenced
    file); private files go to ``chk-<N>/sub-<i>/``. Remembers what it wrote (in this process),
    so an aborted snapshot can be cleaned up; pickles (sent to executors)."""

    def __init__(self, storage: CheckpointStorage, checkpoint_id: int, subtask_index: int) -> None:
        self.storage = storage
        self.checkpoint_id = checkpoint_id
        self.subtask_index = subtask_index
        self.written: list[str] = []

    def _shared_name(self, name: str) -> str:
        # The checkpoint id leads the name: the coordinator reads it to tell new files from
        # re-referenced ones and to find what an aborted checkpoint wrote, even when the writer
        # was an executor's (pickled) copy of this location whose ``written`` it never sees.
        return (f"{shared_file_prefix(self.checkpoint_id)}sub-{self.subtask_index}-"
                f"{uuid.uuid4().hex}-{name}")

    def _private_name(self, name: str) -> str:
        return f"{checkpoint_dir_name(self.checkpoint_id)}/sub-{self.subtask_index}/{name}"

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
        return handle
