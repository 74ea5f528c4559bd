"""The backend contract: what a restore refuses, with a typed error. A handle of another max
parallelism or backend, a descriptor that does not match the restored state, an unknown
state, damaged or missing snapshot files."""

from __future__ import annotations

import operator
import os
from pathlib import Path

import pytest

from keyedstate.backends import backend_names, load_backend
from keyedstate.errors import (
    CorruptCheckpointError,
    KeyGroupRangeError,
    MissingCheckpointFileError,
    StateNotFoundError,
    StateTypeMismatchError,
)
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)

from .common import (
    Average,
    dump,
    exercise,
    register_all,
    write,
)


class TestRestoreErrors:
    """Refused restores, on every backend."""

    def test_handle_that_does_not_fit_max_parallelism_is_refused(self, harness):
        b = harness.create()  # max parallelism 128: the handle covers [0, 127]
        register_all([b])
        write(harness, [b], range(10), seed=1)
        handle = harness.snapshot(b)
        with pytest.raises(KeyGroupRangeError):
            exercise(harness.create(max_parallelism=8, handles=[handle]))

    def test_handle_of_another_backend_is_refused(self, harness, state_backend):
        other_name = next(n for n in backend_names() if n != state_backend.name)
        other = harness.create(state_backend=load_backend(other_name))
        register_all([other])
        write(harness, [other], range(10), seed=1)
        handle = harness.snapshot(other)
        assert handle.backend == other_name
        with pytest.raises(StateTypeMismatchError):
            exercise(harness.create(handles=[handle]))

    @pytest.mark.parametrize(
        "descriptor",
        [
            ValueStateDescriptor("value", "string"),
            ValueStateDescriptor("value"),
            ListStateDescriptor("value", "bigint"),
            MapStateDescriptor("map", "bigint", "struct<a:int,b:array<string>>"),
            MapStateDescriptor("map", "string", "struct<a:string,b:array<string>>"),
            ReducingStateDescriptor("reducing", operator.add, "int"),
            AggregatingStateDescriptor("aggregating", Average(), "struct<sum:double,count:int>"),
        ],
        ids=["value-type", "value-untyped", "value-kind", "map-key", "map-value", "reducing",
             "aggregating"],
    )
    def test_descriptor_that_does_not_match_the_restored_state_is_refused(
            self, harness, descriptor):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(10), seed=1)
        restored = harness.create(handles=[harness.snapshot(b)])
        with pytest.raises(StateTypeMismatchError):
            restored.get_state(descriptor)

    def test_unknown_state_after_restore_is_not_found(self, harness):
        b = harness.create()
        register_all([b])
        restored = harness.create(handles=[harness.snapshot(b)])
        with pytest.raises(StateNotFoundError):
            list(restored.iter_entries("never-registered"))

    @pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "empty"])
    def test_damaged_snapshot_files_are_refused(self, harness, damage):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(80), seed=1)
        first = harness.snapshot(b)
        write(harness, [b], range(40, 60), seed=2)
        handle = harness.snapshot(b)  # incremental: damage files of both checkpoints
        files = handle.files()
        assert files, "a snapshot with state must reference files"
        expected_error = MissingCheckpointFileError if damage == "delete" \
            else CorruptCheckpointError
        for f in files:
            path = harness.storage.path(f.path)
            original = Path(path).read_bytes()
            if damage == "delete":
                os.remove(path)
            else:
                pos = len(original) // 2
                damaged = {
                    "truncate": original[:pos],
                    "flip": original[:pos] + bytes([original[pos] ^ 0x5A]) + original[pos + 1:]
                    if original else b"",
                    "empty": b"",
                }[damage]
                if damaged == original:  # an empty file can only be damaged by growing it
                    damaged = original + b"\x00"
                Path(path).write_bytes(damaged)
            with pytest.raises(expected_error):
                exercise(harness.create(handles=[handle]))
            Path(path).write_bytes(original)
        # undamaged, it restores (the loop really put every file back)
        assert dump(harness, [harness.create(handles=[handle])]) == dump(harness, [b])
        assert first.checkpoint_id < handle.checkpoint_id
