"""A scale model of a rescale: ``keyedstate bench scale-model`` (docs/rescaling.md).

Measures each phase of a rescaling restore, one target subtask at a time, on the backends
directly (no Spark: a Spark job restores its subtasks with exactly these calls, in its
executors), with the checkpoints behind an object store's latency model (``kslatency://``
over a local directory, ``s3-standard-same-region`` by default: 100 ms per request, 90 MB/s
per stream); fits a cost per key and per byte to every phase (:mod:`.scale_fit`) on three
state sizes, checks the fit on a fourth, held-out size, and projects seed 001's job (about a
billion keys in RocksDB, 240 -> 480 subtasks) onto keyedstate on Spark.

**The state.** ``N`` keys (``user-00000000`` ...), one ValueState per key, in one of two
value sizes (so that per key and per byte can be told apart): a ``bigint`` counter, and 96
random (incompressible) bytes. Max parallelism 128, written by :data:`OLD_P` subtasks of a
fresh backend (RocksDB: 8 key-group shards each, each settled by one full compaction, as a
long-running job's instances are) and snapshotted in full to the store.

**A rescale to :data:`NEW_P` subtasks** (a doubling, whose key-group ranges cut the old
shards, so that some instances are clipped): each target subtask is created from all old
handles by a new process's storage object with no file cache (a new executor), then takes its
first checkpoint into the same root (a job's own checkpoint: restored files are referenced,
not copied). Phases, timed in the backend's own restore code (its functions wrapped with a
timer for the run, :class:`PhaseClock`; nothing else changed):

- ``download_s``: every file the restore needs, fetched in parallel (RocksDB: the overlapping
  instances' files and meta files; heap: the chain files of the overlapping old subtasks);
- ``open_s``: RocksDB opening every instance; heap: decoding the key groups' sections;
- ``clip_s``: RocksDB's range deletes of the key groups outside an instance's range (heap: 0,
  it decodes only its key groups);
- ``restore_other_s``: the rest of ``create_keyed_backend`` (planning, column families,
  meta info, the working directory);
- ``checkpoint_s``: the first snapshot's synchronous part (flush, local checkpoint, rolling
  compaction where due);
- ``upload_s``: its asynchronous part (uploads, ``_metadata``-ready handle).

The download and the upload also count their requests and the round trips they wait for one
after another (requests over the storage's transfer threads, rounded up): the model's
per-round-trip term; and the download its parallel streams (``min(requests, threads)``), over
which its bytes are shared (:mod:`.scale_fit`).

Each size, value and backend runs ``repeats`` times (alternating over the targets); each
subtask's figures are the median. Every restore is checked (untimed): all ``N`` keys come
back over the targets. The JSON records the commit and load average (``machine``), the
latency model, per size every subtask's phases, keys, bytes and requests, the fit, the
held-out error and the projection.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence

from keyedstate.backends import load_backend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.heap import restore as heap_restore
from keyedstate.backends.rocksdb import restore as rocks_restore
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.state.descriptors import ValueStateDescriptor
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle
from keyedstate.storage.transfer import TransferOptions
from keyedstate.testing.latency import LatencyModel, process_counts

from . import scale_fit
from .common import behind, latency_model, machine, route, timed, user_keys, workdir

OLD_P, NEW_P, MAX_PARALLELISM = 3, 6, 128
#: the value sizes: a ``bigint`` counter, and 96 random bytes
VALUES = {"bigint": ValueStateDescriptor("count", "bigint"),
          "bytes96": ValueStateDescriptor("blob", "binary")}
BLOB_BYTES = 96
BACKENDS = ("rocksdb", "heap")
#: the held-out size by default; the training sizes are 1/8, 1/4 and 1/2 of it
HELD_OUT_KEYS = 2_000_000
DEFAULT_LATENCY = "s3-standard-same-region"


# --------------------------------------------------------------------------------------------
# timing the backends' own restore steps
# --------------------------------------------------------------------------------------------


class PhaseClock:
    """Seconds spent in named functions of the backends' restore code while active: each is
    replaced by a wrapper that adds its duration to its phase, and put back on exit.
    Restores run their steps in the calling thread (downloads fan out below the timed call),
    so the phases do not overlap."""

    #: (owner, attribute, phase)
    TIMED = ((rocks_restore.RocksDBIncrementalRestoreOperation, "_download", "download_s"),
             (rocks_restore, "open_db", "open_s"),
             (rocks_restore, "clip_db_with_key_group_range", "clip_s"),
             # the heap backend reads every file of its chains in one batch (heap restore)
             (CheckpointStorage, "read_all", "download_s"),
             (heap_restore.HeapRestoreOperation, "_apply_file", "open_s"))

    def __init__(self) -> None:
        self.seconds = {"download_s": 0.0, "open_s": 0.0, "clip_s": 0.0}

    @contextmanager
    def active(self) -> Iterator[PhaseClock]:
        with ExitStack() as stack:
            for owner, name, phase in self.TIMED:
                original = getattr(owner, name)
                setattr(owner, name, self._timed(original, phase))
                stack.callback(setattr, owner, name, original)
            yield self

    def _timed(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        return timed_call


# --------------------------------------------------------------------------------------------
# one size: build, then every target's rescale
# --------------------------------------------------------------------------------------------


def _parameters(index: int, parallelism: int, root: str, handles: Sequence[KeyedStateHandle] = (),
                storage: CheckpointStorage | None = None) -> KeyedStateBackendParameters:
    return KeyedStateBackendParameters(
        subtask_index=index,
        key_group_range=KeyGroupRange.of_operator(MAX_PARALLELISM, parallelism, index),
        max_parallelism=MAX_PARALLELISM, key_serializer=KeySerializer(["string"]),
        restore_handles=handles, storage=storage, local_dir=os.path.join(root, "local"))


def build(backend: str, keys: int, value: str, storage: CheckpointStorage, root: str
          ) -> list[KeyedStateHandle]:
    """``keys`` keys written by :data:`OLD_P` fresh subtasks and snapshotted in full."""
    descriptor = VALUES[value]
    rng = random.Random(keys)
    handles = []
    per_subtask = route(user_keys(keys), KeySerializer(["string"]), OLD_P, MAX_PARALLELISM)
    for i, mine in enumerate(per_subtask):
        with load_backend(backend).create_keyed_backend(_parameters(i, OLD_P, root)) as sub:
            state = sub.get_state(descriptor)
            for n, (key, kg) in enumerate(mine):
                sub.set_current_key(key, kg)
                state.update(n if value == "bigint" else rng.randbytes(BLOB_BYTES))
            # Settle RocksDB (one full compaction per instance), as a long-running job's DB
            # is: a DB loaded in one go holds several sorted runs, and the first checkpoint
            # after any restore would compact one instance (rolling compaction) and upload it,
            # a cost of the loading, not of the rescale (bench remote settles for the same
            # reason).
            for instance in getattr(sub, "instances", ()):
                for cf in instance.cfs.values():
                    cf.compact_range(None, None)
            handles.append(sub.snapshot(1, storage.location(1, i), full=True).materialize())
    return handles


def rescale_subtask(backend: str, value: str, handles: Sequence[KeyedStateHandle], index: int,
                    url: str, options: dict[str, Any], root: str, checkpoint_id: int
                    ) -> dict[str, Any]:
    """Target subtask ``index`` of :data:`NEW_P` restored from ``handles`` by a storage
    object with no file cache, then its first checkpoint: the phases' seconds, the keys it
    restored, the bytes and requests its restore and upload moved."""
    storage = CheckpointStorage(url, options, TransferOptions(cache_bytes=0))
    clock = PhaseClock()
    before = process_counts()
    with clock.active(), timed() as restore:
        sub = load_backend(backend).create_keyed_backend(
            _parameters(index, NEW_P, root, handles, storage))
    restore_requests = process_counts() - before
    # the restore's downloads and the snapshot's uploads both run on the transfer pool, on a
    # local directory too (request_threads is 1 there: it is for the driver's small requests)
    threads = storage.transfer.threads
    downloaded = storage.stats.downloaded_bytes
    with sub:
        with timed() as sync:
            result = sub.snapshot(checkpoint_id, storage.location(checkpoint_id, index))
        before = process_counts()
        with timed() as upload:
            result.materialize()
        upload_requests = process_counts() - before
        restored_keys = sum(1 for _ in sub.iter_entries(VALUES[value].name))  # untimed check
    phases = dict(clock.seconds)
    phases["restore_other_s"] = max(0.0, restore.seconds - sum(phases.values()))
    return {"subtask": index, "keys": restored_keys, "downloaded_bytes": downloaded,
            "uploaded_bytes": storage.stats.uploaded_bytes,
            "duplicated_bytes": storage.stats.duplicated_bytes,
            "restore_s": restore.seconds, **phases, "checkpoint_s": sync.seconds,
            "upload_s": upload.seconds,
            "restore_requests": restore_requests.as_dict() if restore_requests.cells else None,
            "upload_requests": upload_requests.as_dict() if upload_requests.cells else None,
            # both run their requests in one batch over the transfer threads
            "restore_round_trips": -(-restore_requests.requests() // threads),
            "upload_round_trips": -(-upload_requests.requests() // threads),
            # ... on this many streams at once, each at the store's per-stream bandwidth
            "restore_streams": max(1, min(restore_requests.requests(), threads))}


def measure_size(backend: str, keys: int, value: str, model: LatencyModel | None,
                 repeats: int, say: Callable[[str], None]) -> dict[str, Any]:
    """One state size: build it, then rescale it ``repeats`` times; per target subtask the
    medians of its phases (and the figures of its first run)."""
    with workdir("scale-model") as root:
        location = behind(root, {}, model)
        url = location.url("store")
        storage = CheckpointStorage(url, location.options,
                                    TransferOptions(cache_bytes=0))
        say(f"{backend}, {value}, {keys:,} keys: building")
        with timed() as t_build:
            handles = build(backend, keys, value, storage, root)
        runs: list[list[dict[str, Any]]] = [[] for _ in range(NEW_P)]
        for n in range(repeats):
            say(f"{backend}, {value}, {keys:,} keys: rescale {OLD_P} -> {NEW_P} "
                f"({n + 1}/{repeats})")
            targets = range(NEW_P) if n % 2 == 0 else range(NEW_P - 1, -1, -1)
            for i in targets:
                runs[i].append(rescale_subtask(backend, value, handles, i, url,
                                               location.options, root, 2 + n))
            restored = sum(runs[i][-1]["keys"] for i in range(NEW_P))
            if restored != keys:
                raise AssertionError(f"{backend} {value}: the {NEW_P} targets restored "
                                     f"{restored:,} keys of {keys:,}")
    subtasks = []
    for samples in runs:
        median = {p: statistics.median(s[p] for s in samples)
                  for p in (*scale_fit.PHASES, "restore_s")}
        subtasks.append({**samples[0], **median,
                         "samples_total_s": [sum(s[p] for p in scale_fit.PHASES)
                                             for s in samples]})
    return {"backend": backend, "value": value, "keys": keys, "build_s": t_build.seconds,
            "snapshot_bytes": sum(h.full_size for h in handles),
            "bytes_per_key": sum(s["downloaded_bytes"] for s in subtasks) / keys,
            "subtasks": subtasks,
            "sum_s": {p: sum(s[p] for s in subtasks) for p in scale_fit.PHASES}}


# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------


def run(keys: int = HELD_OUT_KEYS, sizes: Sequence[int] | None = None,
        backends: Sequence[str] = BACKENDS, values: Sequence[str] = tuple(VALUES),
        repeats: int = 3, latency: str | LatencyModel | None = DEFAULT_LATENCY,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure ``sizes`` (default: 1/8, 1/4 and 1/2 of ``keys``) and the held-out ``keys`` on
    each backend of ``backends`` and value of ``values``, fit each backend's model on
    ``sizes`` (every value), check it on ``keys``, and project seed 001's job. ``latency``:
    the store's model (None or ``"none"``: a plain local directory)."""
    model = latency_model(latency)
    sizes = sorted(sizes) if sizes is not None else [keys // 8, keys // 4, keys // 2]
    unknown = sorted(set(backends) - set(BACKENDS)) + sorted(set(values) - set(VALUES))
    if unknown:
        raise ValueError(f"unknown backends or values {unknown}; known: {list(BACKENDS)}, "
                         f"{list(VALUES)}")
    if len(sizes) < 2 or min(sizes) < NEW_P or keys <= max(sizes) or repeats < 1:
        raise ValueError(f"need at least two training sizes of at least {NEW_P} keys below "
                         f"the held-out size and repeats >= 1; got sizes {sizes}, keys {keys}, "
                         f"repeats {repeats}")
    say = progress or (lambda msg: None)
    commit, load_at_start = machine()["commit"], [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    results: dict[str, Any] = {}
    for backend in backends:
        measured = [measure_size(backend, n, value, model, repeats, say)
                    for n in (*sizes, keys) for value in values]
        training = [s for m in measured if m["keys"] in sizes for s in m["subtasks"]]
        fitted = scale_fit.fit(training)
        held_out = {m["value"]: scale_fit.held_out_error(fitted, m["subtasks"])
                    for m in measured if m["keys"] == keys}
        bytes_per_key = {m["value"]: m["bytes_per_key"] for m in measured if m["keys"] == keys}
        # 1 KiB values: the larger measured value's bytes per key with the value grown
        bytes_per_key["bytes1024"] = bytes_per_key.get("bytes96", max(bytes_per_key.values())) \
            + 1024 - BLOB_BYTES
        results[backend] = {
            "sizes": measured,
            "fit": {p: f.as_dict() for p, f in fitted.items()},
            "held_out": held_out,
            "held_out_within_goal": all(h["within_goal"] for h in held_out.values()),
            "projection": {value: scale_fit.project(
                fitted, b, backend=backend, upload_round_trips=max(
                    s["upload_round_trips"] for m in measured if m["keys"] == keys
                    for s in m["subtasks"]))
                for value, b in bytes_per_key.items()},
            "projection_bytes_per_key": bytes_per_key,
        }
    return {
        "benchmark": "scale-model",
        "machine": {**machine(), "commit": commit, "load_average_at_start": load_at_start},
        "latency": model.parameters() if model is not None else None,
        "workload": {"training_sizes": list(sizes), "held_out_keys": keys,
                     "backends": list(backends), "values": list(values), "repeats": repeats,
                     "rescale": f"{OLD_P} -> {NEW_P}", "max_parallelism": MAX_PARALLELISM,
                     "model": "seconds = fixed + per_key * keys + per_byte * bytes + "
                              "per_round_trip * round_trips, per phase and target subtask; "
                              "non-negative least squares",
                     "goal": f"held-out size within {scale_fit.GOAL_ERROR:.0%} (sum over the "
                             f"targets and slowest target)"},
        "seed_job": {**scale_fit.SEED_JOB, "max_parallelism": scale_fit.SEED_MAX_PARALLELISM,
                     "goal_s": scale_fit.GOAL_S,
                     "executor_network_bytes_per_s": scale_fit.EXECUTOR_NETWORK_BYTES_PER_S},
        "total_s": time.perf_counter() - started,
        "results": results,
        "held_out_within_goal": all(r["held_out_within_goal"] for r in results.values()),
    }


if __name__ == "__main__":
    # python -m keyedstate_benchmarks.scale_model OUT.json [KEYS]: the whole benchmark.
    figures = run(keys=int(sys.argv[2]) if len(sys.argv) > 2 else HELD_OUT_KEYS,
                  progress=lambda message: print(message, file=sys.stderr, flush=True))
    with open(sys.argv[1], "w") as f:
        json.dump(figures, f, indent=2)
        f.write("\n")
