"""The backend contract: key groups. A subtask holds only the keys of its key-group range; a
restore at another parallelism (rescaling) moves whole key groups, after full and incremental
checkpoints alike."""

from __future__ import annotations

import pytest

from keyedstate.errors import (
    ConfigurationError,
    KeyGroupRangeError,
)
from keyedstate.keygroups import KeyGroupRange
from keyedstate.state.descriptors import (
    ValueStateDescriptor,
)

from .common import (
    dump,
    everything,
    key_outside,
    keys_inside,
    register_all,
    write,
)


class TestKeyGroups:
    """Key-group ranges and rescaling, on every backend."""

    def test_keys_outside_the_key_group_range_are_refused(self, harness):
        b = harness.create(1, 3)
        outside = key_outside(harness, b)
        inside = keys_inside(harness, b, 1)[0]
        v = b.get_state(ValueStateDescriptor("v", "bigint"))
        b.set_current_key(inside)
        v.update(1)
        with pytest.raises(KeyGroupRangeError):
            b.set_current_key(outside)
        with pytest.raises(KeyGroupRangeError):
            b.set_current_key(inside, key_group=b.key_group_range.end + 1)
        with pytest.raises(KeyGroupRangeError):
            b.set_current_key_bytes(harness.key_serializer.serialize(outside),
                                    harness.key_serializer.key_group(outside, 128))
        b.set_current_key(inside, key_group=harness.key_serializer.key_group(inside, 128))
        assert v.value() == 1
        assert all(e.key_group in b.key_group_range for e in b.iter_entries("v"))

    def test_key_group_range_must_fit_max_parallelism(self, harness):
        with pytest.raises(ConfigurationError):
            harness.create(max_parallelism=8, key_group_range=KeyGroupRange(0, 8))

    @pytest.mark.parametrize(
        ("max_parallelism", "path"),
        [
            (128, (1, 3)),
            (128, (3, 1)),
            (128, (2, 5, 2)),
            (128, (4, 3, 7)),
            (8, (2, 8, 1)),
            (8, (1, 8)),
            (8, (8, 3, 8)),
            (8, (5, 6)),
        ],
        ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else f"maxp{v}",
    )
    def test_rescaling(self, make_harness, max_parallelism, path):
        h = make_harness(max_parallelism=max_parallelism)
        backends = h.create_all(path[0])
        register_all(backends)
        write(h, backends, range(120), seed=1)
        for step, parallelism in enumerate(path[1:], start=2):
            expected = everything(h, backends)
            handles = h.snapshot_all(backends)
            backends = h.create_all(parallelism, handles=handles)
            # dump() checks each entry and timer sits in the subtask owning its key group
            assert everything(h, backends) == expected
            register_all(backends)
            write(h, backends, range(step * 20, step * 20 + 100), seed=step)

    def test_rescaled_subtask_ignores_handles_it_does_not_overlap(self, harness):
        backends = harness.create_all(4)
        register_all(backends)
        write(harness, backends, range(100), seed=1)
        handles = harness.snapshot_all(backends)
        expected = dump(harness, backends)
        # subtask 0 of 2 owns the first half: given all handles, it takes subtasks 0 and 1's
        half = harness.create(0, 2, handles=handles)
        assert dump(harness, [half]) == {
            n: {i: v for i, v in entries.items()
                if harness.key_serializer.key_group(harness.key_serializer.deserialize(i[0]),
                                                    128) in half.key_group_range}
            for n, entries in expected.items()}
        # given only its own handles, the same
        only = harness.create(0, 2, handles=handles[:2])
        assert dump(harness, [only]) == dump(harness, [half])

    def test_rescale_after_incremental_checkpoints(self, harness):
        backends = harness.create_all(2)
        register_all(backends)
        for round_ in range(3):
            write(harness, backends, range(round_ * 20, round_ * 20 + 60), seed=round_)
            handles = harness.snapshot_all(backends)
        expected = everything(harness, backends)
        harness.delete_all_but(handles)
        assert everything(harness, harness.create_all(3, handles=handles)) == expected
