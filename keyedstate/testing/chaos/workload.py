"""The soak's workload: its input, its keyed function, and the faults it injects in executors.

**Input** (:func:`write_input`): one Parquet file per micro-batch, ``key, seq, ts, value``;
skewed keys (a few hot ones, many that come back rarely, so TTL and timers matter), event times
that advance by :data:`BATCH_SPAN_MS` per batch, and a few rows that are late on purpose.

**The function** (:class:`ChaosFunction`) uses every state kind, TTL on three of them
(``OnCreateAndWrite`` and ``OnReadAndWrite``) and both timer kinds; its output is a pure
function of the input, which :mod:`keyedstate.testing.chaos.oracle` recomputes with pandas.

**A logical clock.** TTL and processing-time timers run on wall-clock time, which no oracle
can replay after random kills. In ``open`` the function therefore sets its backend's TTL clock
and the context's processing time to :func:`logical_now` of the batch (batch ``b`` is
``LOGICAL_EPOCH_MS + b * LOGICAL_STEP_MS``, in the year 2100). Everything then follows from
the batch id: an entry written in batch ``b`` with a TTL of 2.5 steps is visible in ``b + 2``
and expired in ``b + 3``; a processing-time timer set at ``now + 2`` steps fires at the start
of batch ``b + 2``. Wall-clock readers (the state processor API) see nothing expired, so the
oracle compares TTL timestamps itself.

**Executor faults** (planned by :mod:`keyedstate.testing.chaos.plan`, read from the run's
``plan.json``): SIGKILL of the Python worker, of the executor JVM or of the driver, either
mid-batch (after the first key's state changed) or mid-upload (after writing half of a
snapshot file: a torn upload); and a subtask that fails every attempt (an aborted checkpoint).
Each fault fires once: a marker file is created (``O_EXCL``) just before it fires.

**Faults of the asynchronous phase** (``async`` faults at ``upload-error``, ``ack-error``,
``kill-worker-uploading``): armed when the planned subtask of the planned batch opens, they
target the next snapshot that subtask hands to its process's uploader
(:mod:`keyedstate.runtime.uploads`), and fire in the uploader while it uploads that snapshot:
a :class:`~keyedstate.errors.TransientStorageError` on every file of the snapshot (the upload
fails, its acknowledgement says so) or on writing the acknowledgement (none is written), or a
torn write of the snapshot's first file and SIGKILL of the worker (no acknowledgement, ever).
A snapshot that writes no file moves a file fault on to the subtask's next snapshot.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from dataclasses import dataclass, replace
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from keyedstate.errors import TransientStorageError
from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
)
from keyedstate.state.evolution import SchemaEvolution
from keyedstate.state.timers import TimeDomain
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import ACKS_DIR, ack_file, is_snapshot_file

# -- time ------------------------------------------------------------------------------------

#: Logical time of batch 0 (2100-01-01): far ahead of the wall clock, so that a reader using
#: the wall clock never finds a logically live entry expired.
LOGICAL_EPOCH_MS = 4_102_444_800_000
LOGICAL_STEP_MS = 1_000
#: Event time of batch 0's first row; every batch spans BATCH_SPAN_MS of event time.
EVENT_EPOCH_MS = 1_700_000_000_000
BATCH_SPAN_MS = 10_000
WATERMARK_DELAY_MS = 2_000
#: An event-time timer fires this long after the key's last event of a batch.
EVENT_TIMER_GAP_MS = 15_000
#: A processing-time timer fires this many batches after it is set.
PROC_TIMER_STEPS = 2
#: A count crossing a multiple of this sets a processing-time timer.
PROC_TIMER_EVERY = 7

TTL_LAST_SEEN_MS = 2_500      # value state, OnCreateAndWrite
TTL_RECENT_MS = 4_500         # list state (per element), OnCreateAndWrite
TTL_TOUCHED_MS = 2_500        # map state (per entry), OnReadAndWrite
RECENT_MAX, RECENT_KEEP = 6, 4
BUCKETS = 5


def logical_now(batch_id: int) -> int:
    """The logical time (ms) of batch ``batch_id``: its TTL clock and processing time."""
    return LOGICAL_EPOCH_MS + batch_id * LOGICAL_STEP_MS


class LogicalClock:
    """A TTL time provider fixed at one batch's logical time (pickles)."""

    def __init__(self, now_ms: int) -> None:
        self._now = now_ms

    def now_ms(self) -> int:
        return self._now


# -- input -----------------------------------------------------------------------------------

INPUT_DDL = "key string, seq bigint, ts timestamp, value bigint"
INPUT_SCHEMA = pa.schema([("key", pa.string()), ("seq", pa.int64()),
                          ("ts", pa.timestamp("us", tz="UTC")), ("value", pa.int64())])
OUTPUT_DDL = ("key string, batch_id bigint, kind string, ts bigint, count bigint, total bigint, "
              "n bigint, lo bigint, hi bigint, recent string, buckets string, "
              "prev_seen bigint, touched string")
#: Modification time of input file 0 (the file source takes files in mtime order).
_MTIME_BASE = 1_600_000_000


def input_file_name(batch_id: int) -> str:
    return f"part-{batch_id:05d}.parquet"


#: the names :func:`input_file_name` gives (what :func:`publish_input` may withdraw)
_INPUT_FILE = re.compile(r"part-\d{5}\.parquet")


def generate_batch(seed: int, batch_id: int, rows: int, keys: int) -> pa.Table:
    """The rows of one batch; a pure function of its arguments."""
    rng = random.Random(f"{seed}/{batch_id}")
    hot = max(1, keys // 50)
    out_keys, seqs, ts, values = [], [], [], []
    start = EVENT_EPOCH_MS + batch_id * BATCH_SPAN_MS
    for i in range(rows):
        k = rng.randrange(hot) if rng.random() < 0.25 else rng.randrange(keys)
        out_keys.append(f"k{k:05d}")
        seqs.append(batch_id * rows + i)
        if batch_id >= 3 and rng.random() < 0.03:  # late on purpose
            ts.append((start - 3 * BATCH_SPAN_MS + rng.randrange(BATCH_SPAN_MS)) * 1000)
        else:
            ts.append((start + rng.randrange(BATCH_SPAN_MS)) * 1000)
        values.append(rng.randrange(1000))
    return pa.table({"key": out_keys, "seq": seqs,
                     "ts": pa.array(ts, pa.timestamp("us", tz="UTC")), "value": values},
                    schema=INPUT_SCHEMA)


def write_input(directory: str, seed: int, batches: int, rows: int, keys: int) -> None:
    """Every batch's file under ``directory`` (not yet visible to the job: see
    :func:`publish_input`)."""
    os.makedirs(directory, exist_ok=True)
    for b in range(batches):
        path = os.path.join(directory, input_file_name(b))
        if not os.path.exists(path):
            tmp = path + ".tmp"
            pq.write_table(generate_batch(seed, b, rows, keys), tmp)
            os.replace(tmp, path)


def publish_input(generated: str, input_dir: str, up_to_batch: int) -> None:
    """Make exactly files ``0..up_to_batch`` visible to the file source, in batch order
    (idempotent). With ``maxFilesPerTrigger=1`` batch ``b`` is file ``b``.

    Files past ``up_to_batch`` are withdrawn: a rollback reads its parent's files again, and
    the parent published them up to its own end, past a segment of the rollback that ends
    earlier (a same-session restart with a changed definition); left visible, the segment's
    query would read them under the segment's definition instead of the next one's. A query
    that read them before has ended (queries of the soak run one at a time), and the next
    segment publishes them again."""
    os.makedirs(input_dir, exist_ok=True)
    visible = {input_file_name(b) for b in range(up_to_batch + 1)}
    for name in os.listdir(input_dir):
        if _INPUT_FILE.fullmatch(name) and name not in visible:
            os.remove(os.path.join(input_dir, name))
    for b in range(up_to_batch + 1):
        name = input_file_name(b)
        target = os.path.join(input_dir, name)
        if os.path.exists(target):
            continue
        tmp = os.path.join(input_dir, "." + name + ".tmp")  # hidden: the source skips it
        with open(os.path.join(generated, name), "rb") as src, open(tmp, "wb") as dst:
            dst.write(src.read())
        os.utime(tmp, (_MTIME_BASE + b, _MTIME_BASE + b))
        os.replace(tmp, target)


# -- the function ----------------------------------------------------------------------------

def _sum(a: int, b: int) -> int:
    return a + b


class MinMaxCount:
    """An aggregate function: count, min and max of the values added."""

    def create_accumulator(self) -> dict[str, int]:
        return {"n": 0, "lo": 1 << 62, "hi": -(1 << 62)}

    def add(self, value: int, acc: dict[str, int]) -> dict[str, int]:
        return {"n": acc["n"] + 1, "lo": min(acc["lo"], value), "hi": max(acc["hi"], value)}

    def get_result(self, acc: dict[str, int]) -> dict[str, int]:
        return acc


class MinMaxLast(MinMaxCount):
    """The evolved aggregate function: also the last value added (``last``)."""

    def create_accumulator(self) -> dict[str, int]:
        return {**super().create_accumulator(), "last": STATS_LAST_DEFAULT}

    def add(self, value: int, acc: dict[str, int]) -> dict[str, int]:
        return {**super().add(value, acc), "last": value}


def _ttl(ms: int, update: TtlUpdateType = TtlUpdateType.ON_CREATE_AND_WRITE) -> StateTtlConfig:
    import datetime as dt

    return StateTtlConfig(dt.timedelta(milliseconds=ms), update_type=update)


def _js(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


# -- definitions: what a same-session restart changes -------------------------------------

#: The n-th change of the function's definition (1-based) a same-session restart makes: first
#: the ``stats`` accumulator gains a field (``last``, the last value added; restored entries
#: get :data:`STATS_LAST_DEFAULT` through ``SchemaEvolution`` defaults), then TTL of
#: ``last_seen`` switched (off, on, off, ...) and ``buckets`` dropped (``drop_states``) and
#: declared again (empty), in turn. The definitions stay changed for every later job.
CHANGES = ("evolve-stats", "switch-ttl", "toggle-buckets")
STATS_LAST_DEFAULT = -1


def definition_change(n: int) -> str:
    """The change that makes definition ``n`` out of definition ``n - 1`` (``n >= 1``)."""
    if n < 1:
        raise ValueError(f"definition {n} is made by no change")
    return CHANGES[0] if n == 1 else CHANGES[1] if n % 2 == 0 else CHANGES[2]


@dataclass(frozen=True)
class Definition:
    """What definition ``number`` (0: the original; each same-session restart with a changed
    definition adds one) declares: the evolved ``stats``, TTL on ``last_seen``, ``buckets``."""

    number: int = 0
    evolved: bool = False
    last_seen_ttl: bool = True
    buckets: bool = True

    @classmethod
    def of(cls, number: int) -> Definition:
        d = cls()
        for n in range(1, number + 1):
            change = definition_change(n)
            if change == "evolve-stats":
                d = replace(d, evolved=True)
            elif change == "switch-ttl":
                d = replace(d, last_seen_ttl=not d.last_seen_ttl)
            else:
                d = replace(d, buckets=not d.buckets)
        return replace(d, number=number)

    def drop_states(self) -> tuple[str, ...]:
        """``JobConfig.drop_states`` of a job of this definition."""
        return () if self.buckets else ("buckets",)


class ChaosFunction(KeyedProcessFunction):
    """Every state kind, TTL and both timer kinds (semantics in :mod:`keyedstate.testing.chaos.oracle`).

    ``run_dir`` holds ``plan.json`` (the executor faults) and ``markers/``; ``None`` injects
    nothing (tests, drills)."""

    count = ValueStateDescriptor("count", "bigint", default=0)
    last_seen = ValueStateDescriptor("last_seen", "bigint", ttl=_ttl(TTL_LAST_SEEN_MS))
    etimer = ValueStateDescriptor("etimer", "bigint")
    recent = ListStateDescriptor("recent", "bigint", ttl=_ttl(TTL_RECENT_MS))
    buckets = MapStateDescriptor("buckets", "bigint", "bigint")
    touched = MapStateDescriptor("touched", "string", "bigint",
                                 ttl=_ttl(TTL_TOUCHED_MS, TtlUpdateType.ON_READ_AND_WRITE))
    total = ReducingStateDescriptor("total", _sum, "bigint")
    stats = AggregatingStateDescriptor("stats", MinMaxCount(), "n bigint, lo bigint, hi bigint")
    #: the changed definitions' descriptors (:class:`Definition`)
    stats_evolved = AggregatingStateDescriptor(
        "stats", MinMaxLast(), "n bigint, lo bigint, hi bigint, last bigint",
        evolution=SchemaEvolution(defaults={"last": STATS_LAST_DEFAULT}))
    last_seen_no_ttl = ValueStateDescriptor("last_seen", "bigint")

    #: name -> descriptor, as the oracle and the drills see them
    DESCRIPTORS = ("count", "last_seen", "etimer", "recent", "buckets", "touched", "total",
                   "stats")

    def __init__(self, run_dir: str | None = None, definition: int = 0) -> None:
        self.run_dir = run_dir
        self.definition = definition

    def descriptors(self) -> dict[str, Any]:
        """The states definition :attr:`definition` declares, by name."""
        d = Definition.of(self.definition)
        out = {name: getattr(self, name) for name in self.DESCRIPTORS}
        if d.evolved:
            out["stats"] = self.stats_evolved
        if not d.last_seen_ttl:
            out["last_seen"] = self.last_seen_no_ttl
        if not d.buckets:
            del out["buckets"]
        return out

    def open(self, ctx: Context) -> None:
        # The logical clock (module docstring): TTL and processing time follow the batch id.
        clock = LogicalClock(logical_now(ctx.batch_id))
        ctx.backend.time_provider = clock
        ctx.processing_time = clock.now_ms()
        # Any: each name is a different state kind (ValueState, ListState, ...).
        self.s: dict[str, Any] = {name: ctx.get_state(descriptor)
                                  for name, descriptor in self.descriptors().items()}
        self._fault: dict[str, Any] | None = None
        if self.run_dir:
            self._fault = _arm(self.run_dir, ctx)
        else:
            _suspend()

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> Iterable[dict[str, Any]]:
        s = self.s
        rows = rows.sort_by("seq")
        values = rows.column("value").to_pylist()
        now = ctx.processing_time
        prev_seen = s["last_seen"].value()
        s["last_seen"].update(ctx.batch_id)
        before = s["count"].value()
        count = before + len(values)
        s["count"].update(count)
        buckets = s.get("buckets")  # None: dropped by this definition
        for v in values:
            s["total"].add(v)
            s["stats"].add(v)
            if buckets is None:
                continue
            bucket = v % BUCKETS
            if v % 11 == 0:
                buckets.remove(bucket)
            else:
                buckets.put(bucket, (buckets.get(bucket) or 0) + v)
        live = s["recent"].get()
        if len(live) + len(values) > RECENT_MAX:
            s["recent"].update((live + values)[-RECENT_KEEP:])
        else:
            s["recent"].add_all(values)
        seen = []
        for v in values:
            name = f"t{v % 3}"
            current = s["touched"].get(name)
            seen.append(-1 if current is None else current)
            if v % 2 == 0:
                s["touched"].put(name, (current or 0) + 1)
        # Event time: one timer per key, at its latest event + gap (the old one deleted).
        latest = max(int(t.timestamp() * 1000) for t in rows.column("ts").to_pylist())
        due = latest + EVENT_TIMER_GAP_MS
        old = s["etimer"].value()
        if old is None or due > old:
            if old is not None:
                ctx.timer_service.delete_event_time_timer(old)
            ctx.timer_service.register_event_time_timer(due)
            s["etimer"].update(due)
        if before // PROC_TIMER_EVERY != count // PROC_TIMER_EVERY:
            ctx.timer_service.register_processing_time_timer(now + PROC_TIMER_STEPS * LOGICAL_STEP_MS)
        acc = s["stats"].get()
        out = {"key": key, "batch_id": ctx.batch_id, "kind": "row", "ts": None, "count": count,
               "total": s["total"].get(), "n": acc["n"], "lo": acc["lo"], "hi": acc["hi"],
               "recent": _js(s["recent"].get()),
               "buckets": _js(sorted(buckets.items()) if buckets is not None else []),
               "prev_seen": prev_seen, "touched": _js(seen)}
        if self._fault is not None:
            fault, self._fault = self._fault, None
            _fire(fault)  # mid-batch: this key's state has changed
        return [out]

    def on_timer(self, timestamp: int, ctx: Context) -> Iterable[dict[str, Any]]:
        s = self.s
        if ctx.time_domain is TimeDomain.PROCESSING_TIME:
            return [_timer_row(ctx, "ptimer", timestamp, s["count"].value(), s["total"].get())]
        s["etimer"].clear()
        return [_timer_row(ctx, "etimer", timestamp, s["count"].value(), None)]

    def close(self) -> None:
        if self._fault is not None:
            fault, self._fault = self._fault, None
            _fire(fault)  # a subtask without rows: still mid-batch


#: The second job writing into the soak's output path (:mod:`keyedstate.testing.chaos.driver`) tags its
#: rows in a column of its own; the soak's rows have no such column.
SECOND_JOB_COLUMN, SECOND_JOB_TAG = "job", "second"
SECOND_OUTPUT_DDL = f"{OUTPUT_DDL}, {SECOND_JOB_COLUMN} string"


class SecondJobFunction(ChaosFunction):
    """The soak's function for the second job: no faults, every row tagged
    (:data:`SECOND_JOB_COLUMN`), so that a reader of the shared path tells the jobs apart."""

    def __init__(self) -> None:
        super().__init__(None)

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> Iterable[dict[str, Any]]:
        return [{**r, SECOND_JOB_COLUMN: SECOND_JOB_TAG}
                for r in super().process_key(key, rows, ctx)]

    def on_timer(self, timestamp: int, ctx: Context) -> Iterable[dict[str, Any]]:
        return [{**r, SECOND_JOB_COLUMN: SECOND_JOB_TAG} for r in super().on_timer(timestamp, ctx)]


def _timer_row(ctx: Context, kind: str, timestamp: int, count: int, total: int | None
               ) -> dict[str, Any]:
    return {"key": ctx.current_key, "batch_id": ctx.batch_id, "kind": kind, "ts": timestamp,
            "count": count, "total": total, "n": None, "lo": None, "hi": None, "recent": None,
            "buckets": None, "prev_seen": None, "touched": None}


# -- executor-side faults --------------------------------------------------------------------

MARKERS_DIR = "markers"
PLAN_FILE = "plan.json"
DRIVER_PID_FILE = "driver.pid"
INJECTED = "chaos: injected"

_plan_cache: dict[str, tuple[float, dict[str, Any]]] = {}
#: the fault armed for this worker's current task (upload faults fire from the storage hook)
_armed: dict[str, Any] | None = None
_current_batch = -1
_suspended = False
_hooked = False
#: ``async`` faults armed for a subtask (by index) in this worker: the next snapshot it hands
#: to the uploader is their target
_async_armed: dict[int, dict[str, Any]] = {}
#: ``async`` file faults whose target wrote no file: the subtask's next snapshot, by
#: (job, subtask index)
_async_carried: dict[tuple[str, int], dict[str, Any]] = {}
#: the ``async`` fault of the upload the uploader runs now (one at a time, first in first
#: out; the transfer pool's threads write its files, so not thread-local) and whether it fired
_uploading: dict[str, Any] = {}


def _plan(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, PLAN_FILE)
    mtime = os.path.getmtime(path)
    cached = _plan_cache.get(path)
    if cached is None or cached[0] != mtime:
        with open(path) as f:
            cached = (mtime, json.load(f))
        _plan_cache[path] = cached
    return cached[1]


def marker_path(run_dir: str, fault_id: str) -> str:
    return os.path.join(run_dir, MARKERS_DIR, f"{fault_id}.json")


def claim_marker(run_dir: str, fault_id: str, **info: Any) -> bool:
    """Create the fault's marker (exclusively, durably); False if it fired before."""
    path = marker_path(run_dir, fault_id)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"fault": fault_id, "time": time.time(), "pid": os.getpid(), **info}, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _arm(run_dir: str, ctx: Context) -> dict[str, Any] | None:
    """The executor fault planned for this batch and subtask, if it has not fired yet."""
    global _armed, _current_batch, _suspended
    _current_batch, _suspended = ctx.batch_id, False
    if _armed is not None and os.path.exists(marker_path(run_dir, _armed["id"])):
        _armed = None
    # An armed upload fault stays armed until an upload fires it: a snapshot without a new
    # stored file (nothing changed, or every file inlined into _metadata) has none.
    _async_armed.pop(ctx.subtask_index, None)  # a synchronous task hands over no snapshot
    for fault in _plan(run_dir).get("executor_faults", []):
        if fault["batch"] != ctx.batch_id or fault["subtask"] % ctx.parallelism != ctx.subtask_index:
            continue
        if fault["kind"] == "async":
            if not os.path.exists(marker_path(run_dir, fault["id"])):
                _install_upload_hook()
                _async_armed[ctx.subtask_index] = {**fault, "run_dir": run_dir,
                                                   "armed_batch": ctx.batch_id}
            continue
        if fault["kind"] == "abort":
            # Fails every attempt until the driver marks the abort handled.
            if not os.path.exists(marker_path(run_dir, fault["id"] + "-handled")):
                claim_marker(run_dir, fault["id"], kind="abort", at="task-fails",
                             batch=ctx.batch_id)
                raise RuntimeError(f"{INJECTED} failure of subtask {ctx.subtask_index} in batch "
                                   f"{ctx.batch_id} (fault {fault['id']})")
            continue
        if os.path.exists(marker_path(run_dir, fault["id"])):
            continue
        armed = {**fault, "run_dir": run_dir, "uploads": 0}
        if fault["at"] == "upload":
            _install_upload_hook()
            _armed = armed
            return None
        return armed
    return None


def _suspend() -> None:
    """No fault in this task (a drill's, or a test's): an armed upload fault waits."""
    global _suspended
    _suspended = True


def _fire(fault: dict[str, Any], torn: tuple[CheckpointStorage, str, bytes] | None = None) -> None:
    """Fire ``fault`` once: marker first, then the torn write, then SIGKILL."""
    run_dir = fault["run_dir"]
    target = _target_pid(fault["kind"], run_dir)
    if target is None or not claim_marker(run_dir, fault["id"], kind=fault["kind"],
                                          at=fault["at"], batch=_current_batch,
                                          planned_batch=fault["batch"]):
        return
    if torn is not None:
        storage, relative, data = torn
        storage.fs.makedirs(storage.path(relative).rsplit("/", 1)[0], exist_ok=True)
        storage.fs.pipe_file(storage.path(relative), data[: len(data) // 2])
    os.kill(target, signal.SIGKILL)
    if fault["kind"] == "kill_executor":
        os.kill(os.getpid(), signal.SIGKILL)  # the worker goes with its executor
    # kill_driver: the task carries on, as a task whose driver died does (zombie writes)


def _target_pid(kind: str, run_dir: str) -> int | None:
    if kind == "kill_worker":
        return os.getpid()
    if kind == "kill_executor":
        return executor_jvm_pid()
    if kind == "kill_driver":
        try:
            with open(os.path.join(run_dir, DRIVER_PID_FILE)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None
    raise ValueError(f"unknown executor fault kind {kind!r}")


def executor_jvm_pid() -> int | None:
    """The executor JVM above this Python worker (worker -> pyspark daemon -> JVM), or None
    when there is none (``local[*]`` runs tasks in the driver JVM: never kill that)."""
    pid = os.getpid()
    for _ in range(5):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"CoarseGrainedExecutorBackend" in f.read():
                    return pid
        except (OSError, ValueError):
            return None
    return None


def _install_upload_hook() -> None:
    """Wrap this worker's :class:`CheckpointStorage` writes so that an armed upload fault
    fires on the snapshot's first or second file (the plan says which)."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    upload, write = CheckpointStorage.upload, CheckpointStorage.write
    _install_uploader_hooks()

    def maybe_fire(storage: CheckpointStorage, relative: str, data: Any) -> None:
        _async_fault(storage, relative, data)
        fault = _armed
        if fault is None or _suspended or not is_snapshot_file(relative):
            return
        fault["uploads"] += 1
        if fault["uploads"] > fault.get("upload_index", 0):
            payload = data() if callable(data) else data
            _fire(fault, (storage, relative, payload))

    def hooked_upload(self: CheckpointStorage, local_path: str, relative: str) -> Any:
        def read() -> bytes:
            with open(local_path, "rb") as f:
                return f.read()
        maybe_fire(self, relative, read)
        return upload(self, local_path, relative)

    def hooked_write(self: CheckpointStorage, relative: str, data: bytes) -> Any:
        maybe_fire(self, relative, data)
        return write(self, relative, data)

    CheckpointStorage.upload = hooked_upload  # type: ignore[method-assign]
    CheckpointStorage.write = hooked_write  # type: ignore[method-assign]


def _install_uploader_hooks() -> None:
    """Wrap this worker's uploader (:mod:`keyedstate.runtime.uploads`): a snapshot handed
    over by a subtask with an armed ``async`` fault becomes its target
    (:class:`_FaultedSnapshot`)."""
    from keyedstate.runtime import uploads

    add = uploads._Uploader.add

    def hooked_add(self: Any, upload: Any) -> None:
        fault = _async_armed.pop(upload.index, None) or _async_carried.pop(
            (upload.job_id, upload.index), None)
        if fault is not None and not _suspended and upload.result is not None:
            upload.result = _FaultedSnapshot(upload.result, fault, upload)
        add(self, upload)

    uploads._Uploader.add = hooked_add  # type: ignore[method-assign]


class _FaultedSnapshot:
    """A snapshot handed to the uploader with an ``async`` fault: while the uploader
    materializes it (and, for ``ack-error``, until it writes the acknowledgement),
    :func:`_async_fault` sees the fault. A file fault that found no file to fire on moves on
    to the subtask's next snapshot."""

    def __init__(self, result: Any, fault: dict[str, Any], upload: Any) -> None:
        self._result, self._fault, self._upload = result, fault, upload

    def materialize(self) -> Any:
        fault, upload = self._fault, self._upload
        _uploading.update(fault=fault, fired=False, checkpoint_id=upload.checkpoint_id,
                          index=upload.index)
        try:
            return self._result.materialize()
        finally:
            if fault["at"] != "ack-error":  # the acknowledgement's is cleared as it fires
                fired = _uploading.get("fired")
                _uploading.clear()
                if not fired and not os.path.exists(marker_path(fault["run_dir"], fault["id"])):
                    _async_carried[(upload.job_id, upload.index)] = fault


def _async_fault(storage: CheckpointStorage, relative: str, data: Any) -> None:
    """Fire the ``async`` fault of the upload running now, if ``relative`` is where it
    fires: a snapshot file (``upload-error``: on each of them; ``kill-worker-uploading``: the
    first, torn), or the subtask's acknowledgement (``ack-error``)."""
    fault = _uploading.get("fault")
    if fault is None:
        return
    at = fault["at"]
    if at == "ack-error":
        if relative != ack_file(_uploading["checkpoint_id"], _uploading["index"]):
            return
    elif not is_snapshot_file(relative) or f"/{ACKS_DIR}/" in relative:
        return
    run_dir = fault["run_dir"]
    info = {"at": at, "batch": _current_batch, "planned_batch": fault["batch"],
            "checkpoint_id": _uploading.get("checkpoint_id"), "subtask": _uploading.get("index")}
    if at == "kill-worker-uploading":
        if not _uploading.get("fired"):
            _uploading["fired"] = True
            payload = data() if callable(data) else data
            _fire({**fault, "kind": "kill_worker", "at": at}, (storage, relative, payload))
        return
    if at == "ack-error":
        _uploading.clear()  # the acknowledgement is written once
    if not _uploading.get("fired"):
        if not claim_marker(run_dir, fault["id"], kind="storage", **info):
            return
        if _uploading:
            _uploading["fired"] = True
    raise TransientStorageError(
        f"{INJECTED} transient storage error at {at} of checkpoint {info['checkpoint_id']} "
        f"(batch {fault['batch']}), writing {relative} (fault {fault['id']})")
