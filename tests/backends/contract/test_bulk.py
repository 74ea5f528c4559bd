"""The backend contract: bulk state calls (``get_many``, ``update_many``, ``add_many``,
``put_many``, ``clear_many``).

The rule under test: a bulk call over some keys has exactly the effect of the per-key call for
each key in order. Two keyed backends of one job get the same random script, one per key
(``set_current_key`` then the per-key call), one in bulk; their results, their live entries
with TTL timestamps (``iter_records``), their restored snapshots (full, incremental, rescaled)
must be identical, with TTL off and on.
"""

from __future__ import annotations

import operator

import pyarrow as pa
import pytest

from keyedstate.backends.base.backend import KeyedStateBackend
from keyedstate.errors import ConfigurationError, KeyGroupRangeError
from keyedstate.state.batch_keys import BatchKeys
from keyedstate.state.descriptors import (
    ReducingStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)

from .bulk import TTLS, Script, bulk_kinds, records
from .common import Harness, key_outside, keys_inside


class TestBulkStateAccess:
    """Bulk calls against per-key calls, on every backend."""

    @pytest.fixture(params=sorted(TTLS))
    def ttl(self, request: pytest.FixtureRequest) -> StateTtlConfig | None:
        return TTLS[request.param]

    def _pair(self, harness: Harness, ttl: StateTtlConfig | None
              ) -> tuple[KeyedStateBackend, KeyedStateBackend]:
        a, b = harness.create(), harness.create()
        for d in bulk_kinds(ttl).values():
            a.get_state(d)
            b.get_state(d)
        return a, b

    def test_bulk_calls_store_what_per_key_calls_store(self, harness, ttl):
        a, b = self._pair(harness, ttl)
        Script(harness, ttl, 1, range(40)).run(a, b, 12)
        assert records([a]) == records([b])
        assert any(records([a]).values()), "the script stored nothing"

    def test_bulk_calls_snapshot_and_restore_as_per_key_calls(self, harness, ttl):
        """Full snapshot, then bulk changes journaled into an incremental one (the heap's
        journal marks), then a rescaling restore: the same state as per key at every point."""
        a, b = self._pair(harness, ttl)
        script = Script(harness, ttl, 2, range(60))
        script.run(a, b, 4)
        full_a, full_b = harness.snapshot(a), harness.snapshot(b)
        script.run(a, b, 4)
        expected = records([a])
        assert records([b]) == expected
        inc_a, inc_b = harness.snapshot(a), harness.snapshot(b)
        for handle in (inc_a, inc_b):
            restored = harness.create(handles=[handle])
            for d in bulk_kinds(ttl).values():
                restored.get_state(d)
            assert records([restored]) == expected
        # Rescaled to 2: each new subtask continues in bulk from the bulk-written snapshot and
        # per key from the per-key one.
        per_key = harness.create_all(2, handles=[inc_a])
        bulk = harness.create_all(2, handles=[inc_b])
        assert records(per_key) == records(bulk) == {
            name: sorted(rows, key=lambda r: r[0]) for name, rows in expected.items()}
        for i in range(2):
            for d in bulk_kinds(ttl).values():
                per_key[i].get_state(d)
                bulk[i].get_state(d)
            inside = keys_inside(harness, bulk[i], 15)
            Script(harness, ttl, 3 + i, inside).run(per_key[i], bulk[i], 3)
        # Scaled back in to 1 (RocksDB: one instance per old subtask, so bulk calls span
        # several instances).
        merged_per_key = harness.create(handles=harness.snapshot_all(per_key))
        merged_bulk = harness.create(handles=harness.snapshot_all(bulk))
        for d in bulk_kinds(ttl).values():
            merged_per_key.get_state(d)
            merged_bulk.get_state(d)
        assert records([merged_per_key]) == records([merged_bulk])
        Script(harness, ttl, 5, range(60)).run(merged_per_key, merged_bulk, 3)
        del full_a, full_b

    def test_bulk_calls_leave_the_current_key_alone(self, harness):
        b = harness.create()
        state = b.get_state(ValueStateDescriptor("value", "bigint"))
        b.set_current_key(7)
        state.update(70)
        keys = BatchKeys.of([1, 2, 3], harness.key_serializer, b.max_parallelism)
        state.update_many(keys, pa.array([10, 20, 30]))
        assert b.get_current_key() == 7 and state.value() == 70
        assert state.get_many(keys) == [10, 20, 30]
        state.update_many(keys, [None, 21, None])
        assert state.get_many(keys) == [None, 21, None]
        state.clear_many(keys)
        assert state.get_many(keys) == [None, None, None] and state.value() == 70

    def test_bulk_calls_use_the_current_namespace(self, harness):
        b = harness.create()
        state = b.get_state(ReducingStateDescriptor("sum", operator.add, "bigint"))
        keys = BatchKeys.of([5], harness.key_serializer, b.max_parallelism)
        state.set_current_namespace("w1")
        state.add_many(keys, [3])
        state.add_many(keys, [4])
        assert state.get_many(keys) == [7]
        state.set_current_namespace(None)
        assert state.get_many(keys) == [None]

    def test_bulk_keys_outside_the_key_group_range_are_refused(self, harness):
        b = harness.create(0, 2)
        outside = key_outside(harness, b)
        keys = BatchKeys.of([*keys_inside(harness, b, 2), outside], harness.key_serializer,
                            b.max_parallelism)
        for d in bulk_kinds(None).values():
            state = b.get_state(d)
            with pytest.raises(KeyGroupRangeError, match=str(outside)):
                state.clear_many(keys)

    def test_bulk_values_must_be_one_per_key(self, harness):
        b = harness.create()
        state = b.get_state(ValueStateDescriptor("value", "bigint"))
        keys = BatchKeys.of([1, 2], harness.key_serializer, b.max_parallelism)
        with pytest.raises(ConfigurationError, match="3 values for 2 keys"):
            state.update_many(keys, [1, 2, 3])
        with pytest.raises(ConfigurationError, match="given twice"):
            BatchKeys.of([1, 2, 1], harness.key_serializer, b.max_parallelism)
