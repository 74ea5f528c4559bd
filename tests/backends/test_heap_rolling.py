"""Rolling materialization of the heap backend (batch cost bounded as state grows): after the first
snapshot no checkpoint writes the whole state. Each writes its diff plus images of the key groups
whose latest image is oldest, about as many entries as it changed, and a restore starts each key
group at its newest image. Checked here: the images stay within their budget over a long run; every
checkpoint of a long rolling chain restores to what a per-entry oracle expects, rescaled or not;
files before the oldest needed image leave the registry (and the disk); a chain of format version 1
still restores and is extended; a storage fault around a rolling file leaves the previous checkpoint
restorable. Real files, real coordinator; nothing mocked."""

from __future__ import annotations

import datetime as dt
import math
import random
import shutil
from pathlib import Path
from typing import Any, Sequence

import msgspec
import pytest

from keyedstate.backends.heap import HeapKeyedStateBackend, HeapStateBackend
from keyedstate.backends.heap.backend import DEFAULT_MAX_CHAIN_LENGTH
from keyedstate.backends.heap.images import latest_images, parse_images
from keyedstate.backends.heap.restore import chain_of
from keyedstate.backends.heap.snapshot import DIFF, FULL, IMAGES_PROPERTY
from keyedstate.errors import KeyedStateError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.processor.inspection import find_garbage
from keyedstate.runtime.local import LocalKeyedOperator
from keyedstate.serde import serialize_namespace
from keyedstate.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)
from keyedstate.state.timers import TimeDomain
from keyedstate.state.ttl import ManualTimeProvider
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle
from keyedstate.testing.faults import FaultPlan

from .test_heap import LIST, MAP, MAX_P, VALUE, FileParts, Job

TTL = StateTtlConfig(dt.timedelta(seconds=2))
DESCRIPTORS = {
    "v": VALUE,
    "l": LIST,
    "m": MAP,
    "tv": ValueStateDescriptor("tv", "bigint", ttl=TTL),
    "tl": ListStateDescriptor("tl", "string", ttl=TTL),
    "tm": MapStateDescriptor("tm", "string", "bigint", ttl=TTL),
}
TTL_MS = TTL.ttl_ms
EVENT = TimeDomain.EVENT_TIME
NAMESPACES = [None, "w"]

Ident = tuple[bytes, bytes, Any]


# -- the per-entry oracle ----------------------------------------------------------------------


class Oracle:
    """What every entry holds, with its last-access time under TTL: values and map values as
    ``(value, ts)``, lists as ``[(element, ts), ...]``, timers as ``(ts, key, namespace)``."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[Ident, Any]] = {name: {} for name in DESCRIPTORS}
        self.timers: set[tuple[int, bytes, bytes]] = set()

    def visible(self, now: int) -> dict[str, Any]:
        """What the state API shows at ``now`` (``observed`` of a backend holding it)."""
        def live(ts: int) -> bool:
            return ts + TTL_MS > now

        out: dict[str, Any] = {}
        for name, entries in self.entries.items():
            ttl = name.startswith("t")
            shown: dict[Ident, Any] = {}
            for ident, stored in entries.items():
                if name.endswith("l"):
                    elements = [e for e, ts in stored if not ttl or live(ts)]
                    if elements:
                        shown[ident] = elements
                elif not ttl or live(stored[1]):
                    shown[ident] = stored[0]
            out[name] = shown
        out["timers"] = set(self.timers)
        return out


def observed(backends: Sequence[HeapKeyedStateBackend]) -> dict[str, Any]:
    out: dict[str, Any] = {name: {} for name in DESCRIPTORS}
    for b in backends:
        for name in DESCRIPTORS:
            if name in b.tables:
                out[name].update({(e.key_bytes, e.namespace_bytes, e.user_key): e.value
                                  for e in b.iter_entries(name)})
    out["timers"] = {(t.timestamp, t.key_bytes, t.namespace_bytes) for b in backends
                     for t in b.timer_service.timers(EVENT)}
    return out


def mutate(job: Job, backends: Sequence[HeapKeyedStateBackend], oracle: Oracle,
           rnd: random.Random, keys: int, ops: int, watermark: int) -> None:
    """``ops`` random writes (puts, removes, list appends and replacements, map puts and
    removals, TTL writes, timer registrations and deletions), applied to the backends and the
    oracle alike."""
    now = job.clock.now_ms()
    e = oracle.entries
    for _ in range(ops):
        key = rnd.randrange(keys)
        b = job.at(backends, key)
        ns = rnd.choice(NAMESPACES)
        states: dict[str, Any] = {n: b.get_state(d) for n, d in DESCRIPTORS.items()}
        for s in states.values():
            s.set_current_namespace(ns)
        scope = (job.keys.serialize(key), serialize_namespace(ns))
        one = (*scope, None)
        op = rnd.randrange(13)
        n = rnd.randrange(1000)
        if op == 0:
            states["v"].update(n)
            e["v"][one] = (n, now)
        elif op == 1:
            states["v"].clear()
            e["v"].pop(one, None)
        elif op == 2:
            states["l"].add(str(n))
            e["l"].setdefault(one, []).append((str(n), now))
        elif op == 3:
            values = [str(n)] * rnd.randrange(3)
            states["l"].update(values)
            if values:
                e["l"][one] = [(v, now) for v in values]
            else:
                e["l"].pop(one, None)
        elif op == 4:
            states["m"].put(f"u{n % 4}", n)
            e["m"][(*scope, f"u{n % 4}")] = (n, now)
        elif op == 5:
            states["m"].remove(f"u{n % 4}")
            e["m"].pop((*scope, f"u{n % 4}"), None)
        elif op == 6:
            states["tv"].update(n)
            e["tv"][one] = (n, now)
        elif op == 7:
            states["tl"].add(str(n))
            live = [(v, ts) for v, ts in e["tl"].get(one, []) if ts + TTL_MS > now]
            e["tl"][one] = [*live, (str(n), now)]
        elif op == 8:
            states["tm"].put(f"u{n % 4}", n)
            e["tm"][(*scope, f"u{n % 4}")] = (n, now)
        elif op == 9:
            states["tm"].remove(f"u{n % 4}")
            e["tm"].pop((*scope, f"u{n % 4}"), None)
        elif op in (10, 11):
            ts = watermark + 1 + n
            b.timer_service.register_event_time_timer(ts, ns)
            oracle.timers.add((ts, *scope))
        else:
            mine = sorted(t for t in oracle.timers if t[1:] == scope)
            if mine:
                ts = rnd.choice(mine)[0]
                b.timer_service.delete_event_time_timer(ts, ns)
                oracle.timers.discard((ts, *scope))


class Checkpoint(msgspec.Struct):
    checkpoint_id: int
    now: int
    handles: list[KeyedStateHandle]
    expected: dict[str, Any]


def rolling_run(job: Job, parallelism: int, checkpoints: int, seed: int,
                keys: int = 300) -> list[Checkpoint]:
    """A job of ``parallelism`` subtasks taking ``checkpoints`` confirmed checkpoints over
    random writes, the clock moving 300 ms each (TTL 2 s: entries expire along the way) and the
    watermark firing timers; every checkpoint with what the oracle expects of it."""
    rnd = random.Random(seed)
    backends = job.create_all(parallelism)
    oracle = Oracle()
    mutate(job, backends, oracle, rnd, keys, keys * 2, 0)
    watermark = 0
    taken = []
    for cid in range(1, checkpoints + 1):
        if cid > 1:
            mutate(job, backends, oracle, rnd, keys, rnd.choice([0, 5, 20, 40, 80]), watermark)
        if cid % 4 == 0:  # the watermark fires the due timers
            watermark += 150
            for b in backends:
                for timer in b.timer_service.pop_due(EVENT, watermark):
                    oracle.timers.discard((timer.timestamp, timer.key_bytes,
                                           timer.namespace_bytes))
        job.clock.advance(300)
        now = job.clock.now_ms()
        expected = oracle.visible(now)
        assert observed(backends) == expected, f"the oracle is wrong at checkpoint {cid}"
        handles = [job.snapshot(b, cid) for b in backends]
        taken.append(Checkpoint(cid, now, handles, expected))
    for b in backends:
        b.close()
    return taken


# -- the budget --------------------------------------------------------------------------------


def entries_per_key_group(b: HeapKeyedStateBackend) -> dict[int, int]:
    """Entries of every key group (what an image of it holds): stored entries of all states
    plus timers."""
    sizes = {kg: 0 for kg in b.key_group_range}
    for table in b.tables.values():
        for kg, group in table.maps.items():
            sizes[kg] += len(group)
    for queue in b.timer_queues.values():
        for kg, timers in queue.by_key_group.items():
            sizes[kg] += len(timers)
    return sizes


@pytest.mark.parametrize("keys", [2_000, 20_000])
@pytest.mark.parametrize("max_chain_length", [DEFAULT_MAX_CHAIN_LENGTH, 4])
def test_images_stay_within_their_budget(tmp_path, keys, max_chain_length):
    """Over 140 checkpoints changing 0-60 keys each, every checkpoint images at least
    ceil(key groups / (max_chain_length + 1)) key groups, and beyond that no more entries than
    it changed plus one key group: what it writes follows its change, not the state size."""
    job = Job(tmp_path, HeapStateBackend(max_chain_length=max_chain_length))
    b = job.create()
    v, lst = b.get_state(VALUE), b.get_state(LIST)
    for key in range(keys):
        b.set_current_key(key)
        v.update(key)
        lst.add(f"{key}")
    first = job.snapshot(b, 1)
    bytes_per_entry = first.incremental_size / (2 * keys)
    at_least = math.ceil(MAX_P / (max_chain_length + 1))
    rnd = random.Random(keys)
    chains = []
    for cid in range(2, 142):
        changed_keys = rnd.choice([0, 1, 10, 20, 60])
        for key in rnd.sample(range(keys), changed_keys):
            b.set_current_key(key)
            v.update(-key)
            lst.add("x")
        sizes = entries_per_key_group(b)
        largest = sorted(sizes.values(), reverse=True)
        result = b.snapshot(cid, job.storage.location(cid, 0))
        handle = result.materialize()
        b.notify_checkpoint_complete(cid)
        changed = result.stats.extra["changed_entries"]
        assert changed == 2 * changed_keys
        parts = FileParts(job, chain_of(handle)[-1][1])
        image_entries = sum(sizes[kg] for kg in parts.imaged)
        assert parts.count(parts.images) == image_entries == result.stats.extra["image_entries"]
        assert len(parts.imaged) >= at_least
        # the budget: the changed entries, or the fewest key groups the chain bound needs;
        # plus the key group that reached it
        budget = max(changed, sum(largest[:at_least]))
        assert image_entries <= budget + largest[0], f"checkpoint {cid}"
        # and what it writes: that much and the diff, in bytes
        assert handle.incremental_size <= \
            2 * bytes_per_entry * (changed + budget + largest[0]) + 1024, f"checkpoint {cid}"
        assert parts.count(parts.diffs) <= changed
        chains.append([n for n, _ in chain_of(handle)])
    assert max(len(c) for c in chains) <= max_chain_length + 1
    assert "000000000001-full" not in chains[-1], "the chain never rolled past the first file"


# -- restoring any checkpoint of a long rolling chain ------------------------------------------


@pytest.mark.parametrize("backend", [HeapStateBackend(), HeapStateBackend(max_chain_length=2)],
                         ids=["default", "chain-2"])
@pytest.mark.parametrize(("parallelism", "restore_at"), [(2, (2, 3)), (3, (1,))],
                         ids=["2-to-2-and-3", "3-to-1"])
def test_every_checkpoint_of_a_rolling_chain_restores(tmp_path, backend, parallelism,
                                                      restore_at):
    job = Job(tmp_path, backend)
    taken = rolling_run(job, parallelism, 30, seed=parallelism)
    chains = [[n for n, _ in chain_of(h)] for c in taken for h in c.handles]
    assert any("000000000001-full" not in c for c in chains), "the chain never rolled"
    assert all(FULL not in c[-1] for c in chains[parallelism:]), "a periodic full snapshot"
    for checkpoint in taken:
        for q in restore_at:
            restored = job.create_all(q, checkpoint.handles,
                                      clock=ManualTimeProvider(checkpoint.now))
            assert observed(restored) == checkpoint.expected, \
                f"checkpoint {checkpoint.checkpoint_id} restored at parallelism {q}"
            for b in restored:
                b.close()


def test_a_rescaled_subtask_reads_only_the_files_its_key_groups_need(tmp_path):
    job = Job(tmp_path, HeapStateBackend(max_chain_length=3))
    taken = rolling_run(job, 1, 12, seed=7)
    last = taken[-1]
    (handle,) = last.handles
    chain = chain_of(handle)
    assert len(chain) == 4
    # subtask 1 of 4 owns key groups 32-63: it reads the files from their oldest image on
    mine = KeyGroupRange.of_operator(MAX_P, 4, 1)
    needed = min(latest_images(parse_images(handle.properties[IMAGES_PROPERTY]), mine))
    assert needed > 0, "pick a range whose images are all newer than the chain's first file"
    restored = job.create(1, 4, [handle], clock=ManualTimeProvider(last.now))
    stats = restored.restore_stats
    assert stats is not None
    assert stats.downloaded_bytes + stats.cache_hit_bytes == \
        sum(f.length for _, f in chain[needed:])
    expected = {name: {i: v for i, v in entries.items()
                       if job.keys.key_group(job.keys.deserialize(i[0]), MAX_P) in mine}
                for name, entries in last.expected.items() if name != "timers"}
    expected["timers"] = {t for t in last.expected["timers"]
                          if job.keys.key_group(job.keys.deserialize(t[1]), MAX_P) in mine}
    assert observed([restored]) == expected


# -- the registry ------------------------------------------------------------------------------


def _put(backend: Any, key: Any, value: Any) -> None:
    backend.get_state(VALUE).update(value)


def test_files_before_the_oldest_needed_image_are_deleted(tmp_path):
    """With one retained checkpoint, the files on disk are exactly those the latest handles
    list, and each handle's first file holds the newest image of some key group: the files
    before the oldest needed image are deleted by the shared-state registry."""
    with LocalKeyedOperator(str(tmp_path / "job"), key_types=["bigint"],
                            backend=HeapStateBackend(max_chain_length=3), parallelism=2,
                            local_dir=str(tmp_path / "work")) as op:
        op.process(((k, k) for k in range(2_000)), _put)
        first = op.checkpoint()
        first_files = {f.path for h in first.metadata.handles for f in h.files()}
        for round_ in range(12):
            op.process(((k, -k) for k in range(round_ * 10, round_ * 10 + 10)), _put)
            completed = op.checkpoint()
            handles = completed.metadata.handles
            referenced = {f.path for h in handles for f in h.files()}
            assert set(op.storage.list_files("shared")) == referenced
            for h in handles:
                images = parse_images(h.properties[IMAGES_PROPERTY])
                latest = latest_images(images, h.key_group_range)
                assert len(images) == len(h.shared) <= 4
                assert min(latest) == 0, "the chain lists a file no key group needs"
        assert not first_files & set(op.storage.list_files("shared"))


# -- format version 1 --------------------------------------------------------------------------

FIXTURE = Path(__file__).parent / "fixtures" / "heap-v1-chain"


def heap_v1_content() -> dict[int, tuple[Any, list[str], dict[str, float], list[int]]]:
    """What ``fixtures/make_heap_v1_chain.py`` wrote by checkpoint 3: per key (count, events,
    attrs, event-time timers)."""
    out: dict[int, tuple[Any, list[str], dict[str, float], list[int]]] = {}
    for k in range(65):
        if k >= 60:
            out[k] = (k * 10, [f"a{k}"], {"x": float(k)}, [2000 + k])
            continue
        count = None if k >= 50 else k * 10 + (1 if k < 20 else 0)
        events = [f"c{k}"] if 10 <= k < 15 else [f"a{k}"] + ([f"b{k}"] if k < 20 else [])
        attrs = {"x": float(k)} if k < 20 else {"x": float(k), "y": -float(k)}
        if 10 <= k < 15:
            attrs["z"] = 1.0
        out[k] = (count, events, attrs, [] if 50 <= k < 55 else [1000 + k])
    return out


def v1_content(job: Job, backends: Sequence[HeapKeyedStateBackend]) -> dict[int, Any]:
    found: dict[int, Any] = {}
    count = ValueStateDescriptor("count", "bigint")
    events = ListStateDescriptor("events", "string")
    attrs = MapStateDescriptor("attrs", "string", "double")
    for b in backends:
        stamps: dict[bytes, list[int]] = {}
        for t in b.timer_service.timers(EVENT):
            stamps.setdefault(t.key_bytes, []).append(t.timestamp)
        keys = {job.keys.deserialize(e.key_bytes) for name in ("count", "events", "attrs")
                for e in b.iter_entries(name)}
        for key in keys:
            b.set_current_key(key)
            found[key] = (b.get_state(count).value(), b.get_state(events).get(),
                          dict(b.get_state(attrs).items()),
                          stamps.get(job.keys.serialize(key), []))
    return found


def _v1_job(tmp_path: Path) -> tuple[Job, list[KeyedStateHandle]]:
    root = tmp_path / "fixture"
    shutil.copytree(FIXTURE, root)
    job = Job(tmp_path, HeapStateBackend(max_chain_length=3))
    job.storage = CheckpointStorage(str(root / "checkpoints"))
    handles = msgspec.json.decode((root / "handles.json").read_bytes(),
                                  type=list[KeyedStateHandle])
    assert all(h.properties["heap.format-version"] == "1" for h in handles)
    assert all(IMAGES_PROPERTY not in h.properties for h in handles)
    return job, handles


@pytest.mark.parametrize("parallelism", [2, 3, 1])
def test_a_version_1_chain_still_restores(tmp_path, parallelism):
    job, handles = _v1_job(tmp_path)
    assert v1_content(job, job.create_all(parallelism, handles)) == heap_v1_content()


@pytest.mark.parametrize("share", [True, False], ids=["claim", "no-claim"])
def test_a_version_1_chain_is_extended_by_rolling_files(tmp_path, share):
    """Restored exactly (2 subtasks), a version-1 chain is the base of rolling snapshots
    (version 2) until every key group was imaged again; each checkpoint restores."""
    job, handles = _v1_job(tmp_path)
    backends = job.create_all(2, handles, share=share)
    expected = heap_v1_content()
    count = ValueStateDescriptor("count", "bigint")
    for cid in range(4, 10):
        for key in range(cid, 60, 7):
            b = job.at(backends, key)
            b.get_state(count).update(-key)
            old = expected[key]
            expected[key] = (-key, *old[1:])
        handles = [job.snapshot(b, cid) for b in backends]
        names = [[n for n, _ in chain_of(h)] for h in handles]
        if cid == 4:  # the v1 chain (duplicated under new names without CLAIM) and one file
            assert all(len(n) == 4 for n in names)
            assert all(n[0] == ("000000000001-full" if share else "000000000000-0000-full")
                       for n in names)
        assert all(n[-1] == f"{cid:012d}-diff" for n in names)
        assert v1_content(job, job.create_all(2, handles)) == expected
        assert v1_content(job, job.create_all(3, handles)) == expected
    assert all("full" not in n[0] for n in names), "the version-1 files were never dropped"


# -- faults ------------------------------------------------------------------------------------


def _values(op: LocalKeyedOperator) -> dict[int, Any]:
    return {op.key_serializer.deserialize(e.key_bytes): e.value
            for sub in op.subtasks for e in sub.iter_entries(VALUE.name)}


@pytest.mark.parametrize("where", ["the-rolling-file", "after-one-rolling-file",
                                   "after-every-rolling-file"])
def test_a_storage_fault_around_a_rolling_file_keeps_the_previous_checkpoint(tmp_path, where):
    """A refused write (403) of the rolling file itself, of the next subtask's right after
    it, or of ``_metadata`` right after all of them: the checkpoint is aborted, the previous
    one restores, and the job's next checkpoint holds the change."""
    plan = FaultPlan(tmp_path / "faults.json")
    url = plan.url(str(tmp_path / "store" / "job"))

    def open_job() -> LocalKeyedOperator:
        return LocalKeyedOperator(url, key_types=["bigint"],
                                  backend=HeapStateBackend(max_chain_length=3), parallelism=2,
                                  local_dir=str(tmp_path / "work"),
                                  storage_options=plan.storage_options("file"))

    with open_job() as op:
        op.process(((k, k) for k in range(1_000)), _put)
        op.checkpoint()
        for round_ in range(5):  # a rolling chain: every file a diff plus images
            op.process(((k, -k) for k in range(round_ * 30, round_ * 30 + 30)), _put)
            previous = op.checkpoint()
        assert all(len(h.shared) > 1 for h in previous.metadata.handles)
        expected_previous = _values(op)
        op.process(((k, 7) for k in range(500, 560)), _put)
        if where == "the-rolling-file":
            plan.add("write", "denied", match="/shared/")
        elif where == "after-one-rolling-file":
            plan.add("write", "denied", match="/shared/", after=1)
        else:
            plan.add("write", "denied", match="_metadata")
        with pytest.raises(KeyedStateError):
            op.checkpoint()
        assert len(plan.fired()) == 1
        plan.clear()
        assert op.coordinator.latest_completed.checkpoint_id == previous.checkpoint_id
        with open_job() as again:
            assert _values(again) == expected_previous
        expected = _values(op)
        assert expected != expected_previous
        retried = op.checkpoint()
        assert retried.checkpoint_id > previous.checkpoint_id
        assert find_garbage(op.storage).files == []
    with open_job() as again:
        assert again.coordinator.latest_completed.checkpoint_id == retried.checkpoint_id
        assert _values(again) == expected


def test_kinds_of_a_rolling_chain(tmp_path):
    """The first snapshot and full=True ones image every key group (FULL); the others are
    DIFF files naming the key groups they image."""
    job = Job(tmp_path)
    taken = rolling_run(job, 1, 5, seed=3)
    kinds = [FileParts(job, chain_of(c.handles[0])[-1][1]).footer.kind for c in taken]
    assert kinds == [FULL, DIFF, DIFF, DIFF, DIFF]
