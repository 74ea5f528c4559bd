"""fsspec filesystems for checkpoint and output files: connecting, object-store detection,
local checksums, fsync, hard links and copy-on-write copies."""

from __future__ import annotations

import os
import uuid
from typing import Any, Mapping

import fsspec
import xxhash

_CHUNK = 4 << 20
#: fsspec protocols of object stores: no directories (``makedirs`` is skipped: s3fs would
#: create a missing bucket), whole-object PUTs, server-side copies.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl",
                                    "oss", "r2", "cos", "obs", "tos"})


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


def write_whole(local_path: str, data: bytes, *, durable: bool = False) -> None:
    """Write ``data`` to ``local_path`` so that a reader sees the whole file or none (as a PUT
    on an object store): under a temporary name beside it, then renamed over it. A reader
    polling for the file (the driver for an acknowledgement) would otherwise read it half
    written. ``durable``: the bytes and the rename also survive a power loss
    (:func:`fsync_path`). A failed write leaves no temporary file behind."""
    tmp = f"{local_path}.{uuid.uuid4().hex}.inprogress"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, local_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if durable:
        fsync_path(os.path.dirname(local_path))


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


