"""Timers in RocksDB column families ``_timers_event`` and ``_timers_proc``.

Their keys (:mod:`.key_layout`) start with the key group, as for state, so timers are part of
every snapshot and move with their key group on rescale; within one key group they are sorted
by time. :meth:`RocksDBTimerService.pop_due` merges the key groups: it keeps the head (earliest
timer) of every non-empty key group in a heap, and re-reads a key group's head after each timer
it fires and whenever a timer of that key group is registered or deleted meanwhile, so timers
registered by ``on_timer`` callbacks are seen (Flink's ``InternalTimerServiceImpl`` over a
``KeyGroupPartitionedPriorityQueue``).

A keyed backend with several RocksDB instances keeps each key group's timers in the instance
owning it: writes and head reads go to that instance, and ``pop_due``, ``timers`` and
``next_timestamp`` merge the heads of every key group of every instance in one heap.
"""

from __future__ import annotations

import heapq
from typing import Any, Iterator

import rocksdict

from keyedstate.backends.rocksdb.key_context import RocksDBKeyContext
from keyedstate.backends.rocksdb.key_layout import key_group_of, parse_timer_key, timer_key
from keyedstate.backends.rocksdb.native import rocksdb_error, scan
from keyedstate.errors import ConfigurationError, KeyedStateError
from keyedstate.keygroups import KeyGroupRange, serialize_key_group
from keyedstate.serde import serialize_namespace
from keyedstate.state.timers import TIMER_STATE_NAMES, InternalTimerService, TimeDomain, Timer


class RocksDBTimerService(InternalTimerService):
    """Both timer domains of one keyed backend, applying to its current key."""

    def __init__(self, context: RocksDBKeyContext) -> None:
        self._context = context
        #: Per domain and key group, a key no live timer of that key group is below: the last
        #: fired timer (timers fire in order), lowered by any registration below it. Heads are
        #: read from there, never from the key group's start: fired timers are deleted, and a
        #: seek from the start would walk every one of their tombstones until compaction drops
        #: them (Flink caches the heads in memory for the same reason,
        #: ``RocksDBCachingPriorityQueueSet``). In memory only: a restored backend starts at
        #: the key groups' starts.
        self._low: dict[TimeDomain, dict[int, bytes]] = {d: {} for d in TimeDomain}
        # Key groups touched while a pop_due of that domain is running (one set per generator).
        self._watchers: dict[TimeDomain, list[set[int]]] = {d: [] for d in TimeDomain}

    # -- registration --------------------------------------------------------------------------

    def _key(self, timestamp: int, namespace: Any) -> tuple[bytes, int]:
        context = self._context
        key_bytes = context.current_key_bytes
        if key_bytes is None:
            raise ConfigurationError(
                "a timer was registered or deleted without a current key; call "
                "set_current_key() on the keyed backend first"
            )
        if not isinstance(timestamp, int) or isinstance(timestamp, bool):
            raise ConfigurationError(f"timer timestamp must be an int (ms), got {timestamp!r}")
        key_group = context.current_key_group
        kg_bytes = serialize_key_group(key_group, context.key_group_prefix_bytes)
        return timer_key(kg_bytes, timestamp, key_bytes, serialize_namespace(namespace)), key_group

    def _change(self, domain: TimeDomain, timestamp: int, namespace: Any, put: bool) -> None:
        key, key_group = self._key(timestamp, namespace)
        cf = self._cf(domain, key_group)
        try:
            if put:
                cf.put(key, b"")
            else:
                cf.delete(key)
        except Exception as exc:
            raise rocksdb_error(exc, f"changing a {domain} timer") from exc
        if put:
            low = self._low[domain]
            mark = low.get(key_group)
            if mark is not None and key < mark:
                low[key_group] = key
        for touched in self._watchers[domain]:
            touched.add(key_group)

    def register_event_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self._change(TimeDomain.EVENT_TIME, timestamp, namespace, True)

    def delete_event_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self._change(TimeDomain.EVENT_TIME, timestamp, namespace, False)

    def register_processing_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self._change(TimeDomain.PROCESSING_TIME, timestamp, namespace, True)

    def delete_processing_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self._change(TimeDomain.PROCESSING_TIME, timestamp, namespace, False)

    # -- reading -------------------------------------------------------------------------------

    def _kg_bytes(self, key_group: int) -> bytes:
        return serialize_key_group(key_group, self._context.key_group_prefix_bytes)

    def _seek_key(self, domain: TimeDomain, key_group: int) -> bytes:
        """Where the head of ``key_group`` is searched from (see ``_low``)."""
        return self._low[domain].get(key_group) or self._kg_bytes(key_group)

    def _cf(self, domain: TimeDomain, key_group: int) -> rocksdict.Rdict:
        """The timer column family of ``domain`` in the instance owning ``key_group``."""
        return self._context.instance_of(key_group).cf(TIMER_STATE_NAMES[domain])

    def _heads(self, domain: TimeDomain) -> Iterator[tuple[int, bytes]]:
        """``(key group, first timer key)`` of every non-empty key group in key-group order,
        over every instance."""
        for instance in self._context.instances:
            yield from self._instance_heads(domain, instance.cf(TIMER_STATE_NAMES[domain]),
                                            instance.key_group_range)

    def _instance_heads(self, domain: TimeDomain, cf: rocksdict.Rdict,
                        kg_range: KeyGroupRange) -> Iterator[tuple[int, bytes]]:
        """``(key group, first timer key)`` of every non-empty key group of ``kg_range`` in one
        instance's column family, one seek each."""
        n = self._context.key_group_prefix_bytes
        try:
            read_options = rocksdict.ReadOptions()
            read_options.set_iterate_upper_bound(self._kg_bytes(kg_range.end + 1))
            it = cf.iter(read_options)
            it.seek(self._seek_key(domain, kg_range.start))
            while it.valid():
                raw = it.key()
                key_group = key_group_of(raw, n)
                yield key_group, raw
                if key_group == kg_range.end:
                    return
                it.seek(self._seek_key(domain, key_group + 1))
            it.status()
        except KeyedStateError:
            raise
        except Exception as exc:
            raise rocksdb_error(exc, "reading timers") from exc

    def _head(self, domain: TimeDomain, key_group: int) -> bytes | None:
        """The earliest timer key of one key group (a fresh iterator sees every write)."""
        for raw, _ in scan(self._cf(domain, key_group), self._seek_key(domain, key_group),
                           self._kg_bytes(key_group + 1), "reading timers"):
            return raw
        return None

    def pop_due(self, domain: TimeDomain, time: int) -> Iterator[Timer]:
        n = self._context.key_group_prefix_bytes
        touched: set[int] = set()
        self._watchers[domain].append(touched)
        try:
            # Step 1. The head of every non-empty key group, in a heap by (timestamp, kg).
            heads: dict[int, bytes | None] = {}
            heap: list[tuple[int, int, bytes]] = []
            for key_group, raw in self._heads(domain):
                heads[key_group] = raw
                heap.append((parse_timer_key(raw, n).timestamp, key_group, raw))
            heapq.heapify(heap)
            while True:
                # Step 2. Re-read heads of key groups changed since (fired, registered, deleted);
                # older heap entries of those key groups become stale.
                for key_group in touched:
                    head = self._head(domain, key_group)
                    heads[key_group] = head
                    if head is not None:
                        heapq.heappush(heap, (parse_timer_key(head, n).timestamp, key_group, head))
                touched.clear()
                # Step 3. Fire the earliest live head if due; remove it before yielding.
                while heap and heads.get(heap[0][1]) != heap[0][2]:
                    heapq.heappop(heap)
                if not heap or heap[0][0] > time:
                    return
                _, key_group, raw = heapq.heappop(heap)
                try:
                    self._cf(domain, key_group).delete(raw)
                except Exception as exc:
                    raise rocksdb_error(exc, f"removing a fired {domain} timer") from exc
                # It was the key group's earliest timer: none is below it any more (a timer
                # registered below it later lowers the mark again).
                self._low[domain][key_group] = raw
                heads[key_group] = None
                touched.add(key_group)
                yield parse_timer_key(raw, n)
        finally:
            self._watchers[domain].remove(touched)

    def timers(self, domain: TimeDomain) -> Iterator[Timer]:
        n = self._context.key_group_prefix_bytes
        runs = [
            (parse_timer_key(raw, n) for raw, _ in
             scan(self._cf(domain, key_group), head, self._kg_bytes(key_group + 1),
                  "reading timers"))
            for key_group, head in list(self._heads(domain))
        ]
        # Each key group is sorted by time; ties keep key-group order (deterministic).
        return heapq.merge(*runs, key=lambda t: (t.timestamp, t.key_group))

    def next_timestamp(self, domain: TimeDomain) -> int | None:
        n = self._context.key_group_prefix_bytes
        stamps = [parse_timer_key(raw, n).timestamp for _, raw in self._heads(domain)]
        return min(stamps, default=None)
