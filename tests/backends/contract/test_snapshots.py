"""The backend contract: snapshot and restore. Every state kind round-trips; a snapshot holds
the state as of the ``snapshot()`` call; incremental chains, subsumption, failed snapshots,
full snapshots, and restores with and without claiming the restored files."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from keyedstate.errors import (
    StateNotFoundError,
)
from keyedstate.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
)

from .common import (
    ALL_NAMES,
    NAMESPACES,
    all_kinds,
    dump,
    dump_timers,
    everything,
    ident,
    register_all,
    write,
)


class TestSnapshots:
    """Snapshots and restores, on every backend."""

    def test_roundtrip_of_every_state_kind(self, harness, state_backend):
        b = harness.create()
        descriptors = register_all([b])
        b.get_state(ValueStateDescriptor("registered_but_empty", "bigint"))
        write(harness, [b], range(60), seed=1)
        expected = everything(harness, [b])
        assert all(expected[0][n] for n in ALL_NAMES) and expected[1]
        infos = sorted(b.state_meta_infos(), key=lambda i: i.name)
        [handle] = harness.snapshot_all([b])
        assert handle.backend == state_backend.name == b.name
        assert handle.subtask_index == 0
        assert handle.key_group_range == b.key_group_range
        assert handle.checkpoint_id == 1
        assert sorted(handle.states, key=lambda i: i.name) == infos
        for f in handle.files():
            harness.storage.read_verified(f)  # present, right size and checksum
        assert handle.full_size == sum(f.size for f in handle.files())
        restored = harness.create(handles=[handle])
        # restored states are readable before anyone registers them
        assert sorted(restored.state_meta_infos(), key=lambda i: i.name) == infos
        assert everything(harness, [restored]) == expected
        assert list(restored.iter_entries("registered_but_empty")) == []
        # ... and through the state API
        states = {n: restored.get_state(d) for n, d in descriptors.items()}
        original = {n: b.get_state(d) for n, d in descriptors.items()}
        for k in range(60):
            b.set_current_key(k)
            restored.set_current_key(k)
            for ns in NAMESPACES:
                for n in ALL_NAMES:
                    states[n].set_current_namespace(ns)
                    original[n].set_current_namespace(ns)
                assert states["value"].value() == original["value"].value()
                assert states["pickled"].value() == original["pickled"].value()
                assert states["list"].get() == original["list"].get()
                assert dict(states["map"].items()) == dict(original["map"].items())
                assert dict(states["pmap"].items()) == dict(original["pmap"].items())
                assert states["reducing"].get() == original["reducing"].get()
                assert states["aggregating"].get() == original["aggregating"].get()

    def test_restored_state_keeps_working(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(30), seed=1)
        restored = harness.create(handles=[harness.snapshot(b)])
        register_all([restored])
        write(harness, [b], range(20, 50), seed=2)
        write(harness, [restored], range(20, 50), seed=2)
        assert everything(harness, [restored]) == everything(harness, [b])
        # and it snapshots again
        again = harness.create(handles=[harness.snapshot(restored)])
        assert everything(harness, [again]) == everything(harness, [b])

    def test_empty_backend_roundtrip(self, harness):
        b = harness.create()
        restored = harness.create(handles=[harness.snapshot(b)])
        assert restored.state_meta_infos() == []
        assert dump_timers(harness, [restored]) == set()
        with pytest.raises(StateNotFoundError):
            list(restored.iter_entries("value"))

    def test_snapshot_reflects_the_state_as_of_the_snapshot_call(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(80), seed=1)
        expected = everything(harness, [b])
        cid = harness.next_id()
        result = b.snapshot(cid, harness.location(cid, b))
        # processing goes on before the asynchronous part runs
        write(harness, [b], range(40, 120), seed=2)
        v = b.get_state(all_kinds()["value"])
        for k in range(0, 40, 3):
            b.set_current_key(k)
            v.clear()
        after = everything(harness, [b])
        assert after != expected
        handle = result.materialize()
        b.notify_checkpoint_complete(cid)
        restored = harness.create(handles=[handle])
        assert everything(harness, [restored]) == expected
        assert everything(harness, [b]) == after
        # the next snapshot has the later changes
        assert everything(harness, [harness.create(handles=[harness.snapshot(b)])]) == after

    def test_snapshot_is_unaffected_by_mutating_a_stored_object(self, harness):
        # "materialize reflects the state exactly as of the snapshot call": also when user code
        # mutates, after snapshot(), an object it handed to update() / add() / put() earlier.
        b = harness.create()
        typed = b.get_state(ValueStateDescriptor("typed", "array<bigint>"))
        untyped = b.get_state(ValueStateDescriptor("untyped"))
        lst = b.get_state(ListStateDescriptor("list"))
        m = b.get_state(MapStateDescriptor("map", "string"))
        b.set_current_key(1)
        arr, obj, elem, val = [1], {"n": 1}, {"e": 1}, {"v": 1}
        typed.update(arr)
        untyped.update(obj)
        lst.add(elem)
        m.put("k", val)
        kb = ident(harness, 1)
        expected = {"typed": {kb: [1]}, "untyped": {kb: {"n": 1}}, "list": {kb: [{"e": 1}]},
                    "map": {(*kb[:2], "k"): {"v": 1}}}
        cid = harness.next_id()
        result = b.snapshot(cid, harness.location(cid, b))
        arr.append(2)
        obj["n"] = 2
        elem["e"] = 2
        val["v"] = 2
        handle = result.materialize()
        b.notify_checkpoint_complete(cid)
        restored = harness.create(handles=[handle])
        assert dump(harness, [restored], ["typed", "untyped", "list", "map"]) == expected

    def test_materialize_on_another_thread_while_processing(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(100), seed=1)
        expected = everything(harness, [b])
        cid = harness.next_id()
        result = b.snapshot(cid, harness.location(cid, b))
        box: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: box.update(handle=result.materialize()))
        worker.start()
        write(harness, [b], range(50, 150), seed=2, timers=False)
        worker.join()
        b.notify_checkpoint_complete(cid)
        assert everything(harness, [harness.create(handles=[box["handle"]])]) == expected

    def test_several_incremental_checkpoints_then_restore(self, harness):
        b = harness.create()
        register_all([b])
        history = []
        for round_ in range(5):
            write(harness, [b], range(round_ * 15, round_ * 15 + 40), seed=round_)
            history.append((harness.snapshot(b), everything(harness, [b])))
        # every retained checkpoint restores to its own content
        for handle, expected in history:
            assert everything(harness, [harness.create(handles=[handle])]) == expected

    def test_incremental_chain_survives_subsumption(self, harness):
        # After each confirmed checkpoint, the shared-state registry deletes every file the
        # latest checkpoint doesn't reference: a handle must name all the files it needs.
        b = harness.create()
        register_all([b])
        for round_ in range(4):
            write(harness, [b], range(round_ * 10, round_ * 10 + 30), seed=round_)
            handle = harness.snapshot(b)
            harness.delete_all_but([handle])
        expected = everything(harness, [b])
        assert everything(harness, [harness.create(handles=[handle])]) == expected

    def test_incremental_snapshot_writes_only_the_change(self, harness):
        b = harness.create()
        v = b.get_state(ValueStateDescriptor("v", "string"))
        rnd = random.Random(0)
        for k in range(5000):  # ~500 KB that doesn't compress much
            b.set_current_key(k)
            v.update(rnd.randbytes(50).hex())
        first = harness.snapshot(b)
        b.set_current_key(1)
        v.update("changed")
        second = harness.snapshot(b)
        assert second.incremental_size < first.full_size / 4, (
            f"the second snapshot wrote {second.incremental_size} bytes for one change over "
            f"{first.full_size} bytes of state")
        assert second.incremental_size <= second.full_size
        assert everything(harness, [harness.create(handles=[second])], ["v"]) == \
            everything(harness, [b], ["v"])

    @pytest.mark.parametrize("how", ["aborted", "discarded", "unconfirmed"])
    def test_a_failed_snapshot_never_becomes_a_base(self, harness, how):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(50), seed=1)
        first = harness.snapshot(b)
        expected_first = everything(harness, [b])
        write(harness, [b], range(30, 80), seed=2)
        cid = harness.next_id()
        result = b.snapshot(cid, harness.location(cid, b))
        if how == "discarded":
            result.discard()
            b.notify_checkpoint_aborted(cid)
        else:
            result.materialize()
            if how == "aborted":
                b.notify_checkpoint_aborted(cid)
        # the coordinator removes what the failed checkpoint wrote
        failed_files = harness.written_by(cid)
        harness.storage.delete(failed_files)
        write(harness, [b], range(60, 100), seed=3)
        third = harness.snapshot(b)
        assert not failed_files & {f.path for f in third.files()}
        assert everything(harness, [harness.create(handles=[third])]) == everything(harness, [b])
        # the confirmed checkpoint before the failed one is intact too
        assert everything(harness, [harness.create(handles=[first])]) == expected_first

    def test_full_snapshot_references_no_earlier_file(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(50), seed=1)
        first = harness.snapshot(b)
        write(harness, [b], range(5), seed=2)
        full = harness.snapshot(b, full=True)
        assert not {f.path for f in first.files()} & {f.path for f in full.files()}
        assert full.incremental_size == full.full_size
        expected = everything(harness, [b])
        harness.storage.delete(f.path for f in first.files())
        assert everything(harness, [harness.create(handles=[full])]) == expected

    def test_no_claim_restore_does_not_reference_restored_files(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(50), seed=1)
        base = harness.snapshot(b)
        restored = harness.create(handles=[base], share_restored_files=False)
        register_all([restored])
        write(harness, [restored], range(3), seed=2)
        after = harness.snapshot(restored)
        assert not {f.path for f in base.files()} & {f.path for f in after.files()}
        expected = everything(harness, [restored])
        harness.storage.delete(f.path for f in base.files())
        assert everything(harness, [harness.create(handles=[after])]) == expected

    def test_checkpoint_after_restore_with_claim(self, harness):
        b = harness.create()
        register_all([b])
        write(harness, [b], range(50), seed=1)
        base = harness.snapshot(b)
        restored = harness.create(handles=[base])
        register_all([restored])
        write(harness, [restored], range(3), seed=2)
        after = harness.snapshot(restored)
        expected = everything(harness, [restored])
        harness.delete_all_but([after])
        assert everything(harness, [harness.create(handles=[after])]) == expected
