"""Duplicating objects between snapshot roots by the store itself (hard link, reflink,
server-side copy) or, between different stores, streamed through this process."""

from __future__ import annotations

import fcntl
import os
import posixpath
import shutil
from typing import TYPE_CHECKING

from keyedstate.errors import CorruptCheckpointError, MissingCheckpointFileError
from keyedstate.storage.transfer import TransferStats

_CHUNK = 4 << 20
#: Linux ioctl asking the file system for a copy-on-write clone (btrfs, XFS, ...).
_FICLONE = 0x40049409

if TYPE_CHECKING:  # annotations only: duplication needs no storage module
    from keyedstate.storage.checkpoint_storage import CheckpointStorage


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


