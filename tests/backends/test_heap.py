"""Heap-backend specifics (the shared behaviour is in ``contract/``): the FLIP-151 journal
(squashing, list appends, aborted and unconfirmed snapshots, the chain bound), the file format
(per-key-group sections, corruption), rescaling, TTL cleanup and pickling. Real files in
``tmp_path``; nothing mocked."""

from __future__ import annotations

import datetime as dt
import pickle
import random
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import msgspec
import pytest

from keyedstate.backends import load_backend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.heap import HeapKeyedStateBackend, HeapStateBackend
from keyedstate.backends.heap.restore import chain_of, read_footer
from keyedstate.backends.heap.snapshot import (
    DIFF,
    FULL,
    MAGIC,
    OP_APPEND,
    OP_MAP_DIFF,
    OP_PUT,
    OP_REMOVE,
)
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    MaxParallelismMismatchError,
    UnsupportedFormatVersionError,
)
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)
from keyedstate.state.timers import TimeDomain
from keyedstate.state.ttl import ManualTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle, StreamHandle

MAX_P = 128
VALUE = ValueStateDescriptor("v", "bigint")
LIST = ListStateDescriptor("l", "string")
MAP = MapStateDescriptor("m", "string", "bigint")


class Job:
    """Keyed heap backends of one job over one storage and one manual clock."""

    def __init__(self, tmp_path: Path, backend: HeapStateBackend | None = None) -> None:
        self.storage = CheckpointStorage(str(tmp_path / "ckpt"))
        self.clock = ManualTimeProvider(1_000_000)
        self.keys = KeySerializer(["bigint"])
        self.backend = backend or HeapStateBackend()

    def create(self, index: int = 0, parallelism: int = 1,
               handles: Sequence[KeyedStateHandle] = (),
               share: bool = True, clock: ManualTimeProvider | None = None,
               storage: CheckpointStorage | None = None) -> HeapKeyedStateBackend:
        return self.backend.create_keyed_backend(KeyedStateBackendParameters(
            subtask_index=index,
            key_group_range=KeyGroupRange.of_operator(MAX_P, parallelism, index),
            max_parallelism=MAX_P, key_serializer=self.keys, restore_handles=list(handles),
            storage=storage or self.storage, share_restored_files=share,
            time_provider=clock or self.clock))

    def create_all(self, parallelism: int, handles: Sequence[KeyedStateHandle] = (),
                   **kwargs: Any) -> list[HeapKeyedStateBackend]:
        return [self.create(i, parallelism, handles, **kwargs) for i in range(parallelism)]

    def at(self, backends: Sequence[HeapKeyedStateBackend], key: int) -> HeapKeyedStateBackend:
        kg = self.keys.key_group(key, MAX_P)
        backend = next(b for b in backends if kg in b.key_group_range)
        backend.set_current_key(key)
        return backend

    def snapshot(self, backend: HeapKeyedStateBackend, cid: int, *, confirm: bool = True,
                 full: bool = False) -> KeyedStateHandle:
        handle = backend.snapshot(cid, self.storage.location(cid, backend.subtask_index),
                                  full=full).materialize()
        if confirm:
            backend.notify_checkpoint_complete(cid)
        return handle


def contents(backends: Sequence[HeapKeyedStateBackend]) -> dict[str, Any]:
    """Every entry of every state, and every timer, of ``backends`` together."""
    out: dict[str, Any] = defaultdict(dict)
    for b in backends:
        for info in b.state_meta_infos():
            out[info.name].update({(e.key_bytes, e.namespace_bytes, e.user_key): e.value
                                   for e in b.iter_entries(info.name)})
    out = {name: entries for name, entries in out.items() if entries}
    out["timers"] = {(str(d), t) for b in backends for d in TimeDomain
                     for t in b.timer_service.timers(d)}
    return out


class FileParts:
    """One chain file read back: its footer, and its entries per state name, split into the
    diff sections and the image sections (key groups the footer names as imaged)."""

    def __init__(self, job: Job, file: StreamHandle) -> None:
        data = job.storage.read_verified(file)
        self.footer = read_footer(data, file.path)
        self.imaged = {kg for s, e in self.footer.imaged() for kg in range(s, e + 1)}
        self.diffs: dict[str, list[Any]] = defaultdict(list)
        self.images: dict[str, list[Any]] = defaultdict(list)
        for s in self.footer.sections:
            into = self.images if s.key_group in self.imaged else self.diffs
            into[self.footer.states[s.state].meta.name].extend(
                msgspec.msgpack.decode(data[s.offset:s.offset + s.length]))

    def count(self, part: dict[str, list[Any]]) -> int:
        return sum(len(entries) for entries in part.values())


def last_file(job: Job, handle: KeyedStateHandle) -> tuple[str, dict[str, list[Any]]]:
    """(kind, entries per state name) of the newest file of the handle's chain: its diff
    sections, or for a full file its images."""
    parts = FileParts(job, chain_of(handle)[-1][1])
    return parts.footer.kind, parts.images if parts.footer.kind == FULL else parts.diffs


def key_in(job: Job, key_group: int) -> int:
    """The smallest key of ``key_group``."""
    return next(k for k in range(1_000_000) if job.keys.key_group(k, MAX_P) == key_group)


def background(job: Job, b: HeapKeyedStateBackend) -> int:
    """One value in every key group (a few entries' worth of image budget reaches one key
    group, so the rolling images go round the key groups one by one from key group 0); returns
    a key of the last key group, the last to be imaged again."""
    v = b.get_state(VALUE)
    for kg in range(MAX_P):
        b.set_current_key(key_in(job, kg))
        v.update(kg)
    return key_in(job, MAX_P - 1)


def fill(job: Job, backends: Sequence[HeapKeyedStateBackend], keys: range, seed: int) -> None:
    rnd = random.Random(seed)
    for key in keys:
        b = job.at(backends, key)
        v: Any = b.get_state(VALUE)
        lst: Any = b.get_state(LIST)
        m: Any = b.get_state(MAP)
        v.update(rnd.randint(0, 10**9))
        lst.add_all([f"{key}-{seed}-{i}" for i in range(rnd.randint(1, 3))])
        m.put(f"k{rnd.randint(0, 3)}", key)
        b.timer_service.register_event_time_timer(rnd.randint(0, 10**6))


# -- the journal -------------------------------------------------------------------------------


def test_repeated_updates_of_a_key_are_squashed(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    v = b.get_state(VALUE)
    for key in range(100):
        b.set_current_key(key)
        v.update(key)
    job.snapshot(b, 1)
    b.set_current_key(7)
    for i in range(10):
        v.update(1000 + i)
    kind, entries = last_file(job, job.snapshot(b, 2))
    assert kind == DIFF
    assert entries["v"] == [[OP_PUT, job.keys.serialize(7), b"\xc0", entries["v"][0][3]]]
    assert VALUE.value_serializer.deserialize(entries["v"][0][3]) == 1009


def test_list_appends_are_journaled_as_appends(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    lst = b.get_state(LIST)
    key = background(job, b)
    b.set_current_key(key)
    lst.add_all(f"element-{i}" for i in range(2000))
    full = job.snapshot(b, 1)
    lst.add("new")
    lst.add_all(["newer", "newest"])
    diff = job.snapshot(b, 2)
    kind, entries = last_file(job, diff)
    assert kind == DIFF
    [(op, _, _, payload)] = entries["l"]
    assert op == OP_APPEND
    assert [LIST.value_serializer.deserialize(p) for p in payload] == ["new", "newer", "newest"]
    assert diff.incremental_size < full.incremental_size / 20
    # update() replaces, so the next diff carries the whole (short) list
    lst.update(["only"])
    _, entries = last_file(job, job.snapshot(b, 3))
    assert [e[0] for e in entries["l"]] == [OP_PUT]
    restored = job.create(handles=[job.snapshot(b, 4)])
    restored.set_current_key(key)
    assert restored.get_state(LIST).get() == ["only"]


def test_map_changes_are_journaled_per_user_key(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    m = b.get_state(MAP)
    b.set_current_key(background(job, b))
    m.put_all({f"k{i}": i for i in range(500)})
    job.snapshot(b, 1)
    m.put("k1", -1)
    m.remove("k2")
    handle = job.snapshot(b, 2)
    _, entries = last_file(job, handle)
    [(op, _, _, (puts, removed))] = entries["m"]
    assert op == OP_MAP_DIFF and len(puts) == 1 and len(removed) == 1
    restored = job.create(handles=[handle])
    assert contents([restored]) == contents([b])


def test_an_aborted_snapshot_is_never_a_base(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    fill(job, [b], range(200), seed=1)
    job.snapshot(b, 1)
    fill(job, [b], range(0, 50), seed=2)
    job.snapshot(b, 2, confirm=False)
    b.notify_checkpoint_aborted(2)
    fill(job, [b], range(40, 80), seed=3)
    handle = job.snapshot(b, 3)
    assert handle.properties["heap.chain"] == "000000000001-full,000000000003-diff"
    assert job.storage.exists(chain_of(handle)[0][1].path)
    assert contents([job.create(handles=[handle])]) == contents([b])


def test_an_unconfirmed_snapshot_is_never_a_base(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    fill(job, [b], range(200), seed=1)
    job.snapshot(b, 1)
    fill(job, [b], range(0, 50), seed=2)
    job.snapshot(b, 2, confirm=False)
    fill(job, [b], range(40, 80), seed=3)
    handle = job.snapshot(b, 3, confirm=False)
    assert [n for n, _ in chain_of(handle)] == ["000000000001-full", "000000000003-diff"]
    assert contents([job.create(handles=[handle])]) == contents([b])
    b.notify_checkpoint_complete(3)
    b.notify_checkpoint_complete(2)  # late: 3 already subsumed it
    fill(job, [b], range(70, 90), seed=4)
    handle = job.snapshot(b, 4)
    assert [n for n, _ in chain_of(handle)] == ["000000000001-full", "000000000003-diff",
                                                "000000000004-diff"]
    assert contents([job.create(handles=[handle])]) == contents([b])


def test_a_discarded_snapshot_is_never_a_base(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    fill(job, [b], range(100), seed=1)
    job.snapshot(b, 1)
    fill(job, [b], range(10), seed=2)
    b.snapshot(2, job.storage.location(2, 0)).discard()
    b.notify_checkpoint_complete(2)  # nothing was written: must not become the base
    handle = job.snapshot(b, 3)
    assert [n for n, _ in chain_of(handle)] == ["000000000001-full", "000000000003-diff"]
    assert contents([job.create(handles=[handle])]) == contents([b])


def test_max_chain_length_bounds_the_chain(tmp_path):
    # max_chain_length 2: each snapshot images at least ceil(128 / 3) = 43 key groups, so every
    # key group is imaged again within 3 snapshots and a chain never holds more than 3 files.
    job = Job(tmp_path, HeapStateBackend(max_chain_length=2))
    b = job.create()
    kinds, chains = [], []
    for cid in range(1, 10):
        fill(job, [b], range(cid * 5, cid * 5 + 5), seed=cid)
        handle = job.snapshot(b, cid)
        kinds.append(last_file(job, handle)[0])
        chains.append([n for n, _ in chain_of(handle)])
        assert contents([job.create(handles=[handle])]) == contents([b])
    assert kinds == [FULL] + [DIFF] * 8  # never a periodic full snapshot again
    assert max(len(c) for c in chains) == 3
    # the first file drops out of the chain once every key group was imaged after it
    assert chains[-1][0] != "000000000001-full"
    assert last_file(job, job.snapshot(b, 10, full=True))[0] == FULL
    assert len(job.snapshot(b, 11).shared) == 2


def test_not_incremental_means_always_full(tmp_path):
    job = Job(tmp_path, HeapStateBackend(incremental=False))
    b = job.create()
    for cid in (1, 2, 3):
        fill(job, [b], range(cid), seed=cid)
        assert len(job.snapshot(b, cid).shared) == 1


def test_incremental_bytes_follow_the_change(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    v = b.get_state(VALUE)
    for key in range(10_000):
        b.set_current_key(key)
        v.update(key * 1_000_003)
    full = job.snapshot(b, 1)
    for key in range(0, 10_000, 100):  # 1 % of the keys
        b.set_current_key(key)
        v.update(-key)
    diff = job.snapshot(b, 2)
    # the changed entries, plus images of key groups holding at least as many entries (about
    # 78 entries per key group here: two key groups)
    assert diff.incremental_size < 0.05 * full.incremental_size
    assert diff.full_size == full.incremental_size + diff.incremental_size
    parts = FileParts(job, chain_of(diff)[-1][1])
    assert len(parts.imaged) == 2
    imaged_changes = sum(1 for key in range(0, 10_000, 100)
                         if job.keys.key_group(key, MAX_P) in parts.imaged)
    assert len(parts.diffs["v"]) == 100 - imaged_changes
    assert 100 <= len(parts.images["v"]) < 100 + 2 * 10_000 / MAX_P


def test_a_snapshot_is_frozen_against_in_place_accumulator_changes(tmp_path):
    class Collect:
        def create_accumulator(self) -> list[int]:
            return []

        def add(self, value: int, acc: list[int]) -> list[int]:
            acc.append(value)  # mutates in place, as Flink allows
            return acc

        def get_result(self, acc: list[int]) -> list[int]:
            return list(acc)

    desc = AggregatingStateDescriptor("agg", Collect(), "array<bigint>")
    job = Job(tmp_path)
    b = job.create()
    agg = b.get_state(desc)
    b.set_current_key(1)
    agg.add(1)
    job.snapshot(b, 1)
    agg.add(2)
    pending = b.snapshot(2, job.storage.location(2, 0))
    agg.add(3)
    restored = job.create(handles=[pending.materialize()])
    restored.set_current_key(1)
    assert restored.get_state(desc).get() == [1, 2]


def test_random_histories_against_a_model(tmp_path):
    """Writes interleaved with confirmed, aborted, unconfirmed and discarded snapshots; every
    handle restores to exactly the content seen at its snapshot call."""
    rnd = random.Random(42)
    job = Job(tmp_path, HeapStateBackend(max_chain_length=3))
    b = job.create()
    v, lst, m = b.get_state(VALUE), b.get_state(LIST), b.get_state(MAP)
    handles: list[tuple[KeyedStateHandle, dict[str, Any]]] = []
    for cid in range(1, 26):
        for _ in range(rnd.randint(0, 40)):
            b.set_current_key(rnd.randint(0, 30))
            for s in (v, lst, m):
                s.set_current_namespace(rnd.choice([None, "w"]))
            op = rnd.random()
            if op < 0.25:
                v.update(rnd.choice([None, rnd.randint(0, 99)]))
            elif op < 0.5:
                lst.add(str(rnd.randint(0, 99)))
            elif op < 0.6:
                lst.update([str(rnd.randint(0, 9))] * rnd.randint(0, 2))
            elif op < 0.8:
                m.put(f"k{rnd.randint(0, 5)}", rnd.randint(0, 99))
            elif op < 0.9:
                m.remove(f"k{rnd.randint(0, 5)}")
            elif op < 0.95:
                b.timer_service.register_event_time_timer(rnd.randint(0, 50))
            else:
                list(b.timer_service.pop_due(TimeDomain.EVENT_TIME, rnd.randint(0, 50)))
        expected = contents([b])
        fate = rnd.choice(["confirm", "confirm", "abort", "pending", "discard"])
        result = b.snapshot(cid, job.storage.location(cid, 0))
        if fate == "discard":
            result.discard()
            continue
        handles.append((result.materialize(), expected))
        if fate == "confirm":
            b.notify_checkpoint_complete(cid)
        elif fate == "abort":
            b.notify_checkpoint_aborted(cid)
    assert len({len(h.shared) for h, _ in handles}) > 1, "no incremental snapshot was taken"
    for handle, expected in handles:
        restored = job.create(handles=[handle])
        assert contents([restored]) == expected, f"checkpoint {handle.checkpoint_id}"


# -- restore and rescaling ---------------------------------------------------------------------


@pytest.mark.parametrize("path", [(2, 3, 1), (3, 1, 2)])
def test_rescale_restores_the_original_content(tmp_path, path):
    job = Job(tmp_path)
    backends = job.create_all(path[0])
    fill(job, backends, range(300), seed=1)
    cid = 0
    for seed in (2, 3):  # a full and an incremental checkpoint
        cid += 1
        handles = [job.snapshot(b, cid) for b in backends]
        fill(job, backends, range(seed * 40, seed * 40 + 60), seed=seed)
    cid += 1
    handles = [job.snapshot(b, cid) for b in backends]
    assert all(len(h.shared) == 3 for h in handles)
    original = contents(backends)
    for parallelism in path[1:]:
        backends = job.create_all(parallelism, handles)
        assert contents(backends) == original
        cid += 1
        handles = [job.snapshot(b, cid) for b in backends]
        # rescaled: nothing exact to build on, so each subtask starts a new chain
        assert all(len(h.shared) == 1 for h in handles)


def test_restore_shares_the_chain_only_when_allowed(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    fill(job, [b], range(50), seed=1)
    handle = job.snapshot(b, 1)
    shared = job.create(handles=[handle])
    fill(job, [shared], range(5), seed=2)
    assert [n for n, _ in chain_of(job.snapshot(shared, 2))] == ["000000000001-full",
                                                                 "000000000002-diff"]
    # NO_CLAIM: the first snapshot extends a copy of the chain, duplicated by the store
    # (state on object storage: no re-upload), and references none of the restored files.
    no_claim = job.create(handles=[handle], share=False)
    after = job.snapshot(no_claim, 3)
    assert list(after.shared) == ["000000000000-0000-full", "000000000003-diff"]
    assert not {f.path for f in handle.files()} & {f.path for f in after.files()}


def test_unregistered_restored_state_is_decoded_with_its_type(tmp_path):
    desc = ValueStateDescriptor("when", "timestamp")
    job = Job(tmp_path)
    b = job.create()
    b.set_current_key(1)
    ts = dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.timezone.utc)
    b.get_state(desc).update(ts)
    restored = job.create(handles=[job.snapshot(b, 1)])
    assert [i.name for i in restored.state_meta_infos()] == ["when"]
    assert [e.value for e in restored.iter_entries("when")] == [ts]
    again = job.create(handles=[job.snapshot(restored, 2)])  # written back unregistered
    again.set_current_key(1)
    assert again.get_state(desc).value() == ts


def test_timers_are_journaled_per_key_group(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    for key in range(100):
        b.set_current_key(key)
        b.timer_service.register_event_time_timer(key)
    job.snapshot(b, 1)
    b.set_current_key(5)
    b.timer_service.delete_event_time_timer(5)
    handle = job.snapshot(b, 2)
    _, entries = last_file(job, handle)
    assert entries["_timers_event"] == []  # one key group, rewritten empty
    assert contents([job.create(handles=[handle])]) == contents([b])


# -- the file format ---------------------------------------------------------------------------


def test_a_corrupted_file_is_refused(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    fill(job, [b], range(50), seed=1)
    job.snapshot(b, 1)
    fill(job, [b], range(10), seed=2)
    handle = job.snapshot(b, 2)
    _, file = chain_of(handle)[-1]
    path = Path(job.storage.path(file.path))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="000000000002-diff"):
        job.create(handles=[handle])


def _rewrite_last_file(job: Job, handle: KeyedStateHandle, data: bytes) -> KeyedStateHandle:
    name, _ = chain_of(handle)[-1]
    new = job.storage.write(f"shared/chk-{handle.checkpoint_id}-sub-0-x-{name}", data)
    return msgspec.structs.replace(handle, shared={**handle.shared, name: new})


def test_files_with_a_valid_checksum_are_still_checked(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    fill(job, [b], range(20), seed=1)
    handle = job.snapshot(b, 1)
    data = job.storage.read(chain_of(handle)[0][1].path)
    with pytest.raises(CorruptCheckpointError, match="magic"):
        job.create(handles=[_rewrite_last_file(job, handle, b"NOTHEAP!" + data[8:])])
    footer = read_footer(data, "f")
    body = data[:-(len(MAGIC) + 4)]
    footer_len = len(msgspec.msgpack.encode(footer))
    future = msgspec.msgpack.encode(msgspec.structs.replace(footer, format_version=99))
    rewritten = body[:-footer_len] + future + len(future).to_bytes(4, "little") + MAGIC
    with pytest.raises(UnsupportedFormatVersionError):
        job.create(handles=[_rewrite_last_file(job, handle, rewritten)])


def test_max_parallelism_is_checked_against_the_file(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    fill(job, [b], range(20), seed=1)
    handle = job.snapshot(b, 1)
    other = msgspec.structs.replace(handle, key_group_end=63)
    with pytest.raises(MaxParallelismMismatchError):
        job.backend.create_keyed_backend(KeyedStateBackendParameters(
            subtask_index=0, key_group_range=KeyGroupRange(0, 63), max_parallelism=64,
            key_serializer=job.keys, restore_handles=[other], storage=job.storage))


def test_a_rescaled_restore_decodes_only_its_key_groups(tmp_path):
    job = Job(tmp_path)
    b = job.create()
    fill(job, [b], range(300), seed=1)
    handle = job.snapshot(b, 1)
    _, file = chain_of(handle)[0]
    footer = read_footer(job.storage.read_verified(file), file.path)
    v = footer.states[[s.meta.name for s in footer.states].index("v")]
    assert v.meta.name == "v"
    by_kg = {s.key_group for s in footer.sections}
    assert len(by_kg) > 100  # one section per state per key group: a subset is cheap to read


# -- TTL ---------------------------------------------------------------------------------------


def test_ttl_expiry_and_incremental_cleanup(tmp_path):
    ttl = StateTtlConfig(dt.timedelta(seconds=10), incremental_cleanup_size=1000)
    desc = ValueStateDescriptor("t", "bigint", ttl=ttl)
    ldesc = ListStateDescriptor("tl", "bigint", ttl=ttl)
    job = Job(tmp_path)
    b = job.create()
    v, lst = b.get_state(desc), b.get_state(ldesc)
    for key in range(50):
        b.set_current_key(key)
        v.update(key)
        lst.add(key)
    plain = b.get_state(VALUE)
    for key in range(1000, 3000):  # state without TTL: the next image budget is met early
        b.set_current_key(key)
        plain.update(key)
    job.clock.advance(6_000)
    b.set_current_key(0)
    lst.add(100)  # a younger element in an old list
    job.snapshot(b, 1)
    job.clock.advance(5_000)  # everything but that element expired
    assert v.value() is None and lst.get() == [100]
    # the access above swept the rest: the diff removes them (but in the imaged key groups,
    # which the many entries of "v" fill), and a restore agrees
    handle = job.snapshot(b, 2)
    parts = FileParts(job, chain_of(handle)[-1][1])
    assert parts.footer.kind == DIFF
    assert {e[0] for e in parts.diffs["t"]} == {OP_REMOVE}
    assert len(parts.diffs["t"]) == sum(1 for key in range(50)
                                        if job.keys.key_group(key, MAX_P) not in parts.imaged)
    assert parts.images["t"] == []
    assert b.state_meta_infos()[0].ttl_ms == 10_000
    restored = job.create(handles=[handle])
    assert [e.value for e in restored.iter_entries("tl")] == [[100]]
    assert list(restored.iter_entries("t")) == []
    # a full snapshot leaves expired entries out
    job.clock.advance(10_000)
    _, entries = last_file(job, job.snapshot(b, 3, full=True))
    assert entries["tl"] == []


def test_ttl_map_diff_with_only_removals_restores(tmp_path):
    # Regression: a TTL map whose changed user keys were all removed wrote no put list.
    desc = MapStateDescriptor("tm", "string", "bigint",
                              ttl=StateTtlConfig(dt.timedelta(seconds=10)))
    job = Job(tmp_path)
    b = job.create()
    m = b.get_state(desc)
    b.set_current_key(1)
    m.put_all({"a": 1, "b": 2})
    job.snapshot(b, 1)
    m.put("c", 3)
    m.remove("c")
    m.remove("a")
    restored = job.create(handles=[job.snapshot(b, 2)])
    assert [(e.user_key, e.value) for e in restored.iter_entries("tm")] == [("b", 2)]


# -- configuration -----------------------------------------------------------------------------


def test_heap_state_backend_pickles_and_loads_by_name():
    backend = load_backend("heap", max_chain_length=3, incremental=False)
    assert isinstance(backend, HeapStateBackend)
    copy = pickle.loads(pickle.dumps(backend))
    assert copy == backend
    assert (copy.max_chain_length, copy.incremental) == (3, False)
    with pytest.raises(ConfigurationError):
        HeapStateBackend(max_chain_length=-1)
