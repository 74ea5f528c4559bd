"""A fresh RocksDB backend of several key-group shards (``RocksDBOptions.key_group_shards``,
the default) and its rolling compaction: the same state and snapshots as one shard, checkpoints
bounded by one shard plus the change, restores with and without rescaling, storage faults
around a compaction. Real RocksDB, real files; bytes, never times."""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from keyedstate.backends import load_backend
from keyedstate.backends.rocksdb import RocksDBOptions, RocksDBStateBackend
from keyedstate.backends.rocksdb.backend import RocksDBKeyedStateBackend
from keyedstate.backends.rocksdb.snapshot import PROP_COMPACTED_INSTANCE, split_instances
from keyedstate.config import JobConfig
from keyedstate.errors import ConfigurationError, KeyedStateError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.state.descriptors import StateTtlConfig, ValueStateDescriptor
from keyedstate.state.timers import TimeDomain
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle
from keyedstate.testing.faults import FaultPlan

from .contract.bulk import TTLS, Script, bulk_kinds, records
from .contract.common import Harness

pytestmark = pytest.mark.integration

ONE_SHARD = RocksDBOptions(key_group_shards=1)
VALUE = ValueStateDescriptor("v", "count bigint, note string")


def _register(backend: Any, ttl: StateTtlConfig | None) -> None:
    for d in bulk_kinds(ttl).values():
        backend.get_state(d)


def _fill(harness: Harness, backends: list[Any], keys: range, round_: int) -> None:
    for key in keys:
        backend = harness.at(backends, key)
        backend.get_state(VALUE).update({"count": round_, "note": f"{key:08d}"})


def _values(backends: list[Any]) -> dict[tuple[int, bytes], Any]:
    return {(e.key_group, e.key_bytes): e.value for b in backends for e in b.iter_entries("v")}


def test_default_options_shard_a_fresh_backend(tmp_path: Path) -> None:
    harness = Harness(RocksDBStateBackend(), tmp_path)
    try:
        kb = harness.create(0, 2)
        assert isinstance(kb, RocksDBKeyedStateBackend)
        ranges = [i.key_group_range for i in kb.instances]
        assert len(ranges) == 8 and kb.key_group_range.is_split_into(ranges)
        assert {len(r) for r in ranges} == {8}  # 64 key groups, 8 each
        # Capped at one shard per key group.
        small = harness.create(key_group_range=KeyGroupRange(3, 5), max_parallelism=128)
        assert isinstance(small, RocksDBKeyedStateBackend) and len(small.instances) == 3
    finally:
        harness.close_all()
    assert RocksDBStateBackend().instance_cap == 16
    assert RocksDBStateBackend(ONE_SHARD).instance_cap == 4
    with pytest.raises(KeyedStateError, match="key_group_shards"):
        RocksDBOptions(key_group_shards=0)
    assert RocksDBOptions().automatic_size_amplification_percent == 800
    assert ONE_SHARD.automatic_size_amplification_percent == 200
    assert not RocksDBOptions(compaction_style="level").rolling_compaction


def test_the_key_group_shards_key_reaches_the_backend(tmp_path: Path) -> None:
    def backend_of(**settings: Any) -> Any:
        config = JobConfig.from_mapping({"execution.checkpointing.dir": "/tmp/x", **settings})
        return load_backend(config.backend, **config.backend_options)

    key = "keyedstate.backend.rocksdb.key-group-shards"
    assert backend_of().options == RocksDBOptions()
    assert backend_of(**{key: "2"}).options == RocksDBOptions(key_group_shards=2)
    # It overrides the shards of options given, and keeps their other fields, whichever form
    # they were given in; the value cache's key goes in beside it.
    given = RocksDBOptions(block_size=8192, key_group_shards=4)
    both = backend_of(**{key: 1, "keyedstate.backend.options": {"options": given},
                         "keyedstate.backend.rocksdb.value-cache-size": "1 mb"})
    assert both.options == RocksDBOptions(block_size=8192, key_group_shards=1)
    assert both.value_cache_size == 1 << 20
    assert backend_of(**{key: 1, "keyedstate.backend.options":
                         '{"options": {"block_size": 8192}}'}).options == \
        RocksDBOptions(block_size=8192, key_group_shards=1)
    assert backend_of(**{key: 1, "state.backend.type": "heap"}).name == "heap"
    for bad in (0, "many", True):
        with pytest.raises(ConfigurationError, match="key-group-shards"):
            backend_of(**{key: bad})
    # A fresh subtask gets that many instances.
    harness = Harness(backend_of(**{key: 2}), tmp_path)
    try:
        kb = harness.create(0, 2)
        assert isinstance(kb, RocksDBKeyedStateBackend) and len(kb.instances) == 2
    finally:
        harness.close_all()


@pytest.mark.parametrize("ttl", sorted(TTLS))
def test_sharded_and_unsharded_backends_store_and_snapshot_the_same(tmp_path: Path,
                                                                    ttl: str) -> None:
    """Per-key calls on one backend and bulk calls on the other, both ways round: every
    result and every record equal, after snapshots and restores too, timers included."""
    config = TTLS[ttl]
    harness = Harness(RocksDBStateBackend(), tmp_path)
    sharded, one = RocksDBStateBackend(), RocksDBStateBackend(ONE_SHARD)
    try:
        for per_key_config, bulk_config in ((one, sharded), (sharded, one)):
            a = harness.create(state_backend=per_key_config)
            b = harness.create(state_backend=bulk_config)
            _register(a, config)
            _register(b, config)
            assert {len(x.instances) for x in (a, b)} == {1, 8}  # type: ignore[attr-defined]
            script = Script(harness, config, 17, range(80))
            script.run(a, b, 6)
            for key in range(0, 80, 7):
                for x in (a, b):
                    x.set_current_key(key)
                    x.timer_service.register_event_time_timer(1000 + key)
                    x.timer_service.register_processing_time_timer(2000 - key)
            handles = [harness.snapshot(x) for x in (a, b)]
            script.run(a, b, 6)
            handles = [harness.snapshot(x) for x in (a, b)]
            expected = records([a])
            assert records([b]) == expected and any(expected.values())
            timers = [sorted(x.timer_service.timers(domain)) for x in (a, b)
                      for domain in (TimeDomain.EVENT_TIME, TimeDomain.PROCESSING_TIME)]
            assert timers[:2] == timers[2:]
            for handle, config_ in zip(handles, (per_key_config, bulk_config)):
                restored = harness.create(handles=[handle], state_backend=config_)
                _register(restored, config)
                assert len(restored.instances) == len(split_instances(handle))  # type: ignore[attr-defined]
                assert records([restored]) == expected
                assert [sorted(restored.timer_service.timers(d)) for d in
                        (TimeDomain.EVENT_TIME, TimeDomain.PROCESSING_TIME)] == timers[:2]
    finally:
        harness.close_all()


def _shard_sizes(handle: KeyedStateHandle) -> list[int]:
    return [sum(s.length for s in sub.files.values()) for sub in split_instances(handle)]


def test_no_checkpoint_uploads_more_than_one_shard_plus_the_change(tmp_path: Path) -> None:
    """Many checkpoints of random updates: each uploads at most the largest shard plus three
    times the median checkpoint (the change and the merges of its small runs; measured here
    at most 0.8 median over the shard), and rolling compactions happen (else the bound would
    be empty). One shard, for contrast, uploads most of its state in some checkpoint (90%
    measured). Bytes depend a little on when RocksDB's background compactions finish, hence
    the margins."""
    rnd = random.Random(5)
    keys = range(20_000)
    written: dict[int, list[tuple[int, int, int]]] = {}
    compactions = 0
    for shards in (8, 1):
        options = RocksDBOptions(key_group_shards=shards, write_buffer_size=1 << 20)
        harness = Harness(RocksDBStateBackend(options), tmp_path / f"s{shards}")
        try:
            kb = harness.create()
            _fill(harness, [kb], keys, 0)
            harness.snapshot(kb, full=True)
            rows = []
            for round_ in range(1, 61):
                for key in rnd.sample(keys, 600):  # 3% changed
                    kb.set_current_key(key)
                    kb.get_state(VALUE).update({"count": round_, "note": f"{key:08d}"})
                handle = harness.snapshot(kb)
                if shards > 1 and PROP_COMPACTED_INSTANCE in handle.properties:
                    compactions += 1
                rows.append((handle.incremental_size, max(_shard_sizes(handle)),
                             handle.full_size))
            written[shards] = rows
        finally:
            harness.close_all()
    median = statistics.median(w for w, _, _ in written[8])
    for i, (w, largest_shard, full) in enumerate(written[8]):
        assert w <= largest_shard + 3 * median, (i, w, largest_shard, median, full)
        assert w <= 0.4 * full, (i, w, full)  # one shard is about 1/8 of it
    assert compactions >= 4
    assert max(w / full for w, _, full in written[1]) > 0.5


def _restore_and_check(harness: Harness, handles: list[KeyedStateHandle], parallelism: int,
                       expected: dict[tuple[int, bytes], Any]) -> list[Any]:
    backends = harness.create_all(parallelism, handles=handles)
    assert _values(backends) == expected
    return backends


@pytest.mark.parametrize("old, new", [(1, 1), (2, 2), (2, 3), (3, 1)])
def test_sharded_snapshots_restore_with_and_without_rescaling(tmp_path: Path, old: int,
                                                              new: int) -> None:
    harness = Harness(RocksDBStateBackend(), tmp_path)
    try:
        backends = harness.create_all(old)
        _fill(harness, backends, range(3000), 1)
        harness.snapshot_all(backends)
        _fill(harness, backends, range(0, 3000, 3), 2)
        handles = harness.snapshot_all(backends)
        expected = _values(backends)
        assert all(len(split_instances(h)) == 8 for h in handles)
        restored = _restore_and_check(harness, handles, new, expected)
        counts = [len(b.instances) for b in restored]
        ingested = sum(b.ingested_on_restore for b in restored)
        if old == new:  # every shard reopened as it was
            assert counts == [8] * new and ingested == 0
        elif (old, new) == (2, 3):  # every overlapping old shard kept, none rewritten
            assert ingested == 0 and all(6 <= c <= 9 for c in counts)
        else:  # 24 old shards into one subtask: 16 kept, the others ingested
            assert counts == [16] and ingested == 8
        # The restored backends keep checkpointing incrementally, and restore again.
        _fill(harness, restored, range(1, 3000, 5), 3)
        again = harness.snapshot_all(restored)
        _restore_and_check(harness, again, old, _values(restored))
    finally:
        harness.close_all()


@pytest.mark.parametrize("fail_round", [2, 3, 4])
def test_a_storage_fault_around_a_rolling_compaction_keeps_the_last_checkpoint(
        tmp_path: Path, fail_round: int) -> None:
    """A trigger of 1% compacts a shard at every snapshot from the second incremental one on
    (amplification is measured before the flush: the first finds one run per shard); an
    upload refused by the store (not retried) fails the checkpoint of round ``fail_round``:
    a compacting checkpoint fails right after a completed compacting one (or after one that
    compacted nothing), and the next compacting one follows the failure. The last completed checkpoint restores with only its files left,
    right after the failure and at the end."""
    plan = FaultPlan(tmp_path / "faults.json")
    options = RocksDBOptions(rolling_compaction_amplification_percent=1)
    harness = Harness(RocksDBStateBackend(options), tmp_path)
    harness.storage = CheckpointStorage(plan.url(str(tmp_path / "faulty")),
                                        plan.storage_options("file"))

    def check_last_completed() -> None:
        harness.delete_all_but([completed[-1]])
        restored = harness.create(handles=[completed[-1]])
        assert _values([restored]) == states[-1]

    try:
        kb = harness.create()
        _fill(harness, [kb], range(2000), 0)
        completed = [harness.snapshot(kb)]
        states = [_values([kb])]
        for round_ in range(1, 6):
            _fill(harness, [kb], range(round_, 2000, 4), round_)
            if round_ == fail_round:
                plan.add("write", "denied", match="/shared/", times=-1)
                cid = harness.next_id()
                result = kb.snapshot(cid, harness.location(cid, kb))
                assert PROP_COMPACTED_INSTANCE in result._properties  # type: ignore[attr-defined]
                with pytest.raises(KeyedStateError):
                    result.materialize()
                kb.notify_checkpoint_aborted(cid)
                plan.clear()
                check_last_completed()
                continue
            handle = harness.snapshot(kb)
            assert (PROP_COMPACTED_INSTANCE in handle.properties) == (round_ > 1)
            completed.append(handle)
            states.append(_values([kb]))
        check_last_completed()
    finally:
        harness.close_all()
