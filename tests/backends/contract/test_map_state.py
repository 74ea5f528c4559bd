"""The backend contract: map state, typed and untyped user keys and values."""

from __future__ import annotations

from keyedstate.state.descriptors import (
    MapStateDescriptor,
)

from .common import (
    Point,
    dump,
    ident,
)


class TestMapState:
    """Map state, on every backend."""

    def test_map_state(self, harness):
        b = harness.create()
        m = b.get_state(MapStateDescriptor("m", "string", "bigint"))
        b.set_current_key(1)
        assert m.is_empty()
        assert m.get("a") is None
        assert not m.contains("a")
        assert list(m.items()) == [] and list(m.keys()) == [] and list(m.values()) == []
        m.put("a", 1)
        m.put("b", 2)
        m.put_all({"c": 3, "d": 4})
        m.put("a", 10)
        assert m.get("a") == 10
        assert m.contains("c") and not m.contains("z")
        assert not m.is_empty()
        assert dict(m.items()) == {"a": 10, "b": 2, "c": 3, "d": 4}
        assert sorted(m.keys()) == ["a", "b", "c", "d"]
        assert sorted(m.values()) == [2, 3, 4, 10]
        m.remove("b")
        m.remove("nope")  # removing a missing key is fine
        assert m.get("b") is None and not m.contains("b")
        b.set_current_key(2)
        assert m.is_empty()
        m.put("a", -1)
        assert dump(harness, [b], ["m"]) == {"m": {
            ident(harness, 1, None, "a"): 10, ident(harness, 1, None, "c"): 3,
            ident(harness, 1, None, "d"): 4, ident(harness, 2, None, "a"): -1}}
        b.set_current_key(1)
        m.clear()
        assert m.is_empty() and dict(m.items()) == {}
        b.set_current_key(2)
        assert dict(m.items()) == {"a": -1}

    def test_map_state_untyped_keys_and_values(self, harness):
        b = harness.create()
        m = b.get_state(MapStateDescriptor("m"))
        b.set_current_key(1)
        m.put((1, "x"), Point(1, 2))
        m.put(Point(3, 4), [1, {"a"}])
        m.put(None, "none-key")
        assert m.get((1, "x")) == Point(1, 2)
        assert m.get(Point(3, 4)) == [1, {"a"}]
        assert m.get(None) == "none-key"
        assert m.contains(Point(3, 4)) and not m.contains(Point(4, 3))
        assert dict(m.items()) == {(1, "x"): Point(1, 2), Point(3, 4): [1, {"a"}],
                                   None: "none-key"}
