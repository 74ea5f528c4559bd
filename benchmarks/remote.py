"""State on object storage: bytes moved per checkpoint, savepoint and restore.

Runs against a local S3-compatible server (moto, started here on loopback) through s3fs, with
the in-process runtime (:class:`~keyedstate.runtime.local.LocalKeyedOperator`, 2 subtasks, RocksDB).

**Incremental checkpoints** (``keys`` keys, one ValueState per key: a bigint counter and a
16-character string): load, take a base checkpoint, then ``batches`` times update a fresh random
1% of the keys and checkpoint. *Changed data* per batch is the serialized size of the changed
entries (RocksDB key: key group, key, namespace; value); *uploaded* is every byte the job sent
to the store for the checkpoint (state files, merged objects, ``_metadata``), counted by the
storage layer. Goal: uploaded <= 3x changed, summed over the batches (compactions included).
Run twice: RocksDB's default leveled compaction and universal compaction.

**A state of at least 1 GiB** (``big_keys`` keys of 1100 random bytes):

0. settle it (one full compaction: a long-running job's DB is not a pile of freshly loaded
   runs, which would compact right after the restore and make its first checkpoint upload
   compaction output that has nothing to do with the restore);
1. checkpoint it (the one full upload);
2. a native savepoint of the running job: every object duplicated by the store (CopyObject);
3. a NO_CLAIM restore on a *new executor* (empty file cache): the restore downloads the state
   (RocksDB needs its files on local disk), its first checkpoint has the store duplicate them
   into the new job's root;
4. the same restore on an executor with a *warm cache* (the files it downloaded in 3).

Bytes through the job's processes are counted by the storage layer (uploads, downloads, copies
streamed through the process); as an independent upper bound the loopback interface's bytes
(``/proc/net/dev``: every process on the machine, both directions) are reported too. Goal:
savepoint and NO_CLAIM duplication move < 1% of the state through the job's processes.

**Behind a latency model** (``latency``, ``--latency``: ``none``, a model's name such as
``s3-standard-same-region`` or figures such as ``ms=30,mb_per_s=90``; docs/object-storage.md,
"A latency model for benchmarks"): every checkpoint, savepoint and restore reaches the server
through ``kslatency://``, each request paying the model's first-byte latency and its bytes at
the model's per-stream bandwidth. Everything runs in this process, so each checkpoint (and
the large state's savepoint, restores and first checkpoints) also records its ``requests``:
by kind and by area of the root, with the seconds the model charged and the wall seconds. The
JSON records the model's parameters.

**A restore on a worker without a copy** (``run(cold_restore=True)``, ``--cold-restore``:
this part only, on both backends): what a batch costs when Spark runs a subtask's task in a
worker that holds no live copy of its state and has never read its files (an empty file
cache). For each backend, an in-process job of 2 subtasks
(:class:`~keyedstate.runtime.local.LocalKeyedOperator`, one ValueState per key as above) loads ``keys`` keys in batches of at most
``load_batch_keys``, each checkpointed (a long-running job's chain: RocksDB's shared SSTs, the
heap backend's base and diffs), then runs ``batches`` batches of ``distinct_keys`` random keys
each, every one checkpointed with its copies live (``batch_median_s``: the median of those
batches, update and checkpoint of both subtasks). Then, with every file cache emptied, subtask
0 is restored from the latest checkpoint as a fresh worker would, in three phases:
``listing_metadata_s`` (finding the latest checkpoint and reading its ``_metadata``: what a
restarted job pays once; a worker of a running job gets the handles with its task and pays
none of it), ``download_s`` (every file of every key-group shard, through one pool of
``threads``), ``open_s`` (RocksDB's opens; the heap backend's decoding into Python objects);
with the restore's requests, its round trips (requests on the critical path) and the most in
flight at once, read from the latency model's request log. The same restore with a warm file
cache follows (``warm_cache``: the local part alone). ``restore_over_batch_median`` is the
cold restore's seconds over the batch median: what landing on a worker without a copy adds to
a batch.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Sequence

from keyedstate.backends import load_backend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.rocksdb import RocksDBOptions, RocksDBStateBackend
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.runtime.local import LocalKeyedOperator
from keyedstate.state.descriptors import ValueStateDescriptor
from keyedstate.storage.cache import all_process_caches, process_file_cache
from keyedstate.storage.transfer import (
    RESTORE_PREFIX,
    GiB,
    RestorePhases,
    TransferOptions,
    TransferStats,
)
from keyedstate.testing.latency import (
    LatencyModel,
    RequestCounts,
    peak_in_flight,
    process_counts,
    read_request_log,
    round_trips,
)
from keyedstate.testing.s3 import start_moto_server, stop_moto_server

from .common import Location, behind, latency_model, machine, save_figure, timed

PROFILE = ValueStateDescriptor("profile", "count bigint, note string")
BLOB = ValueStateDescriptor("blob", "binary")
GOAL_UPLOAD_RATIO = 3.0
GOAL_THROUGH_FRACTION = 0.01
#: Key bytes around the key in RocksDB: key group (1), key length (1), namespace (2).
KEY_OVERHEAD = 4


# -- the local S3 server -----------------------------------------------------------------------

#: the local S3 server's CPU scheduling: as any process, or only on a core the job leaves idle
STORE_PRIORITIES = ("normal", "idle")


class LocalS3:
    """moto's server on a free loopback port, with one fresh bucket; ``priority`` one of
    :data:`STORE_PRIORITIES` (``idle``: Linux's ``SCHED_IDLE``, so that the stand-in for a
    remote store takes no CPU time the job's processes want, as a real store's takes none
    on the job's machines; ``keyedstate.testing.s3.start_moto_server``)."""

    def __init__(self, priority: str = "normal") -> None:
        if priority not in STORE_PRIORITIES:
            raise ValueError(f"priority must be one of {STORE_PRIORITIES}, not {priority!r}")
        self.priority = priority

    def __enter__(self) -> LocalS3:
        import boto3

        self.proc, self.endpoint = start_moto_server(idle=self.priority == "idle")
        self.bucket = f"ks-bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id="bench", aws_secret_access_key="bench"
                     ).create_bucket(Bucket=self.bucket)
        self.options = {"key": "bench", "secret": "bench",
                        "client_kwargs": {"endpoint_url": self.endpoint}}
        return self

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def __exit__(self, *exc: object) -> None:
        stop_moto_server(self.proc)


def loopback_bytes() -> int | None:
    """Bytes received on the loopback interface so far (Linux), else None."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[0])
    except OSError:
        return None
    return None


class Meter:
    """Bytes a storage object moved, and loopback bytes, between two points."""

    def __init__(self, *storages: Any) -> None:
        self.storages = storages
        self.before = [s.stats.as_dict() for s in storages]
        self.lo = loopback_bytes()
        self.requests = process_counts()

    def done(self) -> dict[str, Any]:
        total = TransferStats()
        for storage, before in zip(self.storages, self.before):
            now = storage.stats.as_dict()
            total.add(**{k: now[k] - before[k] for k in now})
        lo = loopback_bytes()
        return {"through_process_bytes": total.uploaded_bytes + total.downloaded_bytes,
                "uploaded_bytes": total.uploaded_bytes,
                "downloaded_bytes": total.downloaded_bytes,
                "duplicated_bytes": total.duplicated_bytes,
                "objects_written": total.uploaded_objects + total.duplicated_objects,
                "retries": total.retries,
                "loopback_bytes": None if lo is None or self.lo is None else lo - self.lo,
                "requests": requests_since(self.requests)}


def requests_since(before: RequestCounts) -> dict[str, Any] | None:
    """The requests a latency model's wrapper counted in this process since ``before``, by
    kind and area (None: nothing went through one)."""
    moved = process_counts() - before
    return moved.as_dict() if moved.cells else None


def _sum_props(metadata: Any, prefix: str = "transfer.") -> dict[str, int]:
    total = TransferStats.from_properties(metadata.properties, prefix)
    for handle in metadata.handles:
        total.merge(TransferStats.from_properties(handle.properties, prefix))
    return total.as_dict()


def _clear_caches() -> None:
    for cache in all_process_caches():
        cache.clear()


# -- incremental checkpoints -------------------------------------------------------------------

def incremental(s3: LocalS3 | Location, work: str, keys: int, batches: int, fraction: float,
                compaction: str, seed: int = 7) -> dict[str, Any]:
    backend = RocksDBStateBackend(RocksDBOptions(compaction_style=compaction,
                                                 level0_file_num_compaction_trigger=(
                                                     8 if compaction == "universal" else 4)))
    name = f"incremental-{compaction}"
    op = LocalKeyedOperator(s3.url(name), key_types=["string"], backend=backend, parallelism=2,
                            local_dir=os.path.join(work, name), storage_options=s3.options)
    rng = random.Random(seed)
    all_keys = [f"user-{i:08d}" for i in range(keys)]
    serializer = PROFILE.value_serializer
    key_bytes = [len(op.key_serializer.serialize(k)) + KEY_OVERHEAD for k in all_keys]

    def put(sub: Any, key: str, round_: int) -> None:
        sub.get_state(PROFILE).update({"count": round_, "note": key[-4:] * 4})

    try:
        with timed() as t_load:
            op.process(((k, 0) for k in all_keys), put)
        meter = Meter(op.storage)
        base = op.checkpoint()
        base_moved = meter.done()
        per_batch: list[dict[str, Any]] = []
        changed = max(1, int(keys * fraction))
        for round_ in range(1, batches + 1):
            picked = rng.sample(range(keys), changed)
            op.process(((all_keys[i], round_) for i in picked), put)
            changed_bytes = sum(key_bytes[i] + len(serializer.serialize(
                {"count": round_, "note": all_keys[i][-4:] * 4})) for i in picked)
            meter = Meter(op.storage)
            with timed() as t_ckpt:
                checkpoint = op.checkpoint()
            moved = meter.done()
            per_batch.append({"checkpoint_id": checkpoint.checkpoint_id,
                              "changed_bytes": changed_bytes,
                              "uploaded_bytes": moved["uploaded_bytes"],
                              "objects_written": moved["objects_written"],
                              "inlined_bytes": _sum_props(checkpoint.metadata)["inlined_bytes"],
                              "full_bytes": checkpoint.metadata.full_size,
                              "seconds": t_ckpt.seconds, "requests": moved["requests"]})
    finally:
        op.close()
    uploaded = sum(b["uploaded_bytes"] for b in per_batch)
    changed_total = sum(b["changed_bytes"] for b in per_batch)
    ratios = [b["uploaded_bytes"] / b["changed_bytes"] for b in per_batch]
    return {
        "compaction": compaction, "keys": keys, "batches": batches,
        "changed_keys_per_batch": changed, "load_s": t_load.seconds,
        "base_checkpoint": {"uploaded_bytes": base_moved["uploaded_bytes"],
                            "objects_written": base_moved["objects_written"],
                            "full_bytes": base.metadata.full_size},
        "uploaded_over_changed": uploaded / changed_total,
        "median_batch_ratio": sorted(ratios)[len(ratios) // 2],
        "max_batch_ratio": max(ratios),
        "mean_changed_bytes": changed_total / batches,
        "mean_uploaded_bytes": uploaded / batches,
        "mean_objects_per_checkpoint": sum(b["objects_written"] for b in per_batch) / batches,
        "goal_met": uploaded / changed_total <= GOAL_UPLOAD_RATIO,
        "per_batch": per_batch,
    }


# -- a large state: savepoint and NO_CLAIM restores ---------------------------------------------

def large(s3: LocalS3 | Location, work: str, keys: int, value_bytes: int,
          progress: Callable[[str], None]) -> dict[str, Any]:
    transfer = TransferOptions(cache_bytes=4 * GiB, cache_dir=work)
    backend = RocksDBStateBackend(RocksDBOptions(compaction_style="universal",
                                                 level0_file_num_compaction_trigger=8))

    def job(name: str, **kwargs: Any) -> LocalKeyedOperator:
        return LocalKeyedOperator(s3.url(name), key_types=["bigint"], backend=backend,
                                  parallelism=2, local_dir=os.path.join(work, name),
                                  storage_options=s3.options, transfer=transfer, **kwargs)

    def put(sub: Any, key: int, value: bytes) -> None:
        sub.get_state(BLOB).update(value)

    out: dict[str, Any] = {"keys": keys, "value_bytes": value_bytes}
    progress("large state: loading")
    source = job("large-source")
    rng = random.Random(3)
    with timed() as t:
        source.process(((k, rng.randbytes(value_bytes)) for k in range(keys)), put)
    out["load_s"] = t.seconds
    # A long-running job's DB is settled; one loaded in a single batch holds dozens of sorted
    # runs and would start compacting right after any restore, so that the first checkpoint
    # uploads compaction output that has nothing to do with the restore. Settle it once.
    with timed() as t:
        for sub in source.subtasks:
            cache = getattr(sub, "value_cache", None)
            if cache is not None:  # the values still buffered join the settled DB
                cache.flush()
            for instance in sub.instances:  # type: ignore[attr-defined]
                for cf in instance.cfs.values():
                    cf.compact_range(None, None)
    out["settle_s"] = t.seconds
    # 1. The one full upload.
    progress("large state: first checkpoint (full upload)")
    meter = Meter(source.storage)
    with timed() as t:
        checkpoint = source.checkpoint()
    state = checkpoint.metadata.full_size
    out["state_bytes"] = state
    out["checkpoint"] = {"seconds": t.seconds, **meter.done()}
    # 2. A native savepoint of the running job.
    progress("large state: native savepoint")
    lo_before, requests_before = loopback_bytes(), process_counts()
    with timed() as t:
        sp_url = source.savepoint(s3.url("large-savepoint"))
    lo_after = loopback_bytes()
    savepoint_requests = requests_since(requests_before)
    savepoint = resolve_snapshot(sp_url, s3.options).metadata
    recorded = _sum_props(savepoint)  # counted by the savepoint's own storage object
    out["savepoint"] = {
        "seconds": t.seconds,
        "through_process_bytes": recorded["uploaded_bytes"] + recorded["downloaded_bytes"],
        "duplicated_bytes": recorded["duplicated_bytes"],
        "objects_written": recorded["duplicated_objects"] + recorded["uploaded_objects"],
        "loopback_bytes": None if lo_before is None or lo_after is None
        else lo_after - lo_before, "requests": savepoint_requests}
    source.close()
    # 3. and 4. NO_CLAIM restores on a new executor, then on one with a warm cache.
    for case, clear in (("restore_new_executor", True), ("restore_warm_cache", False)):
        progress(f"large state: NO_CLAIM {case.replace('_', ' ')}")
        if clear:
            _clear_caches()
        name = f"large-{case}"
        lo_before, requests_before = loopback_bytes(), process_counts()
        with timed() as t_restore:
            restored = job(name, restore_path=s3.url("large-savepoint"))
        restore_lo = loopback_bytes()
        restore_requests = requests_since(requests_before)
        meter = Meter(restored.storage)
        with timed() as t_first:
            first = restored.checkpoint()
        first_moved = meter.done()
        restore = _sum_props(first.metadata, RESTORE_PREFIX)
        restored.close()
        out[case] = {
            "restore_s": t_restore.seconds,
            "restore_downloaded_bytes": restore["downloaded_bytes"],
            "restore_cache_hit_bytes": restore["cache_hit_bytes"],
            "restore_loopback_bytes": (None if lo_before is None or restore_lo is None
                                       else restore_lo - lo_before),
            "restore_requests": restore_requests,
            "first_checkpoint_s": t_first.seconds,
            "first_checkpoint": first_moved,
            "through_process_bytes": restore["downloaded_bytes"]
            + first_moved["through_process_bytes"],
        }
    cache = process_file_cache(transfer.cache_bytes, transfer.cache_dir)
    out["file_cache"] = cache.stats() if cache is not None else None
    sp_through = out["savepoint"]["through_process_bytes"]
    dup_through = max(out[c]["first_checkpoint"]["through_process_bytes"]
                      for c in ("restore_new_executor", "restore_warm_cache"))
    warm_through = out["restore_warm_cache"]["through_process_bytes"]
    out["savepoint_through_fraction"] = sp_through / state
    out["no_claim_duplication_through_fraction"] = dup_through / state
    out["no_claim_warm_restore_through_fraction"] = warm_through / state
    out["warm_over_new_restore_time"] = (out["restore_warm_cache"]["restore_s"]
                                         / out["restore_new_executor"]["restore_s"])
    out["goal_met"] = (state >= GiB and max(sp_through, dup_through, warm_through)
                       < GOAL_THROUGH_FRACTION * state)
    return out


# -- a restore on a worker without a copy ------------------------------------------------------

COLD_RESTORE_BACKENDS = ("rocksdb", "heap")


def measure_cold_restore(store: Location, work: str, backend: str, keys: int, batches: int,
                 distinct_keys: int, load_batch_keys: int, threads: int,
                 progress: Callable[[str], None], seed: int = 11) -> dict[str, Any]:
    """The cold-restore part for one backend (module docstring): load, measured batches, then
    subtask 0 restored with an empty file cache and again with a warm one."""
    name = f"cold-restore-{backend}"
    url = store.url(name)
    transfer = TransferOptions(threads=threads, cache_bytes=64 * GiB,
                               cache_dir=os.path.join(work, f"{name}-cache"))
    op = LocalKeyedOperator(url, key_types=["string"], backend=backend, parallelism=2,
                            local_dir=os.path.join(work, name), storage_options=store.options,
                            transfer=transfer)
    all_keys = [f"user-{i:08d}" for i in range(keys)]

    def put(sub: Any, key: str, round_: int) -> None:
        sub.get_state(PROFILE).update({"count": round_, "note": key[-4:] * 4})

    out: dict[str, Any] = {"backend": backend, "keys": keys, "threads": threads}
    try:
        # Step 1. Load the state as a job's first batches do, a checkpoint after each.
        with timed() as t:
            for start in range(0, keys, load_batch_keys):
                progress(f"cold restore, {backend}: loading keys {start:,} to "
                         f"{min(keys, start + load_batch_keys):,}")
                op.process(((k, 0) for k in all_keys[start:start + load_batch_keys]), put)
                op.checkpoint()
        out["load_s"] = t.seconds
        # Step 2. Measured batches, the copies live.
        progress(f"cold restore, {backend}: {batches} batches of {distinct_keys:,} keys")
        rng = random.Random(seed)
        seconds = []
        for round_ in range(1, batches + 1):
            picked = rng.sample(all_keys, distinct_keys)
            with timed() as t:
                op.process(((k, round_) for k in picked), put)
                checkpoint = op.checkpoint()
            seconds.append(t.seconds)
        out["batch_seconds"] = seconds
        out["batch_median_s"] = statistics.median(seconds)
        out["full_bytes"] = checkpoint.metadata.full_size
        max_parallelism = op.max_parallelism
    finally:
        op.close()
    # Step 3. Subtask 0 on a worker that never saw the state, then on one that did.
    for case, clear in (("cold", True), ("warm_cache", False)):
        progress(f"cold restore, {backend}: subtask 0 restored, {case.replace('_', ' ')}")
        if clear:
            _clear_caches()
        out[case] = _restore_subtask(store, url, transfer, backend, max_parallelism,
                                     os.path.join(work, f"{name}-{case}"))
    cold = out["cold"]
    out["restore_over_batch_median"] = cold["restore_s"] / out["batch_median_s"]
    return out


def _restore_subtask(store: Location, url: str, transfer: TransferOptions, backend: str,
                     max_parallelism: int, local_dir: str) -> dict[str, Any]:
    """Subtask 0 of 2 restored from the latest checkpoint at ``url``: its phases, bytes and
    requests (round trips and the most in flight from the request log, with a model)."""
    started, requests_before = time.time(), process_counts()
    with timed() as t_meta:
        resolved = resolve_snapshot(url, store.options, transfer)
    metadata = resolved.metadata
    with timed() as t_restore:
        restored = load_backend(backend).create_keyed_backend(KeyedStateBackendParameters(
            subtask_index=0,
            key_group_range=KeyGroupRange.of_operator(max_parallelism, 2, 0),
            max_parallelism=max_parallelism,
            key_serializer=KeySerializer(["string"]),
            restore_handles=metadata.handles,
            storage=resolved.storage,
            local_dir=local_dir,
        ))
    try:
        # Both backends keep these (not part of the backend contract).
        phases: RestorePhases | None = getattr(restored, "restore_phases", None)
        stats: TransferStats = getattr(restored, "restore_stats", None) or TransferStats()
    finally:
        restored.close()
    handles = [h for h in metadata.handles
               if h.key_group_range.intersection(KeyGroupRange.of_operator(max_parallelism, 2,
                                                                           0))]
    files = [f for h in handles for f in h.streams()]
    out: dict[str, Any] = {
        "restore_s": t_meta.seconds + t_restore.seconds,
        "listing_metadata_s": t_meta.seconds,
        "download_s": phases.download_s if phases else 0.0,
        "open_s": phases.open_s if phases else 0.0,
        # the restore's own seconds not in either phase (checks, the backend's start)
        "other_s": t_restore.seconds - (phases.download_s + phases.open_s if phases else 0.0),
        "checkpoint_id": metadata.checkpoint_id,
        "files": len(files),
        # the stored objects those files are (merged small files share one)
        "objects": len({f.path for f in files if f.data is None}),
        "inline_files": sum(f.data is not None for f in files),
        # the files' own bytes (as a handle's full size counts them)
        "state_bytes": sum(f.length for f in files),
        "downloaded_bytes": stats.downloaded_bytes,
        "cache_hit_bytes": stats.cache_hit_bytes,
        "requests": requests_since(requests_before),
    }
    if store.log_dir is not None:
        records = [r for r in read_request_log(store.log_dir) if r.t >= started
                   and r.kind == "read" and r.area not in ("metadata",)]
        out["data_round_trips"] = round_trips(records)
        out["data_peak_in_flight"] = peak_in_flight(records)
    return out


def run_cold_restore(store: Location, work: str, keys: int, batches: int,
                     distinct_keys: int | None, load_batch_keys: int, threads: int,
                     backends: Sequence[str], progress: Callable[[str], None]
                     ) -> list[dict[str, Any]]:
    """:func:`measure_cold_restore` for each of ``backends``."""
    distinct = distinct_keys if distinct_keys is not None else min(50_000, max(1, keys // 2))
    return [measure_cold_restore(store, work, backend, keys, batches, distinct, load_batch_keys,
                         threads, progress) for backend in backends]


def run(keys: int = 1_000_000, batches: int = 50, fraction: float = 0.01,
        big_keys: int | None = None, value_bytes: int = 1100,
        progress: Callable[[str], None] | None = None,
        latency: str | LatencyModel | None = None, cold_restore: bool = False,
        cold_restore_batches: int = 10, distinct_keys: int | None = None,
        load_batch_keys: int = 1_000_000, threads: int = 4,
        backends: Sequence[str] = COLD_RESTORE_BACKENDS) -> dict[str, Any]:
    """Both parts (module docstring); ``keys`` sizes the incremental part and, unless
    ``big_keys`` is given, the large one (``keys`` values of ``value_bytes``: 1 M x 1100 bytes
    is 1.13 GB, over 1 GiB); ``latency``: the model the server is behind (None or ``"none"``:
    none). ``cold_restore``: the cold-restore part only, at ``keys`` keys on ``backends``
    (``cold_restore_batches`` measured batches of ``distinct_keys``, default 50 K or half the
    keys; loading batches of ``load_batch_keys``; ``threads`` transfer threads). Returns the
    figures as JSON-ready dicts."""
    say = progress or (lambda message: None)
    model = latency_model(latency)
    if cold_restore:
        unknown = sorted(set(backends) - set(COLD_RESTORE_BACKENDS))
        if unknown or not backends:
            raise ValueError(f"unknown backends {unknown or list(backends)}; known: "
                             f"{list(COLD_RESTORE_BACKENDS)}")
        if keys < 2 or cold_restore_batches < 1 or load_batch_keys < 1 or threads < 1:
            raise ValueError("the cold restore needs at least 2 keys, 1 batch, loading batches "
                             "of at least 1 key and at least 1 transfer thread")
        load = os.getloadavg()[0]
        with LocalS3() as server, \
                tempfile.TemporaryDirectory(prefix="keyedstate-bench-remote-") as work:
            store = behind(f"s3://{server.bucket}", server.options, model,
                           os.path.join(work, "requests"))
            results = run_cold_restore(store, work, keys, cold_restore_batches, distinct_keys,
                                       load_batch_keys, threads, backends, say)
        return {
            "benchmark": "remote --cold-restore",
            "machine": machine(),
            "load_average_1m_before": round(load, 2),
            "store": _describe(model),
            "latency": model.parameters() if model is not None else None,
            "cold_restore": results,
        }
    big_keys = keys if big_keys is None else big_keys
    with LocalS3() as server, \
            tempfile.TemporaryDirectory(prefix="keyedstate-bench-remote-") as work:
        s3 = behind(f"s3://{server.bucket}", server.options, model)
        results = []
        for compaction in ("universal", "level"):
            say(f"incremental checkpoints, {compaction} compaction")
            results.append(incremental(s3, work, keys, batches, fraction, compaction))
        big = large(s3, work, big_keys, value_bytes, say)
    universal = results[0]
    return {
        "benchmark": "remote",
        "machine": machine(),
        "store": _describe(model),
        "latency": model.parameters() if model is not None else None,
        "goal": (f"uploaded <= {GOAL_UPLOAD_RATIO:g}x changed data over {batches} batches of "
                 f"{fraction:.0%} changed keys; savepoint and NO_CLAIM duplication of a >= 1 GiB "
                 f"state with < {GOAL_THROUGH_FRACTION:.0%} of it through the job's processes"),
        "incremental": results,
        "large": big,
        "goal_met": bool(universal["goal_met"] and big["goal_met"]),
    }


def _describe(model: LatencyModel | None) -> str:
    return "moto server on loopback, via s3fs" + (
        f", behind {model.name} ({model.first_byte_ms:g} ms per request"
        + (f", {model.mb_per_s:g} MB/s per stream)" if model.mb_per_s else ")")
        if model is not None else "")


def plot(result: dict[str, Any], path: str) -> None:
    """Per-batch uploaded vs changed bytes (both compactions), and the large-state phases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {"universal": "#1f77b4", "level": "#ff7f0e"}
    for run_ in result["incremental"]:
        batches = run_["per_batch"]
        left.plot([b["uploaded_bytes"] / 2**20 for b in batches], color=colors[run_["compaction"]],
                  label=f"uploaded, {run_['compaction']} compaction "
                        f"({run_['uploaded_over_changed']:.2f}x changed)")
    changed = result["incremental"][0]["per_batch"]
    left.plot([b["changed_bytes"] / 2**20 for b in changed], color="#2ca02c", linestyle="--",
              label="changed data")
    left.plot([GOAL_UPLOAD_RATIO * b["changed_bytes"] / 2**20 for b in changed], color="#d62728",
              linestyle=":", label=f"goal: {GOAL_UPLOAD_RATIO:g}x changed (amortized)")
    left.set_yscale("log")
    left.set_xlabel("batch (1% of keys changed)")
    left.set_ylabel("MiB per checkpoint (log)")
    left.set_title(f"{result['incremental'][0]['keys']:,} keys on S3 (moto)")
    left.legend(fontsize=8)
    big = result["large"]
    new, warm = big["restore_new_executor"], big["restore_warm_cache"]
    phases = [  # (name, downloaded, uploaded, duplicated by the store)
        ("checkpoint\n(the one upload)", 0, big["checkpoint"]["uploaded_bytes"], 0),
        ("native\nsavepoint", 0, big["savepoint"]["through_process_bytes"],
         big["savepoint"]["duplicated_bytes"]),
        ("NO_CLAIM restore,\nnew executor", new["restore_downloaded_bytes"],
         new["first_checkpoint"]["uploaded_bytes"],
         new["first_checkpoint"]["duplicated_bytes"]),
        ("NO_CLAIM restore,\nwarm cache", warm["restore_downloaded_bytes"],
         warm["first_checkpoint"]["uploaded_bytes"],
         warm["first_checkpoint"]["duplicated_bytes"]),
    ]
    xs = list(range(len(phases)))
    mib = 2**20
    right.bar([x - 0.2 for x in xs], [p[1] / mib for p in phases], width=0.4,
              color="#9ecae1", label="downloaded by the job (restore)")
    right.bar([x - 0.2 for x in xs], [p[2] / mib for p in phases], width=0.4,
              bottom=[p[1] / mib for p in phases], color="#1f77b4",
              label="uploaded by the job")
    right.bar([x + 0.2 for x in xs], [p[3] / mib for p in phases], width=0.4,
              color="#b0b0b0", label="duplicated by the store (server-side)")
    for x, p in zip(xs, phases):
        right.annotate(f"{(p[1] + p[2]) / big['state_bytes']:.2%}", (x - 0.2, (p[1] + p[2]) / mib),
                       ha="center", va="bottom", fontsize=8)
    right.set_xticks(xs, [p[0] for p in phases], fontsize=8)
    right.set_ylabel("MiB (label: through the job's processes, of the state)")
    right.set_title(f"{big['state_bytes'] / 2**30:.2f} GiB state: bytes moved")
    right.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"keyedstate bench remote ({m['date']}, {m['cpus']} CPUs)", fontsize=10)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="keyedstate bench remote, with a plot")
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--latency", default="none",
                        help="the server's latency model: none, s3-standard-same-region or "
                             "figures such as ms=30,mb_per_s=90 (default: %(default)s)")
    parser.add_argument("--cold-restore", action="store_true",
                        help="measure only a restore on a worker without a copy (both "
                             "backends, --keys keys)")
    parser.add_argument("--cold-restore-batches", type=int, default=10,
                        help="measured batches before the cold restore (default: %(default)s)")
    parser.add_argument("--distinct-keys", type=int, default=None,
                        help="keys per measured batch (default: 50,000 or half the keys)")
    parser.add_argument("--load-batch-keys", type=int, default=1_000_000)
    parser.add_argument("--threads", type=int, default=4,
                        help="transfer threads (default: %(default)s, as "
                             "state.backend.rocksdb.checkpoint.transfer.thread.num)")
    parser.add_argument("--backends", default=",".join(COLD_RESTORE_BACKENDS))
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--plot", default=None, help="write the PNG here")
    args = parser.parse_args()
    figures = run(keys=args.keys, batches=args.batches, latency=args.latency,
                  cold_restore=args.cold_restore,
                  cold_restore_batches=args.cold_restore_batches,
                  distinct_keys=args.distinct_keys, load_batch_keys=args.load_batch_keys,
                  threads=args.threads,
                  backends=[b.strip() for b in args.backends.split(",") if b.strip()],
                  progress=lambda message: print(message, file=sys.stderr, flush=True))
    text = json.dumps(figures, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.plot and not args.cold_restore:
        plot(figures, args.plot)
    print(text)
