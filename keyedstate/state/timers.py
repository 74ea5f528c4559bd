"""Timers: event-time and processing-time callbacks per key and namespace (Flink's
``InternalTimerService``). They live in the state backend, so every snapshot holds them and they
survive restore and rescaling (a timer moves with its key's key group)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Iterator


class TimeDomain(StrEnum):
    EVENT_TIME = "event_time"
    PROCESSING_TIME = "processing_time"


#: Internal state names under which backends store timers (never valid user state names).
TIMER_STATE_NAMES = {TimeDomain.EVENT_TIME: "_timers_event", TimeDomain.PROCESSING_TIME: "_timers_proc"}


@dataclass(frozen=True, order=True, slots=True)
class Timer:
    """A registered timer. Timers order by timestamp first, then deterministically by the rest;
    one key and namespace has at most one timer per timestamp and domain (deduplicated)."""

    timestamp: int
    key_group: int
    key_bytes: bytes
    namespace_bytes: bytes


class InternalTimerService(ABC):
    """Timers of one subtask, both domains; they apply to the backend's current key."""

    @abstractmethod
    def register_event_time_timer(self, timestamp: int, namespace: Any = None) -> None:
        """Fire ``on_timer`` once the watermark reaches ``timestamp``; re-registering is a no-op."""

    @abstractmethod
    def delete_event_time_timer(self, timestamp: int, namespace: Any = None) -> None: ...

    @abstractmethod
    def register_processing_time_timer(self, timestamp: int, namespace: Any = None) -> None: ...

    @abstractmethod
    def delete_processing_time_timer(self, timestamp: int, namespace: Any = None) -> None: ...

    @abstractmethod
    def pop_due(self, domain: TimeDomain, time: int) -> Iterator[Timer]:
        """Yield and remove every timer of ``domain`` with ``timestamp <= time``, in timestamp
        order. Each timer is removed before it is yielded; timers registered while iterating
        that are due are yielded too (as Flink fires timers registered in ``on_timer``)."""

    @abstractmethod
    def timers(self, domain: TimeDomain) -> Iterator[Timer]:
        """All timers of ``domain`` without removing them, in timestamp order, ties by key group
        (same-timestamp timers of one key group in an order of the backend's, deterministic)."""

    def next_timestamp(self, domain: TimeDomain) -> int | None:
        """The earliest timer's timestamp, or None."""
        first = next(self.timers(domain), None)
        return None if first is None else first.timestamp
