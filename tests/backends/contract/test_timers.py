"""The backend contract: timers. Registration (deduplicated), deletion, ``pop_due`` in
timestamp order across keys and key groups, timers registered while popping, the two time
domains, timers through a snapshot and restore."""

from __future__ import annotations

import random

from keyedstate.serde import serialize_namespace

from .common import (
    EVENT,
    NAMESPACES,
    PROC,
    dump_timers,
)


class TestTimers:
    """Event- and processing-time timers, on every backend."""

    def test_timer_registration_is_deduplicated(self, harness):
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        ts.register_event_time_timer(10)
        ts.register_event_time_timer(10)
        ts.register_event_time_timer(10, "w")
        ts.register_event_time_timer(11)
        b.set_current_key(2)
        ts.register_event_time_timer(10)
        timers = list(ts.timers(EVENT))
        assert [t.timestamp for t in timers] == [10, 10, 10, 11]
        kb1 = harness.key_serializer.serialize(1)
        assert {(t.timestamp, t.key_bytes, t.namespace_bytes) for t in timers} == {
            (10, kb1, serialize_namespace(None)), (10, kb1, serialize_namespace("w")),
            (11, kb1, serialize_namespace(None)),
            (10, harness.key_serializer.serialize(2), serialize_namespace(None))}
        for t in timers:
            assert t.key_group == harness.key_serializer.key_group(
                harness.key_serializer.deserialize(t.key_bytes), 128)
        assert ts.next_timestamp(EVENT) == 10
        assert ts.next_timestamp(PROC) is None

    def test_timer_delete(self, harness):
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        ts.register_event_time_timer(10)
        ts.register_event_time_timer(10, "w")
        ts.register_processing_time_timer(10)
        ts.delete_event_time_timer(10)
        ts.delete_event_time_timer(99)  # deleting a missing timer is fine
        b.set_current_key(2)
        ts.delete_event_time_timer(10, "w")  # other key: nothing to delete
        assert [(t.timestamp, t.namespace_bytes) for t in ts.timers(EVENT)] == [
            (10, serialize_namespace("w"))]
        assert len(list(ts.timers(PROC))) == 1  # domains are separate
        b.set_current_key(1)
        ts.delete_processing_time_timer(10)
        assert list(ts.timers(PROC)) == []

    def test_pop_due_in_timestamp_order_across_keys_and_key_groups(self, harness):
        b = harness.create()
        ts = b.timer_service
        rnd = random.Random(7)
        expected = set()
        for k in range(300):
            b.set_current_key(k)
            for _ in range(2):
                t = rnd.randint(0, 1000)
                ns = rnd.choice(NAMESPACES)
                ts.register_event_time_timer(t, ns)
                expected.add((t, harness.key_serializer.serialize(k), serialize_namespace(ns)))
        assert len({harness.key_serializer.key_group(k, 128) for k in range(300)}) > 100
        popped = list(ts.pop_due(EVENT, 500))
        assert [t.timestamp for t in popped] == sorted(t.timestamp for t in popped)
        assert popped == sorted(popped)
        assert {(t.timestamp, t.key_bytes, t.namespace_bytes) for t in popped} == {
            e for e in expected if e[0] <= 500}
        rest = list(ts.timers(EVENT))
        assert {(t.timestamp, t.key_bytes, t.namespace_bytes) for t in rest} == {
            e for e in expected if e[0] > 500}
        assert ts.next_timestamp(EVENT) == min(e[0] for e in expected if e[0] > 500)
        assert list(ts.pop_due(EVENT, 500)) == []
        assert list(ts.pop_due(PROC, 10_000)) == []  # the other domain is untouched
        assert len(list(ts.pop_due(EVENT, 10_000))) == len(rest)
        assert list(ts.timers(EVENT)) == []

    def test_pop_due_removes_each_timer_before_yielding_it(self, harness):
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        ts.register_event_time_timer(5)
        ts.register_event_time_timer(6)
        it = ts.pop_due(EVENT, 10)
        first = next(it)
        assert first.timestamp == 5
        assert [t.timestamp for t in ts.timers(EVENT)] == [6]
        assert [t.timestamp for t in it] == [6]

    def test_timers_registered_while_popping_fire_when_due(self, harness):
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        ts.register_event_time_timer(5)
        fired = []
        for timer in ts.pop_due(EVENT, 10):
            fired.append(timer.timestamp)
            b.set_current_key_bytes(timer.key_bytes, timer.key_group)
            if timer.timestamp == 5:
                ts.register_event_time_timer(8)  # due: fires in this pass
                ts.register_event_time_timer(20)  # not due
                b.set_current_key(2)
                ts.register_processing_time_timer(6)  # other domain: not in this pass
        assert fired == [5, 8]
        assert [t.timestamp for t in ts.timers(EVENT)] == [20]
        assert [t.timestamp for t in ts.timers(PROC)] == [6]

    def test_timers_registered_below_fired_ones_still_fire(self, harness):
        # RocksDB reads a key group's head from its last fired timer (not through the
        # tombstones of the fired ones); a timer registered below that point must lower it.
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        for t in range(100, 200):
            ts.register_event_time_timer(t)
        assert [t.timestamp for t in ts.pop_due(EVENT, 149)] == list(range(100, 150))
        ts.register_event_time_timer(120)  # below every fired timer
        ts.register_event_time_timer(149)  # the last fired one, again
        ts.register_event_time_timer(5, "w")  # long past, another namespace
        assert ts.next_timestamp(EVENT) == 5
        assert [t.timestamp for t in ts.timers(EVENT)][:4] == [5, 120, 149, 150]
        assert [t.timestamp for t in ts.pop_due(EVENT, 160)] == [5, 120, 149,
                                                                  *range(150, 161)]
        ts.delete_event_time_timer(161)  # the head, deleted: the next one is the head
        assert ts.next_timestamp(EVENT) == 162
        fired = []
        for timer in ts.pop_due(EVENT, 170):
            fired.append(timer.timestamp)
            if timer.timestamp == 165:  # while popping, below the timer just fired
                b.set_current_key(1)
                ts.register_event_time_timer(163)
        assert fired == [162, 163, 164, 165, 163, *range(166, 171)]
        assert [t.timestamp for t in ts.pop_due(EVENT, 1000)] == list(range(171, 200))
        assert ts.next_timestamp(EVENT) is None
        ts.register_event_time_timer(7)
        assert [t.timestamp for t in ts.pop_due(EVENT, 7)] == [7]

    def test_processing_and_event_time_are_separate(self, harness):
        b = harness.create()
        ts = b.timer_service
        b.set_current_key(1)
        ts.register_event_time_timer(10)
        ts.register_processing_time_timer(10)
        ts.register_processing_time_timer(30)
        assert [t.timestamp for t in ts.pop_due(PROC, 20)] == [10]
        assert [t.timestamp for t in ts.timers(EVENT)] == [10]
        assert [t.timestamp for t in ts.pop_due(EVENT, 20)] == [10]
        assert [t.timestamp for t in ts.timers(PROC)] == [30]

    def test_timers_survive_snapshot_and_restore(self, harness):
        b = harness.create()
        for k in range(50):
            b.set_current_key(k)
            b.timer_service.register_event_time_timer(100 + k, "w" if k % 2 else None)
            b.timer_service.register_processing_time_timer(200 + k)
        b.set_current_key(0)
        b.timer_service.delete_processing_time_timer(200)
        expected = dump_timers(harness, [b])
        assert len(expected) == 99
        handle = harness.snapshot(b)
        restored = harness.create(handles=[handle])
        assert dump_timers(harness, [restored]) == expected
        popped = list(restored.timer_service.pop_due(EVENT, 124))
        assert [t.timestamp for t in popped] == list(range(100, 125))
