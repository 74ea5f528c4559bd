"""A bounded local file cache per process (ForSt's file cache): restore without downloading.

Every file a process uploads to, or downloads from, an object-store checkpoint is kept here
under its *content* key (XXH64 and length), so a later restore of any snapshot that references
the same bytes (this job's next attempt of a batch, a restore at another parallelism, a
NO_CLAIM restore of a savepoint whose files are duplicates) takes them from the local disk.

- **Bounded**: at most ``capacity`` bytes; when a new file would pass it, the least recently
  used whole files are evicted first (never part of a file).
- **Content-addressed and verified**: a file enters only after its checksum was checked (it
  was just written from, or verified against, a handle), and a hit is only served for the
  same checksum and length; the store is not contacted on a hit.
- **Cheap**: files enter and leave by hard link when the cache and the other path share a
  file system (SST files are immutable), by copy otherwise.
- **Metrics**: :meth:`FileCache.stats` (hits, misses, evictions and their bytes).

One cache per process and directory (:func:`process_file_cache`); thread-safe. Its directory
is per process (``<dir>/keyedstate-file-cache-<pid>``), deleted at exit; directories of dead
processes are removed when the next one starts.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import uuid
from collections import OrderedDict
from typing import Any

_PREFIX = "keyedstate-file-cache-"


def cache_key(checksum: str, length: int) -> str:
    """The key of a file's content: its XXH64 (hex) and length."""
    return f"{checksum}-{length}"


class FileCache:
    """A directory of whole files, at most ``capacity`` bytes, least recently used evicted."""

    def __init__(self, directory: str, capacity: int) -> None:
        self.directory = directory
        self.capacity = capacity
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0
        self.hit_bytes = self.miss_bytes = self.evicted_bytes = self.inserted_bytes = 0
        os.makedirs(directory, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key)

    # -- lookups -------------------------------------------------------------------------------

    def get_file(self, key: str, dest: str, *, link: bool) -> bool:
        """Put the cached content ``key`` at ``dest`` (a hard link when ``link`` and possible,
        else a copy); False on a miss."""
        pinned = self._pin(key)
        if pinned is None:
            return False
        try:
            if os.path.lexists(dest):
                os.remove(dest)
            if link:
                try:
                    os.link(pinned, dest)
                    return True
                except OSError:
                    pass
            shutil.copyfile(pinned, dest)
            return True
        finally:
            os.remove(pinned)

    def get_bytes(self, key: str) -> bytes | None:
        """The cached content ``key``, or None on a miss."""
        pinned = self._pin(key)
        if pinned is None:
            return None
        try:
            with open(pinned, "rb") as f:
                return f.read()
        finally:
            os.remove(pinned)

    def _pin(self, key: str) -> str | None:
        """A private hard link to the entry, so that an eviction meanwhile can't take it away
        while it is read; counts the hit or miss."""
        with self._lock:
            size = self._entries.get(key)
            if size is None:
                self.misses += 1
                return None
            pinned = self._path(f".pin-{uuid.uuid4().hex}")
            try:
                os.link(self._path(key), pinned)
            except OSError:  # the file vanished under us (deleted by hand): forget it
                self._forget(key)
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            self.hit_bytes += size
            return pinned

    def note_miss_bytes(self, size: int) -> None:
        with self._lock:
            self.miss_bytes += size

    def note_miss(self, size: int) -> None:
        """Count a miss of ``size`` bytes found without a lookup (a restore that asked
        ``key in cache`` before reading the file with others)."""
        with self._lock:
            self.misses += 1
            self.miss_bytes += size

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    # -- inserts -------------------------------------------------------------------------------

    def put_file(self, key: str, src: str, *, link: bool) -> None:
        """Cache the content of local file ``src`` (already verified) under ``key``."""
        size = os.path.getsize(src)
        if size > self.capacity or key in self:
            return
        tmp = self._path(f".new-{uuid.uuid4().hex}")
        try:
            if link:
                try:
                    os.link(src, tmp)
                except OSError:
                    shutil.copyfile(src, tmp)
            else:
                shutil.copyfile(src, tmp)
        except OSError:
            return  # a cache that can't be filled is only a slower restore
        self._admit(key, tmp, size)

    def put_bytes(self, key: str, data: bytes) -> None:
        """Cache ``data`` (already verified) under ``key``."""
        if len(data) > self.capacity or key in self:
            return
        tmp = self._path(f".new-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
        except OSError:
            return
        self._admit(key, tmp, len(data))

    def _admit(self, key: str, tmp: str, size: int) -> None:
        with self._lock:
            if key in self._entries:
                os.remove(tmp)
                return
            os.replace(tmp, self._path(key))
            self._entries[key] = size
            self._used += size
            self.inserted_bytes += size
            self._evict()

    def _evict(self) -> None:
        while self._used > self.capacity and self._entries:
            key, size = self._entries.popitem(last=False)
            self._used -= size
            self.evictions += 1
            self.evicted_bytes += size
            try:
                os.remove(self._path(key))
            except FileNotFoundError:
                pass

    def _forget(self, key: str) -> None:
        size = self._entries.pop(key, None)
        if size is not None:
            self._used -= size

    # -- management ----------------------------------------------------------------------------

    def resize(self, capacity: int) -> None:
        with self._lock:
            self.capacity = capacity
            self._evict()

    def clear(self) -> None:
        """Drop every entry (as a new executor would start); the metrics stay."""
        with self._lock:
            for key in list(self._entries):
                try:
                    os.remove(self._path(key))
                except FileNotFoundError:
                    pass
            self._entries.clear()
            self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def stats(self) -> dict[str, Any]:
        """Hit / miss / eviction counts and bytes, the bytes held and the capacity."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "hit_bytes": self.hit_bytes, "miss_bytes": self.miss_bytes,
                    "evicted_bytes": self.evicted_bytes, "inserted_bytes": self.inserted_bytes,
                    "files": len(self._entries), "used_bytes": self._used,
                    "capacity_bytes": self.capacity}

    def __repr__(self) -> str:
        return (f"FileCache({self.directory!r}, {self._used}/{self.capacity} bytes, "
                f"{len(self._entries)} files)")


_caches: dict[tuple[int, str], FileCache] = {}
_caches_lock = threading.Lock()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(parent: str) -> None:
    """Directories of processes that died without cleaning up (a killed executor)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit():
            if not _pid_alive(int(name[len(_PREFIX):])):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def process_file_cache(capacity: int, parent: str | None = None) -> FileCache | None:
    """This process's cache below ``parent`` (default: the system temp directory), created on
    first use with ``capacity`` bytes (a later, different capacity resizes it); None when
    ``capacity`` is 0."""
    if capacity <= 0:
        return None
    parent = parent or tempfile.gettempdir()
    pid = os.getpid()
    with _caches_lock:
        cache = _caches.get((pid, parent))
        if cache is None:
            _remove_stale(parent)
            directory = os.path.join(parent, f"{_PREFIX}{pid}")
            shutil.rmtree(directory, ignore_errors=True)
            cache = FileCache(directory, capacity)
            _caches[(pid, parent)] = cache
            atexit.register(shutil.rmtree, directory, True)
        elif cache.capacity != capacity:
            cache.resize(capacity)
        return cache


def all_process_caches() -> list[FileCache]:
    """The caches this process created (metrics, tests, benchmarks)."""
    pid = os.getpid()
    with _caches_lock:
        return [c for (p, _), c in _caches.items() if p == pid]
