"""The backend contract: list state (add, add_all, update, clear)."""

from __future__ import annotations

from keyedstate.state.descriptors import (
    ListStateDescriptor,
)

from .common import (
    dump,
    ident,
)


class TestListState:
    """List state, on every backend."""

    def test_list_state(self, harness):
        b = harness.create()
        lst = b.get_state(ListStateDescriptor("l", "bigint"))
        b.set_current_key(1)
        assert lst.get() == []
        lst.add(1)
        lst.add(2)
        lst.add_all([3, 4])
        lst.add_all([])
        assert lst.get() == [1, 2, 3, 4]
        b.set_current_key(2)
        assert lst.get() == []
        lst.add_all(iter([9, 8]))  # any iterable
        b.set_current_key(1)
        lst.update([7])
        assert lst.get() == [7]
        lst.update(x for x in [5, 6])
        assert lst.get() == [5, 6]
        assert dump(harness, [b], ["l"]) == {
            "l": {ident(harness, 1): [5, 6], ident(harness, 2): [9, 8]}}
        lst.update([])
        assert lst.get() == []
        b.set_current_key(2)
        lst.clear()
        assert lst.get() == []
        assert dump(harness, [b], ["l"]) == {"l": {}}

    def test_list_add_all_to_empty_stores_nothing(self, harness):
        b = harness.create()
        lst = b.get_state(ListStateDescriptor("l", "string"))
        b.set_current_key(1)
        lst.add_all([])
        lst.update([])
        assert lst.get() == []
        assert dump(harness, [b], ["l"]) == {"l": {}}
