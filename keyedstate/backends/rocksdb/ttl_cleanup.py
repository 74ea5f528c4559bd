"""Flink's incremental TTL cleanup for a RocksDB state: a persistent cursor over the state's
column family in every instance that checks a few entries on each access."""

from __future__ import annotations

from typing import Sequence

import rocksdict

from keyedstate.backends.rocksdb.instance import RocksDBInstance
from keyedstate.backends.rocksdb.key_layout import TIMESTAMP
from keyedstate.backends.rocksdb.native import rocksdb_error
from keyedstate.errors import KeyedStateError

_unpack_ts = TIMESTAMP.unpack_from


class CleanupCursor:
    """Flink's incremental TTL cleanup: a cursor over the whole state (the column family of
    every instance, in key-group order) that checks a few entries on each state access and
    deletes expired ones. The iterator is persistent (one seek per pass over an instance, not
    per access); it sees a frozen view, so an expired-looking entry is read again before
    deleting it (it may have been rewritten since)."""

    def __init__(self, instances: Sequence[RocksDBInstance], name: str, ttl_ms: int) -> None:
        #: the keyed backend's instances (fixed for its life), in key-group order
        self._instances = instances
        self._name = name
        self._ttl_ms = ttl_ms
        self._it: rocksdict.RdictIter | None = None
        self._cf: rocksdict.Rdict | None = None
        #: the instance the cursor is in and the last key it checked there
        self._instance = 0
        self._last: bytes | None = None

    def reset(self) -> None:
        self._it = self._cf = None

    def _open(self, instance: int, after: bytes | None) -> rocksdict.RdictIter:
        cf = self._instances[instance].cf(self._name)
        it = cf.iter()
        if after is None:
            it.seek_to_first()
        else:
            it.seek(after + b"\x00")
        self._it, self._cf, self._instance, self._last = it, cf, instance, after
        return it

    def step(self, count: int, now: int) -> None:
        instances = len(self._instances)
        ttl_ms = self._ttl_ms
        try:
            it = self._it or self._open(self._instance, self._last)
            moves = 0
            for _ in range(count):
                while not it.valid():
                    it.status()
                    # End of this instance: on to the next one, wrapping around at the end;
                    # stop once every instance was found empty within this step.
                    moves += 1
                    if moves > instances:
                        return
                    it = self._open((self._instance + 1) % instances, None)
                cf = self._cf
                assert cf is not None
                key, raw = it.key(), it.value()
                if _unpack_ts(raw)[0] + ttl_ms <= now:
                    current = cf.get(key)
                    if current is not None and _unpack_ts(current)[0] + ttl_ms <= now:
                        cf.delete(key)
                self._last = key
                it.next()
        except KeyedStateError:
            raise
        except Exception as exc:
            raise rocksdb_error(exc, f"cleaning up expired entries of state {self._name!r}") \
                from exc
