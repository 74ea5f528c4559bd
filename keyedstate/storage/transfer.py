"""Moving checkpoint files: options, retries on transient errors, parallelism, byte counts.

:class:`TransferOptions` is the tuning of every transfer between a job's processes and its
checkpoint storage (Flink's names where Flink has one); it travels with the
:class:`~keyedstate.storage.checkpoint_storage.CheckpointStorage` to executors, so it is frozen and
pickles. :func:`with_retries` retries one storage call on a *transient* error (timeouts, 5xx,
throttling: :func:`is_transient`) with exponential backoff and jitter, and raises
:class:`~keyedstate.errors.TransientStorageError` once the attempts are used up; any other error
(a missing file, refused credentials, a missing bucket) is raised at once. :class:`TransferStats`
counts the bytes that went through this process and the bytes the store duplicated by itself.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

from keyedstate.errors import ConfigurationError, KeyedStateError, TransientStorageError

T = TypeVar("T")
R = TypeVar("R")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

#: ``inline_threshold`` / ``merge_file_size`` value meaning "on for object stores, off for a
#: local disk" (see :meth:`TransferOptions.effective_inline_threshold`).
AUTO = -1


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """How checkpoint files move between a job's processes and its storage.

    ``threads``: parallel transfers per snapshot or restore (Flink's
    ``state.backend.rocksdb.checkpoint.transfer.thread.num``, 4). ``attempts``, ``backoff_s``,
    ``max_backoff_s``: each storage call is tried up to ``attempts`` times on a transient error,
    sleeping ``backoff_s * 2**n`` (capped, with jitter) in between. ``inline_threshold``: a
    private state file (one no later checkpoint re-references) smaller than this is stored
    inside ``_metadata`` instead of as an object (Flink's ``state.storage.fs.memory-threshold``,
    20 KiB). ``merge_file_size``: the state files of one
    snapshot of one subtask that are smaller than this are packed into one object (FLIP-306's
    file merging); ``merge_max_size`` bounds such an object (Flink's
    ``execution.checkpointing.file-merging.max-file-size``, 32 MiB). ``AUTO`` (-1) for the two
    thresholds means their default on an object store and 0 (off) on a local disk, where a
    small file costs an inode, not a request. ``cache_bytes``: capacity of the process-wide
    file cache of restore downloads and uploads (0 disables it; ForSt's
    ``state.backend.forst.cache.size-based-limit``); ``cache_dir`` its directory (default: a
    per-process folder in the system temp directory). The cache is used for object stores only.
    """

    threads: int = 4
    attempts: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    inline_threshold: int = AUTO
    merge_file_size: int = AUTO
    merge_max_size: int = 32 * MiB
    cache_bytes: int = 1 * GiB
    cache_dir: str | None = None

    #: defaults the two ``AUTO`` thresholds take on an object store
    DEFAULT_INLINE_THRESHOLD = 20 * KiB
    DEFAULT_MERGE_FILE_SIZE = 4 * MiB

    def __post_init__(self) -> None:
        for name in ("threads", "attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"TransferOptions.{name} must be an int >= 1, got "
                                         f"{value!r}")
        for name in ("backoff_s", "max_backoff_s"):
            if getattr(self, name) < 0:
                raise ConfigurationError(f"TransferOptions.{name} must be >= 0")
        for name in ("inline_threshold", "merge_file_size"):
            if getattr(self, name) < AUTO:
                raise ConfigurationError(f"TransferOptions.{name} must be >= 0 (or -1: auto)")
        if self.merge_max_size < 1 or self.cache_bytes < 0:
            raise ConfigurationError("TransferOptions.merge_max_size must be >= 1 and "
                                     "cache_bytes >= 0")

    def effective_inline_threshold(self, object_store: bool) -> int:
        if self.inline_threshold != AUTO:
            return self.inline_threshold
        return self.DEFAULT_INLINE_THRESHOLD if object_store else 0

    def effective_merge_file_size(self, object_store: bool) -> int:
        if self.merge_file_size != AUTO:
            return min(self.merge_file_size, self.merge_max_size)
        return min(self.DEFAULT_MERGE_FILE_SIZE, self.merge_max_size) if object_store else 0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based): exponential, capped,
        with full jitter in its upper half so that parallel transfers don't retry in step."""
        ceiling = min(self.max_backoff_s, self.backoff_s * (2 ** attempt))
        return ceiling / 2 + random.random() * ceiling / 2


DEFAULT_TRANSFER = TransferOptions()


# -- transient errors ----------------------------------------------------------------------------

#: errno values object-store clients use for retryable conditions: s3fs maps SlowDown and 503
#: to EBUSY, 500 InternalError to EREMOTEIO, unknown server errors to EIO.
_TRANSIENT_ERRNOS = frozenset({errno.EBUSY, errno.EREMOTEIO, errno.EIO, errno.EAGAIN,
                               errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
                               errno.ECONNREFUSED, errno.EPIPE, errno.ENETUNREACH,
                               errno.EHOSTUNREACH})
_TRANSIENT_WORDS = ("slowdown", "reduce your request rate", "throttl", "toomanyrequests",
                    "serviceunavailable", "service unavailable", "internalerror",
                    "internal error", "requesttimeout", "timed out", "timeout")
_TRANSIENT_CLASS_WORDS = ("Timeout", "ConnectionError", "ConnectionClosed", "EndpointConnection",
                          "ServerDisconnected", "ClientPayloadError", "IncompleteRead",
                          "ResponseParserError")


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the call that raised ``exc`` may succeed: timeouts, connection resets,
    server errors (500, 503) and throttling. A missing file, refused credentials, a missing
    bucket or any keyedstate error is never transient."""
    if isinstance(exc, (FileNotFoundError, PermissionError, FileExistsError,
                        IsADirectoryError, NotADirectoryError, KeyedStateError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    names = [c.__name__ for c in type(exc).__mro__]
    if any(word in name for name in names for word in _TRANSIENT_CLASS_WORDS):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    text = str(exc).lower()
    if isinstance(exc, OSError) and any(word in text for word in _TRANSIENT_WORDS):
        return True
    code = getattr(exc, "response", None)
    if isinstance(code, Mapping):  # botocore ClientError not translated by the client
        status = code.get("ResponseMetadata", {}).get("HTTPStatusCode")
        error_code = str(code.get("Error", {}).get("Code", "")).lower()
        return status in (429, 500, 502, 503, 504) or any(
            w in error_code for w in ("slowdown", "throttl", "internal", "unavailable"))
    return False


def with_retries(what: str, call: Callable[[], T], options: TransferOptions = DEFAULT_TRANSFER,
                 on_retry: Callable[[BaseException], None] | None = None) -> T:
    """``call()``, retried on transient errors (:func:`is_transient`) up to
    ``options.attempts`` times with backoff; then :class:`TransientStorageError` naming
    ``what``. Other errors propagate unchanged at once."""
    for attempt in range(options.attempts):
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if attempt + 1 >= options.attempts:
                raise TransientStorageError(
                    f"{what} failed {options.attempts} times with transient errors (last: "
                    f"{type(exc).__name__}: {exc}); the store is throttling, timing out or "
                    f"unavailable. Retry later, or raise TransferOptions.attempts"
                ) from exc
            if on_retry is not None:
                on_retry(exc)
            time.sleep(options.backoff(attempt))
    raise AssertionError("unreachable")  # pragma: no cover


#: The transfer threads of this process, kept between calls: starting a thread costs
#: milliseconds on a busy machine, and a restarted job's subtasks each transfer a dozen files
#: in several calls (restore, duplication, upload). Keyed by thread count; rebuilt in a forked
#: child, which inherits the executor object but none of its threads.
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_pid = 0
_pools_lock = threading.Lock()
#: set in the pool's own threads: a call made from one runs inline (no thread waits on a pool
#: it occupies itself)
_in_pool = threading.local()


def _mark_pool_thread() -> None:
    _in_pool.active = True


def _pool(threads: int) -> ThreadPoolExecutor:
    global _pools_pid
    with _pools_lock:
        if _pools_pid != os.getpid():
            _pools.clear()
            _pools_pid = os.getpid()
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(
                threads, thread_name_prefix=f"keyedstate-transfer-{threads}",
                initializer=_mark_pool_thread)
        return pool


def parallel_map(fn: Callable[[T], R], items: Sequence[T] | Iterable[T], threads: int) -> list[R]:
    """``[fn(x) for x in items]`` on up to ``threads`` threads, in order; the first error is
    raised once every started call has ended (no transfer is left running behind it).

    The threads are the process's transfer pool for that count, reused across calls; a call
    from inside a pool thread runs inline."""
    items = list(items)
    if threads <= 1 or len(items) <= 1 or getattr(_in_pool, "active", False):
        return [fn(x) for x in items]
    pool = _pool(threads)
    futures = [pool.submit(fn, x) for x in items]
    error: BaseException | None = None
    results: list[R] = []
    for future in futures:
        try:
            results.append(future.result())
        except BaseException as exc:  # keep waiting for the others, raise the first
            if error is None:
                error = exc
                for other in futures:
                    other.cancel()
    if error is not None:
        raise error
    return results


# -- byte counts ---------------------------------------------------------------------------------

#: ``properties`` keys of handles and ``_metadata`` recording transfers (all decimal strings).
PROP_PREFIX = "transfer."
RESTORE_PREFIX = "restore."


@dataclass
class TransferStats:
    """Bytes and objects moved for one snapshot, restore or savepoint. ``uploaded`` and
    ``downloaded`` went through this process; ``duplicated`` was copied by the store itself
    (server-side copy, hard link, local copy on one disk); ``inlined`` went into ``_metadata``;
    ``merged_files`` small files packed into merged objects; ``cache_hit`` bytes a restore took
    from the local file cache instead of downloading; ``retries`` transient failures retried.
    Thread-safe increments (transfers run in parallel)."""

    uploaded_bytes: int = 0
    uploaded_objects: int = 0
    downloaded_bytes: int = 0
    downloaded_objects: int = 0
    duplicated_bytes: int = 0
    duplicated_objects: int = 0
    inlined_bytes: int = 0
    inlined_files: int = 0
    merged_files: int = 0
    cache_hit_bytes: int = 0
    cache_hit_files: int = 0
    retries: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def merge(self, other: TransferStats) -> None:
        self.add(**other.as_dict())

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_properties(self, prefix: str = PROP_PREFIX) -> dict[str, str]:
        """Non-zero counts as ``{prefix + "uploaded-bytes": "123", ...}``."""
        return {prefix + name.replace("_", "-"): str(value)
                for name, value in self.as_dict().items() if value}

    @classmethod
    def from_properties(cls, properties: Mapping[str, str],
                        prefix: str = PROP_PREFIX) -> TransferStats:
        stats = cls()
        for f in fields(cls):
            value = properties.get(prefix + f.name.replace("_", "-"))
            if value is not None:
                try:
                    setattr(stats, f.name, int(value))
                except ValueError:
                    pass
        return stats

    def __getstate__(self) -> dict[str, int]:
        return self.as_dict()

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


@dataclass
class RestorePhases:
    """Wall seconds of one restore by phase, as this process saw them: ``download_s`` from the
    first request for the snapshot's files to the last file verified on local disk or in
    memory (every GET, file-cache hits too), ``open_s`` what follows: RocksDB's opens, clips
    and ingests, or the heap backend's decoding of its files into tables. A restore that
    reads nothing has both 0. Not recorded in any snapshot (benchmarks and tests read it from
    the keyed backend's ``restore_phases``)."""

    download_s: float = 0.0
    open_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"download_s": self.download_s, "open_s": self.open_s}


def strip_transfer_properties(properties: Mapping[str, str]) -> dict[str, str]:
    """``properties`` without the transfer and restore counts (they describe the snapshot that
    recorded them, not a copy of it)."""
    return {k: v for k, v in properties.items()
            if not k.startswith((PROP_PREFIX, RESTORE_PREFIX))}
