"""Time for TTL and processing-time timers: a provider that tests and tools can replace."""

from __future__ import annotations

import time
from typing import Protocol


class TtlTimeProvider(Protocol):
    """Milliseconds since the epoch. Must pickle (sent to executors with the backend config)."""

    def now_ms(self) -> int: ...


class SystemTimeProvider:
    """Wall-clock time."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class ManualTimeProvider:
    """A clock that moves only when told to: for tests and for reading state 'as of' a time."""

    def __init__(self, now_ms: int = 0) -> None:
        self._now = now_ms

    def now_ms(self) -> int:
        return self._now

    def set(self, now_ms: int) -> None:
        self._now = now_ms

    def advance(self, delta_ms: int) -> None:
        self._now += delta_ms


def is_expired(last_access_ms: int, ttl_ms: int, now_ms: int) -> bool:
    """Flink's rule: expired once ``last_access + ttl <= now``."""
    return last_access_ms + ttl_ms <= now_ms
