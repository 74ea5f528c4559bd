"""Timers of the heap backend: Flink's ``HeapPriorityQueueSet``, one per time domain.

Each domain keeps, per key group, the set of registered timers (deduplication and rescaling:
a key group's timers move with it) and one binary heap over all key groups (firing order).
A deletion only removes the timer from its key group's set; the heap entry becomes stale and
is skipped when it reaches the top, so register and delete are O(log n) and O(1). The heap is
rebuilt from the sets once stale entries outnumber live ones, which bounds its size.

Snapshots journal timers per key group: a change marks its key group, and an incremental
snapshot rewrites the whole timer set of the marked key groups only (FLIP-151 snapshots timers
fully; per key group is as simple on restore and much smaller when few keys change).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from keyedstate.errors import ConfigurationError
from keyedstate.serde import serialize_namespace
from keyedstate.state.timers import TIMER_STATE_NAMES, InternalTimerService, TimeDomain, Timer

if TYPE_CHECKING:
    from keyedstate.backends.base.backend import KeyedStateBackend

#: (timestamp, key_bytes, namespace_bytes): a timer inside its key group's set.
TimerEntry = tuple[int, bytes, bytes]
#: (timestamp, key_group, key_bytes, namespace_bytes): Timer's sort order, as a cheap tuple.
_HeapEntry = tuple[int, int, bytes, bytes]

_MIN_STALE_TO_COMPACT = 64


class TimerQueue:
    """The timers of one domain: per-key-group sets plus one lazily-cleaned heap.

    ``name`` and ``marks`` make it a journaled table for :class:`~.snapshot.Journal`: marks map
    each changed key group to an empty dict (the key group is rewritten whole)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.by_key_group: dict[int, set[TimerEntry]] = {}
        self.marks: dict[int, dict[Any, Any]] | None = None
        self._heap: list[_HeapEntry] = []
        self._stale = 0

    def _mark(self, key_group: int) -> None:
        if self.marks is not None and key_group not in self.marks:
            self.marks[key_group] = {}

    def __len__(self) -> int:
        return sum(len(s) for s in self.by_key_group.values())

    def add(self, key_group: int, entry: TimerEntry) -> bool:
        """Register; False (and nothing changes) if the same timer is already registered."""
        timers = self.by_key_group.get(key_group)
        if timers is None:
            timers = self.by_key_group[key_group] = set()
        elif entry in timers:
            return False
        timers.add(entry)
        heapq.heappush(self._heap, (entry[0], key_group, entry[1], entry[2]))
        self._mark(key_group)
        return True

    def remove(self, key_group: int, entry: TimerEntry) -> bool:
        timers = self.by_key_group.get(key_group)
        if timers is None or entry not in timers:
            return False
        timers.discard(entry)
        if not timers:
            del self.by_key_group[key_group]
        self._mark(key_group)
        # The heap copy stays until it surfaces; compact once stale copies dominate.
        self._stale += 1
        if self._stale > _MIN_STALE_TO_COMPACT and self._stale > len(self._heap) // 2:
            self.rebuild()
        return True

    def rebuild(self) -> None:
        """Recreate the heap from the sets (after a restore, or to drop stale entries)."""
        self._heap = [(ts, kg, k, ns) for kg, timers in self.by_key_group.items()
                      for ts, k, ns in timers]
        heapq.heapify(self._heap)
        self._stale = 0

    def _is_live(self, top: _HeapEntry) -> bool:
        timers = self.by_key_group.get(top[1])
        return timers is not None and (top[0], top[2], top[3]) in timers

    def peek(self) -> _HeapEntry | None:
        heap = self._heap
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)
            self._stale = max(0, self._stale - 1)
        return heap[0] if heap else None

    def pop_due(self, time: int) -> Iterator[Timer]:
        # Re-reads the heap top on every step, so timers registered by the consumer while this
        # generator is suspended are seen if they are due.
        while True:
            top = self.peek()
            if top is None or top[0] > time:
                return
            heapq.heappop(self._heap)
            ts, kg, key, ns = top
            timers = self.by_key_group[kg]
            timers.discard((ts, key, ns))
            if not timers:
                del self.by_key_group[kg]
            self._mark(kg)
            yield Timer(ts, kg, key, ns)

    def ordered(self) -> Iterator[Timer]:
        entries = sorted((ts, kg, k, ns) for kg, timers in self.by_key_group.items()
                         for ts, k, ns in timers)
        return (Timer(*e) for e in entries)

    def copy_key_groups(self, key_groups: Iterable[int] | None = None
                        ) -> dict[int, list[TimerEntry]]:
        """A point-in-time copy for a snapshot: every key group, or the given ones (an empty
        list for a key group without timers: its timers were all removed)."""
        if key_groups is None:
            return {kg: list(timers) for kg, timers in self.by_key_group.items()}
        return {kg: list(self.by_key_group.get(kg, ())) for kg in key_groups}

    def restore_key_group(self, key_group: int, entries: Iterable[TimerEntry]) -> None:
        """Replace a key group's timers (restore); call :meth:`rebuild` once afterwards."""
        timers = set(entries)
        if timers:
            self.by_key_group[key_group] = timers
        else:
            self.by_key_group.pop(key_group, None)

    def clear(self) -> None:
        self.by_key_group.clear()
        self._heap.clear()
        self._stale = 0


class HeapInternalTimerService(InternalTimerService):
    """Event-time and processing-time timers of one heap keyed backend.

    Timers apply to the backend's current key (``set_current_key``); namespaces are encoded with
    :func:`keyedstate.serde.serialize_namespace`. A full snapshot copies every timer, an
    incremental one the timers of the key groups whose timers changed since its base.
    """

    def __init__(self, backend: KeyedStateBackend) -> None:
        self._backend = backend
        self.queues: dict[TimeDomain, TimerQueue] = {
            domain: TimerQueue(TIMER_STATE_NAMES[domain]) for domain in TimeDomain
        }

    def _entry(self, timestamp: int, namespace: Any) -> tuple[int, TimerEntry]:
        backend = self._backend
        if backend.current_key_bytes is None:
            raise ConfigurationError(
                "a timer needs a current key: call set_current_key(...) on the keyed backend "
                "before registering or deleting timers"
            )
        if not isinstance(timestamp, int) or isinstance(timestamp, bool):
            raise ConfigurationError(f"timer timestamp must be an int (ms), got {timestamp!r}")
        entry = (timestamp, backend.current_key_bytes, serialize_namespace(namespace))
        return backend.current_key_group, entry

    def register_event_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self.queues[TimeDomain.EVENT_TIME].add(*self._entry(timestamp, namespace))

    def delete_event_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self.queues[TimeDomain.EVENT_TIME].remove(*self._entry(timestamp, namespace))

    def register_processing_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self.queues[TimeDomain.PROCESSING_TIME].add(*self._entry(timestamp, namespace))

    def delete_processing_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        self.queues[TimeDomain.PROCESSING_TIME].remove(*self._entry(timestamp, namespace))

    def pop_due(self, domain: TimeDomain, time: int) -> Iterator[Timer]:
        return self.queues[TimeDomain(domain)].pop_due(time)

    def timers(self, domain: TimeDomain) -> Iterator[Timer]:
        return self.queues[TimeDomain(domain)].ordered()

    def next_timestamp(self, domain: TimeDomain) -> int | None:
        top = self.queues[TimeDomain(domain)].peek()
        return None if top is None else top[0]
