"""The core demo: a click stream through one keyed operator, checkpointed every batch.

Per user it keeps running totals (a typed ValueState) and event-time session windows with a
30-minute gap (a MapState of open sessions plus event-time timers, merged as Flink merges
session windows). Every batch is one checkpoint; halfway the job is restored from its latest
checkpoint at another parallelism (rescaling); at the end it drains (watermark to +infinity,
every timer fires). The results are checked against a plain-Python oracle computed from the
same events. This version runs in-process (:class:`~keyedstate.runtime.local.LocalKeyedOperator`);
the Spark job of the same shape comes with the Spark runtime.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from keyedstate.backends.base.backend import KeyedStateBackend
from keyedstate.runtime.local import LocalKeyedOperator
from keyedstate.state.descriptors import MapStateDescriptor, ValueStateDescriptor
from keyedstate.state.timers import TimeDomain

GAP_MS = 30 * 60 * 1000
WATERMARK_DELAY_MS = 5 * 60 * 1000

TOTALS = ValueStateDescriptor("totals", "count bigint, total double")
SESSIONS = MapStateDescriptor("sessions", "bigint", "last bigint, events bigint, amount double")

Event = tuple[str, int, float]  # user_id, event time (ms), amount


def generate_events(n: int, users: int, seed: int = 42) -> Iterator[Event]:
    """Clicks in event-time order up to ``WATERMARK_DELAY_MS`` of disorder (so none is late)."""
    rng = random.Random(seed)
    t = 1_700_000_000_000
    for _ in range(n):
        t += rng.randint(0, 400)
        jitter = rng.randint(0, WATERMARK_DELAY_MS // 2)
        yield f"user-{rng.randrange(users):06d}", t - jitter, round(rng.uniform(0.5, 100.0), 2)


def on_event(backend: KeyedStateBackend, user: str, event: Event) -> None:
    _, ts, amount = event
    totals = backend.get_state(TOTALS)
    now = totals.value() or {"count": 0, "total": 0.0}
    totals.update({"count": now["count"] + 1, "total": now["total"] + amount})

    # Session windows: merge the new event's window [ts, ts + gap) with every open session it
    # overlaps, as Flink's MergingWindowSet does; one timer per session at its end.
    sessions = backend.get_state(SESSIONS)
    start, last, events, total = ts, ts, 1, amount
    for s_start, s in list(sessions.items()):
        if s_start <= ts + GAP_MS and ts <= s["last"] + GAP_MS:
            backend.timer_service.delete_event_time_timer(s["last"] + GAP_MS)
            sessions.remove(s_start)
            start, last = min(start, s_start), max(last, s["last"])
            events, total = events + s["events"], total + s["amount"]
    sessions.put(start, {"last": last, "events": events, "amount": total})
    backend.timer_service.register_event_time_timer(last + GAP_MS)


def on_timer(backend: KeyedStateBackend, timestamp: int, emit: Callable[[tuple], None]) -> None:
    sessions = backend.get_state(SESSIONS)
    for s_start, s in list(sessions.items()):
        if s["last"] + GAP_MS == timestamp:
            sessions.remove(s_start)
            emit((backend.get_current_key(), s_start, timestamp, s["events"], s["amount"]))


def fire_timers(op: LocalKeyedOperator, watermark: int, emit: Callable[[tuple], None]) -> None:
    for sub in op.subtasks:
        for timer in sub.timer_service.pop_due(TimeDomain.EVENT_TIME, watermark):
            sub.set_current_key_bytes(timer.key_bytes, timer.key_group)
            on_timer(sub, timer.timestamp, emit)


@dataclass
class DemoReport:
    events: int = 0
    batches: int = 0
    seconds: float = 0.0
    parallelism: list[int] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    sessions: int = 0
    users: int = 0
    verified: bool = False


def oracle(events: list[Event]) -> tuple[dict[str, tuple[int, float]], list[tuple]]:
    """Totals and sessions computed directly from all events, independently of keyedstate."""
    totals: dict[str, tuple[int, float]] = {}
    by_user: dict[str, list[Event]] = {}
    for e in events:
        c, t = totals.get(e[0], (0, 0.0))
        totals[e[0]] = (c + 1, t + e[2])
        by_user.setdefault(e[0], []).append(e)
    sessions = []
    for user, evs in by_user.items():
        evs.sort(key=lambda e: e[1])
        start = last = evs[0][1]
        n, amount = 0, 0.0
        for _, ts, a in evs:
            if ts > last + GAP_MS:
                sessions.append((user, start, last + GAP_MS, n, amount))
                start, n, amount = ts, 0, 0.0
            last = max(last, ts)
            n, amount = n + 1, amount + a
        sessions.append((user, start, last + GAP_MS, n, amount))
    return totals, sessions


def run_local_demo(directory: str, events: int, users: int, batches: int, backend: str,
                   parallelism: int, rescale_to: int,
                   progress: Callable[[int], None] | None = None) -> DemoReport:
    all_events = list(generate_events(events, users))
    report = DemoReport(events=events, parallelism=[parallelism])
    emitted: list[tuple] = []
    batch_size = max(1, len(all_events) // batches)
    started = time.perf_counter()
    op = LocalKeyedOperator(f"{directory}/checkpoints", key_types=["string"], backend=backend,
                            parallelism=parallelism, local_dir=f"{directory}/local")
    max_ts = -(1 << 62)
    try:
        for b, offset in enumerate(range(0, len(all_events), batch_size)):
            batch = all_events[offset:offset + batch_size]
            op.process(((e[0], e) for e in batch), on_event)
            max_ts = max(max_ts, max(e[1] for e in batch))
            fire_timers(op, max_ts - WATERMARK_DELAY_MS, emitted.append)
            completed = op.checkpoint({"batch_id": str(b)})
            report.checkpoints.append({
                "id": completed.checkpoint_id,
                "incremental_bytes": completed.metadata.incremental_size,
                "full_bytes": completed.metadata.full_size,
            })
            report.batches += 1
            if progress:
                progress(len(batch))
            if b == batches // 2 and rescale_to != parallelism:
                op.rescale(rescale_to)
                report.parallelism.append(rescale_to)
        fire_timers(op, 1 << 62, emitted.append)  # drain: watermark to +infinity
        completed = op.checkpoint({"batch_id": "drain"})
        totals = {}
        for sub in op.subtasks:
            for entry in sub.iter_entries(TOTALS.name):
                user = op.key_serializer.deserialize(entry.key_bytes)
                totals[user] = (entry.value["count"], entry.value["total"])
    finally:
        op.close()
    report.seconds = time.perf_counter() - started
    expected_totals, expected_sessions = oracle(all_events)
    report.sessions = len(emitted)
    report.users = len(totals)
    report.verified = (
        totals.keys() == expected_totals.keys()
        and all(totals[u][0] == c and abs(totals[u][1] - t) < 1e-6
                for u, (c, t) in expected_totals.items())
        and sorted((s[0], s[1], s[2], s[3]) for s in emitted)
        == sorted((s[0], s[1], s[2], s[3]) for s in expected_sessions)
    )
    return report
