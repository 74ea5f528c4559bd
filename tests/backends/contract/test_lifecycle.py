"""The backend contract: a keyed backend's life cycle (close, also as a context manager)."""

from __future__ import annotations

from keyedstate.state.descriptors import (
    ValueStateDescriptor,
)

from .common import (
    register_all,
    write,
)


class TestLifecycle:
    """Closing keyed backends, on every backend."""

    def test_close_is_idempotent(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(10), seed=1)
        harness.snapshot(b)
        b.close()
        b.close()
        with harness.create() as c:
            c.get_state(ValueStateDescriptor("v", "bigint"))
        c.close()
