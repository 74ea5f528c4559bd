"""The backend contract: state TTL. Expiry per update type and per element (list elements,
map entries), expired entries absent from snapshots, timestamps kept by a restore, the TTL
changed or switched on or off on restore."""

from __future__ import annotations

import operator

import pytest

from keyedstate.errors import (
    StateTypeMismatchError,
)
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    TtlUpdateType,
    ValueStateDescriptor,
)
from keyedstate.state.ttl import ManualTimeProvider

from .common import (
    T0,
    Average,
    dump,
    ident,
    ttl,
)


class TestTtl:
    """State TTL, on every backend."""

    def test_ttl_value_on_create_and_write(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint", default=-1, ttl=ttl(100)))
        clock = harness.clock
        b.set_current_key(1)
        v.update(1)
        clock.advance(60)
        assert v.value() == 1  # a read does not refresh under OnCreateAndWrite
        clock.advance(39)
        assert v.value() == 1
        clock.advance(1)
        assert v.value() == -1  # last access + ttl <= now: expired
        assert dump(harness, [b], ["v"]) == {"v": {}}
        v.update(2)
        clock.advance(60)
        v.update(3)  # a write refreshes
        clock.advance(60)
        assert v.value() == 3
        assert dump(harness, [b], ["v"]) == {"v": {ident(harness, 1): 3}}

    def test_ttl_value_on_read_and_write(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor(
            "v", "bigint", ttl=ttl(100, TtlUpdateType.ON_READ_AND_WRITE)))
        clock = harness.clock
        b.set_current_key(1)
        v.update(1)
        clock.advance(60)
        assert v.value() == 1  # refreshed at +60
        clock.advance(99)
        assert v.value() == 1  # +159 < +160; refreshed at +159
        clock.advance(99)
        assert v.value() == 1  # +258; refreshed
        clock.advance(100)
        assert v.value() is None
        assert dump(harness, [b], ["v"]) == {"v": {}}

    def test_ttl_list_elements_expire_one_by_one(self, harness):
        b = harness.create()
        lst = b.get_state(ListStateDescriptor("l", "string", ttl=ttl(100)))
        clock = harness.clock
        b.set_current_key(1)
        lst.add("a")
        clock.advance(50)
        lst.add_all(["b", "c"])
        clock.advance(49)
        assert lst.get() == ["a", "b", "c"]
        clock.advance(1)
        assert lst.get() == ["b", "c"]
        assert dump(harness, [b], ["l"]) == {"l": {ident(harness, 1): ["b", "c"]}}
        lst.add("d")
        clock.advance(50)
        assert lst.get() == ["d"]
        clock.advance(50)
        assert lst.get() == []
        assert dump(harness, [b], ["l"]) == {"l": {}}

    def test_ttl_map_entries_expire_one_by_one(self, harness):
        b = harness.create()
        m = b.get_state(MapStateDescriptor("m", "string", "bigint", ttl=ttl(100)))
        clock = harness.clock
        b.set_current_key(1)
        m.put("a", 1)
        clock.advance(50)
        m.put_all({"b": 2, "c": 3})
        clock.advance(50)
        assert m.get("a") is None
        assert not m.contains("a")
        assert m.get("b") == 2
        assert dict(m.items()) == {"b": 2, "c": 3}
        assert sorted(m.keys()) == ["b", "c"]
        assert sorted(m.values()) == [2, 3]
        assert not m.is_empty()
        assert dump(harness, [b], ["m"]) == {"m": {
            ident(harness, 1, None, "b"): 2, ident(harness, 1, None, "c"): 3}}
        clock.advance(50)
        assert m.is_empty()
        assert dict(m.items()) == {}
        assert dump(harness, [b], ["m"]) == {"m": {}}

    def test_ttl_map_on_read_and_write_refreshes_the_read_entry(self, harness):
        b = harness.create()
        m = b.get_state(MapStateDescriptor(
            "m", "string", "bigint", ttl=ttl(100, TtlUpdateType.ON_READ_AND_WRITE)))
        b.set_current_key(1)
        m.put_all({"a": 1, "b": 2})
        harness.clock.advance(60)
        assert m.get("a") == 1
        harness.clock.advance(60)
        assert m.get("a") == 1
        assert m.get("b") is None

    def test_ttl_reducing_and_aggregating_start_over_after_expiry(self, harness):
        b = harness.create()
        r = b.get_state(ReducingStateDescriptor("r", operator.add, "bigint", ttl=ttl(100)))
        agg = b.get_state(AggregatingStateDescriptor(
            "a", Average(), "struct<sum:double,count:bigint>", ttl=ttl(100)))
        b.set_current_key(1)
        r.add(1)
        agg.add(1.0)
        harness.clock.advance(100)
        assert r.get() is None
        assert agg.get() is None
        r.add(5)
        agg.add(5.0)
        assert r.get() == 5  # the expired 1 is not reduced in
        assert agg.get() == 5.0
        assert dump(harness, [b], ["a"]) == {"a": {ident(harness, 1): {"sum": 5.0, "count": 1}}}

    def test_ttl_expired_entries_are_not_in_a_full_snapshot(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint", ttl=ttl(100)))
        lst = b.get_state(ListStateDescriptor("l", "bigint", ttl=ttl(100)))
        m = b.get_state(MapStateDescriptor("m", "bigint", "bigint", ttl=ttl(100)))
        for k in range(40):  # old entries, written at T0
            b.set_current_key(k)
            v.update(k)
            lst.add(k)
            m.put(k, k)
        harness.clock.advance(60)
        for k in range(20, 60):  # fresh entries, written at T0 + 60
            b.set_current_key(k)
            v.update(-k)
            lst.add(-k)
            m.put(-k, -k)
        harness.clock.advance(40)  # T0 + 100: everything written at T0 expired
        live = dump(harness, [b], ["v", "l", "m"])
        assert len(live["v"]) == 40 and len(live["l"]) == 40 and len(live["m"]) == 40
        handle = harness.snapshot(b, full=True)
        # Restore with the clock back at T0 + 50: expired entries, had they been written, would
        # be alive again (timestamps survive a restore); they must simply not be there.
        restored = harness.create(handles=[handle], time_provider=ManualTimeProvider(T0 + 50))
        assert dump(harness, [restored], ["v", "l", "m"]) == live

    def test_ttl_restored_entries_keep_their_timestamps(self, harness):
        b = harness.create()
        d = ValueStateDescriptor("v", "bigint", ttl=ttl(100))
        v = b.get_state(d)
        b.set_current_key(1)
        v.update(1)
        harness.clock.advance(60)
        handle = harness.snapshot(b)
        restored = harness.create(handles=[handle])
        rv = restored.get_state(d)
        restored.set_current_key(1)
        assert rv.value() == 1
        harness.clock.advance(39)
        assert rv.value() == 1
        harness.clock.advance(1)  # T0 + 100: expired, as it would have without the restore
        assert rv.value() is None
        assert dump(harness, [restored], ["v"]) == {"v": {}}

    def test_ttl_duration_may_change_on_restore(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "bigint", ttl=ttl(100)))
        b.set_current_key(1)
        v.update(1)
        handle = harness.snapshot(b)
        restored = harness.create(handles=[handle])
        rv = restored.get_state(ValueStateDescriptor("v", "bigint", ttl=ttl(1000)))
        restored.set_current_key(1)
        harness.clock.advance(500)
        assert rv.value() == 1
        harness.clock.advance(500)
        assert rv.value() is None

    def test_ttl_can_be_switched_on_or_off_on_restore(self, harness):
        """Switched on, restored values live ``ttl`` from the restore; switched off, they stay
        (docs/schema-evolution.md). A registered state keeps its TTL setting."""
        b = harness.create()
        b.set_current_key(1)
        b.get_state(ValueStateDescriptor("plain", "bigint")).update(1)
        b.get_state(ValueStateDescriptor("expiring", "bigint", ttl=ttl(100))).update(2)
        handle = harness.snapshot(b)
        harness.clock.advance(50)
        restored = harness.create(handles=[handle])
        restored.set_current_key(1)
        now_expiring = restored.get_state(ValueStateDescriptor("plain", "bigint", ttl=ttl(100)))
        never_expiring = restored.get_state(ValueStateDescriptor("expiring", "bigint"))
        assert (now_expiring.value(), never_expiring.value()) == (1, 2)
        harness.clock.advance(99)
        assert (now_expiring.value(), never_expiring.value()) == (1, 2)
        harness.clock.advance(1)
        assert (now_expiring.value(), never_expiring.value()) == (None, 2)
        with pytest.raises(StateTypeMismatchError):
            restored.get_state(ValueStateDescriptor("plain", "bigint"))
