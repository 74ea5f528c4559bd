"""The soak's oracle: what :class:`~keyedstate.testing.chaos.workload.ChaosFunction` must output and
hold, recomputed with plain pandas and dicts over the input files, sharing no code with
keyedstate (only the workload's constants).

Semantics it encodes (Flink's, as keyedstate documents them):

- batch ``b`` starts with the watermark of batches ``< b`` (max event time - delay) and the
  logical time ``logical_now(b)``; processing-time timers due at that time fire first, then
  event-time timers due at the watermark, each in timestamp order;
- batch ids are Spark's: batch ``b`` reads the input file the plan's schedule names (file
  ``b`` until a drain); a **drain** (``stop --drain``) is a batch of its own that reads no
  file: processing-time timers due at its logical time fire, then every event-time timer (the
  watermark is +infinity for it), and the watermark the next batch starts with is unchanged;
- rows with an event time before the watermark are late: side output, not processed;
- each key's rows are processed in ``seq`` order; TTL entries are live while
  ``last_access + ttl > now``; ``OnReadAndWrite`` refreshes an entry's time when it is read;
- after the batch the watermark moves to ``max(previous, max event time - delay)``;
- **definitions** (``workload.Definition``, per batch from the plan): a batch that runs under
  a newer definition than the state was written with first applies each change, at its
  logical time, as the backends do when a state is first asked for after the restart:
  ``stats`` evolved (restored accumulators get ``last`` = ``STATS_LAST_DEFAULT``, every add
  sets it), TTL of ``last_seen`` switched off (entries expired at that time go, the rest never
  expire) or on (every entry stamped with that time), ``buckets`` dropped (its output is the
  empty map's ``[]``) or declared again (empty);
- **branches** (:func:`run_branches`): a job restored into a new Spark checkpoint location
  (a restore, a rollback) is a new lineage branch; its expected output starts from the
  parent branch's state at the fork batch, then its own batches; the sinks hold each branch
  under its own query id (:mod:`~keyedstate.testing.chaos.compare`).

What the job did is compared with it in :mod:`~keyedstate.testing.chaos.compare`.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keyedstate.testing.chaos.workload import (
    BUCKETS,
    EVENT_TIMER_GAP_MS,
    LOGICAL_STEP_MS,
    PROC_TIMER_EVERY,
    PROC_TIMER_STEPS,
    RECENT_KEEP,
    RECENT_MAX,
    STATS_LAST_DEFAULT,
    TTL_LAST_SEEN_MS,
    TTL_RECENT_MS,
    TTL_TOUCHED_MS,
    WATERMARK_DELAY_MS,
    Definition,
    definition_change,
    input_file_name,
    logical_now,
)

MIN_WATERMARK = -(1 << 63)
OUTPUT_COLUMNS = ["key", "batch_id", "kind", "ts", "count", "total", "n", "lo", "hi", "recent",
                  "buckets", "prev_seen", "touched"]
IDENTITY = ["key", "batch_id", "kind", "ts"]


def _js(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


@dataclass
class KeyState:
    count: int | None = None
    last_seen: tuple[int, int] | None = None          # (value, last access)
    etimer: int | None = None
    recent: list[tuple[int, int]] = field(default_factory=list)   # (value, last access)
    buckets: dict[int, int] = field(default_factory=dict)
    touched: dict[str, tuple[int, int]] = field(default_factory=dict)
    total: int | None = None
    stats: tuple[int, int, int] | None = None
    #: the evolved ``stats``' ``last`` (None before the evolution)
    stats_last: int | None = None


@dataclass
class OracleState:
    """The whole job's state after some batch: per key, plus both timer sets and the
    watermark."""

    batch_id: int = -1
    watermark: int = MIN_WATERMARK
    keys: dict[str, KeyState] = field(default_factory=dict)
    proc_timers: set[tuple[int, str]] = field(default_factory=set)    # (timestamp, key)
    event_timers: set[tuple[int, str]] = field(default_factory=set)
    #: the definition the state was last written with (``workload.Definition``)
    definition: int = 0


def read_batch(generated: str, batch_id: int) -> pd.DataFrame:
    table = pq.read_table(os.path.join(generated, input_file_name(batch_id)))
    ts_ms = pc.divide(table.column("ts").cast(pa.int64()), 1000)
    df = table.drop_columns(["ts"]).to_pandas()
    df["ts_ms"] = ts_ms.to_numpy()
    df["ts_us"] = table.column("ts").cast(pa.int64()).to_numpy()
    return df


class Oracle:
    """Steps the expected job batch by batch (:meth:`step`), from empty state.

    ``schedule``: ``(batch id, input file or None for a drain)`` of every batch
    (:meth:`keyedstate.testing.chaos.plan.Plan.schedule`); without one, batch ``b`` reads file ``b``.
    ``definitions``: batch id -> the definition in force (:meth:`Plan.definitions`; default 0)."""

    def __init__(self, generated: str,
                 schedule: Sequence[tuple[int, int | None]] | None = None,
                 definitions: Mapping[int, int] | None = None) -> None:
        self.generated = generated
        self.state = OracleState()
        self.files: dict[int, int | None] | None = dict(schedule) if schedule is not None \
            else None
        self.definitions = dict(definitions or {})

    def snapshot(self) -> OracleState:
        return copy.deepcopy(self.state)

    def file_of(self, b: int) -> int | None:
        """The input file batch ``b`` reads (None: a drain)."""
        return b if self.files is None else self.files[b]

    def run(self, batches: int | None = None
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Outputs (main rows, late rows) of batches ``0..batches-1`` (default: the whole
        schedule)."""
        if batches is None:
            assert self.files is not None, "run() without a schedule needs a batch count"
            batches = len(self.files)
        main: list[dict[str, Any]] = []
        late: list[dict[str, Any]] = []
        for b in range(batches):
            m, lt = self.step(b)
            main += m
            late += lt
        return main, late

    def step(self, b: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        st = self.state
        assert b == st.batch_id + 1, (b, st.batch_id)
        now = logical_now(b)
        file = self.file_of(b)
        self._redefine(self.definitions.get(b, st.definition), now)
        out: list[dict[str, Any]] = []
        # Timers: processing time first, then event time, each in timestamp order; a drain
        # fires every event-time timer.
        for ts, key in sorted(t for t in st.proc_timers if t[0] <= now):
            st.proc_timers.discard((ts, key))
            ks = st.keys[key]
            out.append(_timer_row(key, b, "ptimer", ts, ks.count or 0, ks.total))
        for ts, key in sorted(t for t in st.event_timers if file is None or t[0] <= st.watermark):
            st.event_timers.discard((ts, key))
            ks = st.keys[key]
            ks.etimer = None
            out.append(_timer_row(key, b, "etimer", ts, ks.count or 0, None))
        if file is None:  # a drain: no input, the watermark stays (nothing moved it)
            st.batch_id = b
            return out, []
        df = read_batch(self.generated, file)
        is_late = df["ts_ms"] < st.watermark
        late = [{"batch_id": b, "seq": int(r.seq), "key": r.key, "ts_us": int(r.ts_us),
                 "value": int(r.value)} for r in df[is_late].itertuples()]
        for key, rows in df[~is_late].sort_values("seq").groupby("key", sort=True):
            out.append(self._process_key(str(key), rows, b, now))
        if len(df):
            st.watermark = max(st.watermark, int(df["ts_ms"].max()) - WATERMARK_DELAY_MS)
        st.batch_id = b
        return out, late

    def _redefine(self, definition: int, now: int) -> None:
        """Apply the changes from the state's definition to ``definition`` at time ``now``."""
        st = self.state
        if definition < st.definition:
            raise ValueError(f"definition {definition} after {st.definition}: definitions "
                             f"only move on")
        for n in range(st.definition + 1, definition + 1):
            change = definition_change(n)
            after = Definition.of(n)
            for ks in st.keys.values():
                if change == "evolve-stats":
                    if ks.stats is not None:
                        ks.stats_last = STATS_LAST_DEFAULT
                elif change == "switch-ttl":
                    if ks.last_seen is None:
                        continue
                    if after.last_seen_ttl:  # switched on: stamped with the restore time
                        ks.last_seen = (ks.last_seen[0], now)
                    elif ks.last_seen[1] + TTL_LAST_SEEN_MS <= now:
                        ks.last_seen = None  # switched off: what had expired goes
                elif not after.buckets:  # dropped
                    ks.buckets = {}
            st.definition = n

    def _process_key(self, key: str, rows: pd.DataFrame, b: int, now: int) -> dict[str, Any]:
        st = self.state
        d = Definition.of(st.definition)
        ks = st.keys.setdefault(key, KeyState())
        values = [int(v) for v in rows["value"]]
        prev_seen = ks.last_seen[0] if ks.last_seen and (
            not d.last_seen_ttl or ks.last_seen[1] + TTL_LAST_SEEN_MS > now) else None
        ks.last_seen = (b, now)
        before = ks.count or 0
        count = before + len(values)
        ks.count = count
        for v in values:
            ks.total = v if ks.total is None else ks.total + v
            n, lo, hi = ks.stats or (0, 1 << 62, -(1 << 62))
            ks.stats = (n + 1, min(lo, v), max(hi, v))
            if d.evolved:
                ks.stats_last = v
            if not d.buckets:
                continue
            bucket = v % BUCKETS
            if v % 11 == 0:
                ks.buckets.pop(bucket, None)
            else:
                ks.buckets[bucket] = ks.buckets.get(bucket, 0) + v
        live = [(v, t) for v, t in ks.recent if t + TTL_RECENT_MS > now]
        if len(live) + len(values) > RECENT_MAX:
            ks.recent = [(v, now) for v in ([v for v, _ in live] + values)[-RECENT_KEEP:]]
        else:
            ks.recent = live + [(v, now) for v in values]
        seen = []
        for v in values:
            name = f"t{v % 3}"
            entry = ks.touched.get(name)
            current = None
            if entry is not None and entry[1] + TTL_TOUCHED_MS > now:
                current = entry[0]
                ks.touched[name] = (current, now)  # OnReadAndWrite
            else:
                ks.touched.pop(name, None)
            seen.append(-1 if current is None else current)
            if v % 2 == 0:
                ks.touched[name] = ((current or 0) + 1, now)
        due = int(rows["ts_ms"].max()) + EVENT_TIMER_GAP_MS
        if ks.etimer is None or due > ks.etimer:
            if ks.etimer is not None:
                st.event_timers.discard((ks.etimer, key))
            st.event_timers.add((due, key))
            ks.etimer = due
        if before // PROC_TIMER_EVERY != count // PROC_TIMER_EVERY:
            st.proc_timers.add((now + PROC_TIMER_STEPS * LOGICAL_STEP_MS, key))
        n, lo, hi = ks.stats  # type: ignore[misc]
        return {"key": key, "batch_id": b, "kind": "row", "ts": None, "count": count,
                "total": ks.total, "n": n, "lo": lo, "hi": hi,
                "recent": _js([v for v, _ in ks.recent]),
                "buckets": _js(sorted([k, v] for k, v in ks.buckets.items())),  # [] if dropped
                "prev_seen": prev_seen, "touched": _js(seen)}


@dataclass
class BranchOutcome:
    """What one lineage branch must output (main and late rows) and hold at its end."""

    main: list[dict[str, Any]]
    late: list[dict[str, Any]]
    state: OracleState


def run_branches(generated: str, branches: Sequence[Any],
                 definitions: Mapping[int, int] | None = None) -> list[BranchOutcome]:
    """Each branch's expected output and final state (``plan.Branch``: ``index``, ``parent``
    (None for the first), ``fork`` batch, ``batches``), parents before children: a branch
    starts from its parent's state after the fork batch, then runs its own batches."""
    forks = {(b.parent, b.fork) for b in branches if b.parent is not None}
    snapshots: dict[tuple[int, int], OracleState] = {}
    out: list[BranchOutcome] = []
    for branch in branches:
        oracle = Oracle(generated, branch.batches, definitions)
        if branch.parent is not None:
            key = (branch.parent, branch.fork)
            if key not in snapshots:
                raise ValueError(f"branch {branch.index} forks from batch {branch.fork} of "
                                 f"branch {branch.parent}, which never ran it")
            oracle.state = copy.deepcopy(snapshots[key])
        if (branch.index, oracle.state.batch_id) in forks:
            snapshots[(branch.index, oracle.state.batch_id)] = oracle.snapshot()
        main: list[dict[str, Any]] = []
        late: list[dict[str, Any]] = []
        for b, _ in branch.batches:
            m, lt = oracle.step(b)
            main += m
            late += lt
            if (branch.index, b) in forks:
                snapshots[(branch.index, b)] = oracle.snapshot()
        out.append(BranchOutcome(main, late, oracle.state))
    return out


def _timer_row(key: str, b: int, kind: str, ts: int, count: int, total: int | None
               ) -> dict[str, Any]:
    return {"key": key, "batch_id": b, "kind": kind, "ts": ts, "count": count, "total": total,
            "n": None, "lo": None, "hi": None, "recent": None, "buckets": None,
            "prev_seen": None, "touched": None}
