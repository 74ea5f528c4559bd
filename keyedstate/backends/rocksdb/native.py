"""The rocksdict call layer: opening a DB, scans, write batches, and the one translation of
rocksdict's errors.

Every ``rocksdict`` call that can fail is made through this module's helpers or translated with
:func:`rocksdb_error`, the single place where a generic rocksdict exception becomes a typed
:class:`~keyedstate.errors.BackendError` (``raise ... from exc``). Tuning is :mod:`.options`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

import rocksdict

from keyedstate.backends.rocksdb.options import DEFAULT_COLUMN_FAMILY, RocksDBOptions
from keyedstate.errors import BackendError, KeyedStateError


def rocksdb_error(exc: BaseException, what: str) -> KeyedStateError:
    """The typed error for an exception raised by rocksdict while doing ``what``.

    The one translation point: callers write ``raise rocksdb_error(exc, what) from exc``.
    keyedstate's own errors pass through unchanged.
    """
    if isinstance(exc, KeyedStateError):
        return exc
    if isinstance(exc, rocksdict.DbClosedError):
        return BackendError(f"RocksDB is closed while {what}; the keyed backend was closed, "
                            f"create a new one")
    message = str(exc)
    hint = "check the local disk (space, permissions) and the RocksDB LOG file"
    if message.startswith("Corruption"):
        hint = "the local files are corrupt; restore from a checkpoint"
    return BackendError(f"RocksDB failed while {what}: {message}; {hint}")


@contextmanager
def native(what: str) -> Iterator[None]:
    """Run a block of rocksdict calls, translating their errors (not for hot paths)."""
    try:
        yield
    except KeyedStateError:
        raise
    except Exception as exc:
        raise rocksdb_error(exc, what) from exc


def open_db(path: str, options: RocksDBOptions,
            column_families: Mapping[str, object] | list[str] | None = None
            ) -> rocksdict.Rdict:
    """Open (creating if missing) the DB at ``path`` with every column family listed, each
    with the same tuned options. Existing column families not listed are opened too (RocksDB
    refuses to open a DB without all of them)."""
    names = set(column_families or ())
    with native(f"opening the RocksDB at {path}"):
        try:
            names.update(rocksdict.Rdict.list_cf(path, options.to_options()))
        except Exception:  # a new, empty directory has no column families yet
            pass
        names.discard(DEFAULT_COLUMN_FAMILY)
        return rocksdict.Rdict(path, options.to_options(),
                               column_families={n: options.to_options() for n in names})


def scan(cf: rocksdict.Rdict, lower: bytes | None, upper: bytes | None,
         what: str) -> Iterator[tuple[bytes, bytes]]:
    """``(key, value)`` of ``cf`` with ``lower <= key < upper`` (None: unbounded), in key order.

    Unlike ``Rdict.items()`` this checks the iterator's status at the end, so a corrupt block
    raises :class:`BackendError` instead of silently ending the scan.
    """
    try:
        if upper is None:
            it = cf.iter()
        else:
            # The bound in the read options lets RocksDB stop at it: without it, a seek into a
            # range holding only deleted entries (fired timers, removed map entries) walks every
            # tombstone up to the next live key, wherever that is.
            read_options = rocksdict.ReadOptions()
            read_options.set_iterate_upper_bound(upper)
            it = cf.iter(read_options)
        if lower is None:
            it.seek_to_first()
        else:
            it.seek(lower)
        while it.valid():
            key = it.key()
            if upper is not None and key >= upper:
                return
            yield key, it.value()
            it.next()
        it.status()
    except KeyedStateError:
        raise
    except Exception as exc:
        raise rocksdb_error(exc, what) from exc


def scan_all(cf: rocksdict.Rdict, what: str) -> Iterator[tuple[bytes, bytes]]:
    """Every ``(key, value)`` of ``cf`` in key order, by rocksdict's own iterator: one call a
    pair where :func:`scan` makes four, but an iterator error may end it early without a word
    (``Rdict.items()`` checks no status). Only for reads whose early end costs speed, never a
    result: the value cache's warm-up, whose missing entries are read from RocksDB on first
    use."""
    try:
        yield from cf.items()
    except KeyedStateError:
        raise
    except Exception as exc:
        raise rocksdb_error(exc, what) from exc


def estimate_distinct_keys(cf: rocksdict.Rdict, what: str) -> int:
    """RocksDB's estimate of ``cf``'s keys, each counted once. ``rocksdb.estimate-num-keys``
    counts a key once in every sorted run holding it, so a key rewritten in every batch counts
    once per flush until a compaction merges the runs (up to 8 runs with universal compaction's
    trigger). It is scaled here by the live share of the SST files' bytes:
    ``rocksdb.estimate-live-data-size`` (the bytes of the largest set of files whose key
    ranges don't overlap) over ``rocksdb.total-sst-files-size``. Memtables count in the first
    and not in the others: meant for a DB just restored, whose memtables are empty."""
    try:
        keys = cf.property_int_value("rocksdb.estimate-num-keys") or 0
        total = cf.property_int_value("rocksdb.total-sst-files-size") or 0
        live = cf.property_int_value("rocksdb.estimate-live-data-size") or 0
    except Exception as exc:
        raise rocksdb_error(exc, what) from exc
    if total <= 0 or live >= total:
        return keys
    return keys * live // total


def column_family_batch(handle: rocksdict.ColumnFamily) -> rocksdict.WriteBatch:
    """An empty raw write batch whose puts and deletes go to the column family ``handle``."""
    batch = rocksdict.WriteBatch(raw_mode=True)
    batch.set_default_column_family(handle)
    return batch


def prefix_upper_bound(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (None: no bound)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes((stripped[-1] + 1,))


class _ClosedNative:
    """Stands in for a closed DB or column family: every call raises ``DbClosedError``, which
    :func:`rocksdb_error` turns into a :class:`BackendError` naming the state."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def closed(*_: Any, **__: Any) -> Any:
            raise rocksdict.DbClosedError("the keyed backend is closed")
        return closed


CLOSED: Any = _ClosedNative()
