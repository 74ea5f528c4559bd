"""State access overhead: get + update through ValueState against raw rocksdict.

Both RocksDB sides do the same storage work per operation: one ``get`` and one ``put`` of the
same key bytes, in the same order, on a column family of a DB opened with the same options
(``RocksDBOptions().to_options()``: shared block cache, bloom filter, LZ4, and the WAL off
through ``RocksDBOptions().write_options()``).

- **raw rocksdict**: the stored key bytes of every key are computed before timing (the lower
  bound: no key encoding at all); values are 8-byte ``struct`` integers.
- **keyedstate rocksdb**: ``set_current_key(key, key_group)`` (key group precomputed, as the
  Spark runtime passes it; the key is serialized here), then ``state.value()`` and
  ``state.update(v + 1)`` on a typed ``bigint`` ValueState (checked MessagePack values).
- **keyedstate heap** (reference): the same calls on the heap backend.
- **keyedstate rocksdb cached**: the RocksDB side through the value cache
  (docs/rocksdb-backend.md, "The value cache"), sized to hold every key; its buffered writes
  are written out at the end of every pass (a snapshot's write-out, once per batch), inside
  the timing. **... cached 10x**: the same with the state ten times the cache (every key
  evicted before its next access: the keys come in the same order every pass).
- The plain **keyedstate rocksdb** side has the cache off (the path every access took before
  the cache).

And the bulk calls of a vectorized function (``process_batch``), per pass over all keys:

- **raw rocksdict multi-get**: ``cf.get(list of stored keys)`` (rocksdict's multi-get), one
  write batch of the incremented values: the raw lower bound of a bulk pass;
- **raw rocksdict gets**: the same with one ``cf.get(k)`` per key (the backend's choice, see
  ``RocksDBState._multi_get``);
- **keyedstate rocksdb bulk** / **keyedstate heap bulk**: the batch's keys encoded once
  (``KeySerializer.serialize_many``, key groups precomputed as the Spark runtime has them),
  ``state.get_many(keys)``, the values incremented, ``state.update_many(keys, values)``; and
  the same through the value cache (**cached bulk**, **cached 10x bulk**).

Every side first writes every key once (untimed), then runs ``rounds`` timed passes of
read-add-one-write over all keys. The sides are timed ``repeats`` times, interleaved, on fresh
DBs; the figures are medians.

200,000 keys, not more, in one DB: this measures the cost of the state layer, and both sides
must find RocksDB in its normal regime. At 1,000,000 keys in one DB the SST's bloom filter
block (~1.2 MiB) no longer fits in one 1 MiB shard of the default 64 MiB block cache, so every
lookup on both sides reloads it and takes ~40 us (see docs/benchmarks.md).
Goal (set with the keyed state core, docs/benchmarks.md): keyedstate rocksdb at most 2x raw
rocksdict.
"""

from __future__ import annotations

import statistics
import struct
from typing import Any, Callable, cast

from rocksdict import Rdict, WriteBatch

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import KeyedStateBackend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.rocksdb.key_layout import key_prefix, namespace_part
from keyedstate.backends.rocksdb.keyed_backend import RocksDBKeyedStateBackend
from keyedstate.backends.rocksdb.options import RocksDBOptions
from keyedstate.backends.rocksdb.value_cache import ENTRY_OVERHEAD
from keyedstate.keygroups import KeyGroupRange, key_group_prefix_bytes, serialize_key_group
from keyedstate.keys import KeySerializer
from keyedstate.serde import serialize_namespace
from keyedstate.state.batch_keys import BatchKeys
from keyedstate.state.descriptors import ValueStateDescriptor

from .common import machine, timed, user_keys, value_state, workdir

MAX_PARALLELISM = 128
STATE = "count"
_INT = struct.Struct("<q")

#: The value cache's estimate of one entry of this benchmark (a 2-byte state id, a key of
#: about 14 bytes, a 1-5 byte value): sizes "holds every key" and "a tenth of the state".
ENTRY_ESTIMATE = ENTRY_OVERHEAD + 21


def _flush(backend: KeyedStateBackend) -> None:
    """A snapshot's write-out of the value cache (nothing without one)."""
    if isinstance(backend, RocksDBKeyedStateBackend) and backend.value_cache is not None:
        backend.value_cache.flush()


def _cache_stats(backend: KeyedStateBackend, stats: dict[str, Any] | None) -> None:
    if stats is not None and isinstance(backend, RocksDBKeyedStateBackend) \
            and backend.value_cache is not None:
        cache = backend.value_cache
        stats.update(capacity=cache.capacity, bytes=cache.bytes, entries=len(cache.entries),
                     misses=cache.misses, evictions=cache.evictions, written=cache.written)


def _stored_keys(keys: list[str], ks: KeySerializer) -> list[bytes]:
    """The exact key bytes keyedstate's RocksDB backend stores for ``keys`` in a ValueState
    (layout of :mod:`keyedstate.backends.rocksdb.states`, no namespace)."""
    prefix_bytes = key_group_prefix_bytes(MAX_PARALLELISM)
    namespace = namespace_part(serialize_namespace(None))
    return [key_prefix(serialize_key_group(ks.key_group(k, MAX_PARALLELISM), prefix_bytes),
                       ks.serialize(k)) + namespace for k in keys]


def _raw(stored: list[bytes], rounds: int, path: str) -> float:
    options = RocksDBOptions()
    db = Rdict(path, options.to_options(), column_families={STATE: options.to_options()})
    cf = db.get_column_family(STATE)
    cf.set_write_options(options.write_options())
    # every key exists when read (written before timing)
    get = cast(Callable[[bytes], bytes], cf.get)
    put, pack, unpack = cf.put, _INT.pack, _INT.unpack
    try:
        for k in stored:
            put(k, pack(0))
        with timed() as t:
            for _ in range(rounds):
                for k in stored:
                    put(k, pack(unpack(get(k))[0] + 1))
        return t.seconds
    finally:
        del cf, get, put
        db.close()


def _raw_bulk(stored: list[bytes], rounds: int, path: str, multi_get: bool) -> float:
    options = RocksDBOptions()
    db = Rdict(path, options.to_options(), column_families={STATE: options.to_options()})
    cf = db.get_column_family(STATE)
    cf.set_write_options(options.write_options())
    handle = db.get_column_family_handle(STATE)
    pack, unpack = _INT.pack, _INT.unpack
    try:
        for k in stored:
            cf.put(k, pack(0))
        with timed() as t:
            for _ in range(rounds):
                get = cast(Callable[[Any], Any], cf.get)
                raws: list[bytes] = get(stored) if multi_get else [get(k) for k in stored]
                batch = WriteBatch(raw_mode=True)
                batch.set_default_column_family(handle)
                for k, raw in zip(stored, raws):
                    batch.put(k, pack(unpack(raw)[0] + 1))
                db.write(batch, options.write_options())
        return t.seconds
    finally:
        del cf, handle
        db.close()


def _ours_bulk(backend_name: str, names: list[str], key_groups: list[int], rounds: int,
               ks: KeySerializer, local_dir: str, options: dict[str, Any] | None = None,
               stats: dict[str, Any] | None = None) -> float:
    sub = load_backend(backend_name, **(options or {})).create_keyed_backend(
        KeyedStateBackendParameters(
            subtask_index=0, key_group_range=KeyGroupRange(0, MAX_PARALLELISM - 1),
            max_parallelism=MAX_PARALLELISM, key_serializer=ks, local_dir=local_dir))
    with sub:
        state = value_state(sub, ValueStateDescriptor(STATE, "bigint", default=0))
        state.update_many(BatchKeys(names, ks.serialize_many(names), key_groups),
                          [0] * len(names))
        _flush(sub)
        with timed() as t:
            for _ in range(rounds):
                keys = BatchKeys(names, ks.serialize_many(names), key_groups)
                state.update_many(keys, [v + 1 for v in state.get_many(keys)])  # type: ignore[operator]  # default 0
                _flush(sub)
        _cache_stats(sub, stats)
        return t.seconds


def _ours(backend_name: str, routed: list[tuple[str, int]], rounds: int, ks: KeySerializer,
          local_dir: str, options: dict[str, Any] | None = None,
          stats: dict[str, Any] | None = None) -> float:
    sub = load_backend(backend_name, **(options or {})).create_keyed_backend(
        KeyedStateBackendParameters(
            subtask_index=0, key_group_range=KeyGroupRange(0, MAX_PARALLELISM - 1),
            max_parallelism=MAX_PARALLELISM, key_serializer=ks, local_dir=local_dir))
    with sub:
        state = value_state(sub, ValueStateDescriptor(STATE, "bigint", default=0))
        set_key, value, update = sub.set_current_key, state.value, state.update
        for key, kg in routed:
            set_key(key, kg)
            update(0)
        _flush(sub)
        with timed() as t:
            for _ in range(rounds):
                for key, kg in routed:
                    set_key(key, kg)
                    update(value() + 1)  # type: ignore[operator]  # default 0, never None
                _flush(sub)
        _cache_stats(sub, stats)
        return t.seconds


def run(keys: int = 200_000, rounds: int = 3, repeats: int = 5,
        progress: Any = None) -> dict[str, Any]:
    ks = KeySerializer(["string"])
    names = user_keys(keys)
    routed = [(k, ks.key_group(k, MAX_PARALLELISM)) for k in names]
    stored = _stored_keys(names, ks)
    key_groups = [kg for _, kg in routed]
    off: dict[str, Any] = {"value_cache_size": 0}
    fits: dict[str, Any] = {"value_cache_size": 2 * keys * ENTRY_ESTIMATE}
    tenth: dict[str, Any] = {"value_cache_size": keys * ENTRY_ESTIMATE // 10}
    cache_stats: dict[str, dict[str, Any]] = {
        side: {} for side in ("keyedstate_rocksdb_cached", "keyedstate_rocksdb_cached_10x",
                              "keyedstate_rocksdb_cached_bulk",
                              "keyedstate_rocksdb_cached_10x_bulk")}
    with workdir("access") as root:
        sides: dict[str, Callable[[int], float]] = {
            "raw_rocksdict": lambda n: _raw(stored, rounds, f"{root}/raw-{n}"),
            "keyedstate_rocksdb": lambda n: _ours("rocksdb", routed, rounds, ks, f"{root}",
                                                  off),
            "keyedstate_rocksdb_cached": lambda n: _ours(
                "rocksdb", routed, rounds, ks, f"{root}", fits,
                cache_stats["keyedstate_rocksdb_cached"]),
            "keyedstate_rocksdb_cached_10x": lambda n: _ours(
                "rocksdb", routed, rounds, ks, f"{root}", tenth,
                cache_stats["keyedstate_rocksdb_cached_10x"]),
            "keyedstate_heap": lambda n: _ours("heap", routed, rounds, ks, f"{root}"),
            "raw_rocksdict_multi_get": lambda n: _raw_bulk(stored, rounds, f"{root}/mg-{n}",
                                                           multi_get=True),
            "raw_rocksdict_gets": lambda n: _raw_bulk(stored, rounds, f"{root}/g-{n}",
                                                      multi_get=False),
            "keyedstate_rocksdb_bulk": lambda n: _ours_bulk("rocksdb", names, key_groups,
                                                            rounds, ks, f"{root}", off),
            "keyedstate_rocksdb_cached_bulk": lambda n: _ours_bulk(
                "rocksdb", names, key_groups, rounds, ks, f"{root}", fits,
                cache_stats["keyedstate_rocksdb_cached_bulk"]),
            "keyedstate_rocksdb_cached_10x_bulk": lambda n: _ours_bulk(
                "rocksdb", names, key_groups, rounds, ks, f"{root}", tenth,
                cache_stats["keyedstate_rocksdb_cached_10x_bulk"]),
            "keyedstate_heap_bulk": lambda n: _ours_bulk("heap", names, key_groups, rounds,
                                                         ks, f"{root}"),
        }
        samples: dict[str, list[float]] = {side: [] for side in sides}
        for n in range(repeats):
            for side, fn in sides.items():
                if progress:
                    progress(f"access: {side} ({n + 1}/{repeats})")
                samples[side].append(fn(n))
    ops = keys * rounds
    median = {side: statistics.median(s) for side, s in samples.items()}
    raw = median["raw_rocksdict"]
    return {
        "benchmark": "access",
        "machine": machine(),
        "goal": "keyedstate rocksdb get+update at most 2x raw rocksdict",
        "keys": keys,
        "rounds": rounds,
        "repeats": repeats,
        "operations": ops,
        "samples_s": samples,
        "raw_rocksdict_us_per_op": raw / ops * 1e6,
        "keyedstate_rocksdb_us_per_op": median["keyedstate_rocksdb"] / ops * 1e6,
        "keyedstate_heap_us_per_op": median["keyedstate_heap"] / ops * 1e6,
        "rocksdb_over_raw": median["keyedstate_rocksdb"] / raw,
        "heap_over_raw": median["keyedstate_heap"] / raw,
        # the bulk calls (one pass = one get_many + update_many over all keys)
        "us_per_key_and_pass": {side: m / ops * 1e6 for side, m in median.items()},
        "rocksdb_bulk_over_raw_multi_get":
            median["keyedstate_rocksdb_bulk"] / median["raw_rocksdict_multi_get"],
        "rocksdb_bulk_over_per_key":
            median["keyedstate_rocksdb_bulk"] / median["keyedstate_rocksdb"],
        # the value cache: each RocksDB side against the heap's same calls
        "over_heap": {side: median[side] / median[heap]
                      for side, heap in [
                          ("keyedstate_rocksdb", "keyedstate_heap"),
                          ("keyedstate_rocksdb_cached", "keyedstate_heap"),
                          ("keyedstate_rocksdb_cached_10x", "keyedstate_heap"),
                          ("keyedstate_rocksdb_bulk", "keyedstate_heap_bulk"),
                          ("keyedstate_rocksdb_cached_bulk", "keyedstate_heap_bulk"),
                          ("keyedstate_rocksdb_cached_10x_bulk", "keyedstate_heap_bulk")]},
        "cache_sizes": {"fits": fits["value_cache_size"], "tenth": tenth["value_cache_size"]},
        "cache_stats_last_repeat": cache_stats,
        "goal_met": median["keyedstate_rocksdb"] / raw <= 2.0,
    }
