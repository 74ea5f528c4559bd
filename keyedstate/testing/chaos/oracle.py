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
  under its own query id (:func:`sink_lineages`, :func:`match_branches`).

:func:`compare_outputs` and :func:`compare_state` count exactly-once violations: an expected
row missing, a row twice, a row nobody expected, a row with another value, a state entry
that differs.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

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


# -- comparing outputs ------------------------------------------------------------------------

#: a ParquetSink's batch, named by its directory (``[<lineage>-]batch-<B>/part-<n>.parquet``)
#: or, before the sink named batches by query id, by its files
#: (``batch-<B>-part-<n>.parquet``, one directory: kept runs of then are judged again)
_SINK_FILE = re.compile(r"^batch-(\d+)-part-\d+\.parquet$")
_SINK_BATCH_DIR = re.compile(r"^(?:(.+)-)?batch-(\d+)$")


def read_sink(directory: str) -> pd.DataFrame:
    """Every row of every Parquet file a reader of ``directory`` sees (recursively; names
    starting with ``_`` or ``.`` are hidden, as pandas and pyarrow hide them), with the batch
    id its file or directory names (``_file_batch``, -1: none) and the lineage its directory
    names (``_lineage``, "" if none); timestamps as int64 microseconds.

    Either layout of :class:`~keyedstate.spark.sinks.ParquetSink`: a directory per batch
    named by its query id (lineage), or files of every batch in one directory (before
    2d83c89). Columns a file lacks (another job's output) are null."""
    frames = []
    for folder, subfolders, names in os.walk(directory):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(("_", ".")))
        in_dir = _SINK_BATCH_DIR.match(os.path.basename(folder)) if folder != directory \
            else None
        for name in sorted(names):
            if name.startswith(("_", ".")) or not name.endswith(".parquet"):
                continue
            in_name = _SINK_FILE.match(name)
            table = pq.read_table(os.path.join(folder, name))
            for i, f in enumerate(table.schema):
                if pa.types.is_timestamp(f.type):
                    table = table.set_column(i, f.name, table.column(i).cast(pa.int64()))
            df = table.to_pandas()
            df["_file_batch"] = int(in_name.group(1)) if in_name else \
                int(in_dir.group(2)) if in_dir else -1
            df["_lineage"] = (in_dir.group(1) or "") if in_dir else ""
            frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def sink_lineages(directory: str) -> dict[str, tuple[str, int]]:
    """Lineage -> (parent lineage, fork batch) of every batch directory a
    :class:`~keyedstate.spark.sinks.ParquetSink` published in ``directory`` (its
    ``_SUCCESS`` manifest; ``""`` and -1 for a lineage that is no branch). A lineage whose
    batches name different parents maps to the first; :func:`lineage_conflicts` lists them."""
    return {lineage: seen[0] for lineage, seen in _manifests(directory).items()}


def lineage_conflicts(directory: str) -> list[str]:
    """Lineages whose published batches name more than one (parent, fork)."""
    return [f"lineage {lineage} names parents {sorted(set(seen))}"
            for lineage, seen in _manifests(directory).items() if len(set(seen)) > 1]


def _manifests(directory: str) -> dict[str, list[tuple[str, int]]]:
    found: dict[str, list[tuple[str, int]]] = {}
    if not os.path.isdir(directory):
        return found
    for name in sorted(os.listdir(directory)):
        match = _SINK_BATCH_DIR.match(name)
        manifest = os.path.join(directory, name, "_SUCCESS")
        if match is None or not match.group(1) or not os.path.exists(manifest):
            continue
        with open(manifest) as f:
            data = json.load(f)
        found.setdefault(match.group(1), []).append(
            (str(data.get("parent_lineage", "")), int(data.get("fork_batch_id", -1))))
    return found


def match_branches(branches: Sequence[Any], lineages: Mapping[str, tuple[str, int]],
                   exclude: Iterable[str] = ()) -> tuple[dict[int, str], list[str]]:
    """The lineage (query id) of each plan branch, by the sinks' manifests: the first branch
    is the one lineage without a parent (besides ``exclude``, another job's), each other one
    the lineage naming its parent's lineage and its fork batch. Returns the matches and the
    problems (none or several candidates)."""
    skip = set(exclude)
    found: dict[int, str] = {}
    problems: list[str] = []
    for branch in branches:
        if branch.parent is None:
            want: tuple[str, int] | None = ("", -1)
        else:
            parent = found.get(branch.parent)
            want = None if parent is None else (parent, branch.fork)
        if want is None:
            problems.append(f"branch {branch.index}: its parent branch has no lineage")
            continue
        candidates = sorted(lin for lin, (par, fork) in lineages.items()
                            if lin not in skip and (par, fork if par else -1) == want)
        if len(candidates) == 1:
            found[branch.index] = candidates[0]
        else:
            problems.append(f"branch {branch.index} (parent {want[0] or '-'}, fork batch "
                            f"{want[1]}): {len(candidates)} lineages in the sinks "
                            f"{candidates[:4]}")
    return found, problems


def split_jobs(rows: pd.DataFrame, column: str, tag: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Rows of one output path written by two jobs: (rows without ``column``, rows with
    ``column == tag``), the other job's column dropped from both."""
    if not len(rows) or column not in rows.columns:
        return rows, rows.iloc[0:0]
    mine = rows[column].isna()
    other = rows[column] == tag
    unknown = rows[~mine & ~other]
    return (pd.concat([rows[mine], unknown]).drop(columns=[column]),
            rows[other].drop(columns=[column]))


@dataclass
class Comparison:
    """Exactly-once accounting of one output or of the state."""

    expected: int = 0
    actual: int = 0
    missing: int = 0
    duplicated: int = 0
    unexpected: int = 0
    wrong_value: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def violations(self) -> int:
        return self.missing + self.duplicated + self.unexpected + self.wrong_value

    def note(self, text: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(text)

    def add(self, other: Comparison, prefix: str = "") -> None:
        """Count ``other`` in (a branch's comparison into the run's)."""
        self.expected += other.expected
        self.actual += other.actual
        self.missing += other.missing
        self.duplicated += other.duplicated
        self.unexpected += other.unexpected
        self.wrong_value += other.wrong_value
        for text in other.examples:
            self.note(prefix + text)

    def to_json(self) -> dict[str, Any]:
        return {"expected": self.expected, "actual": self.actual, "missing": self.missing,
                "duplicated": self.duplicated, "unexpected": self.unexpected,
                "wrong_value": self.wrong_value, "violations": self.violations,
                "examples": self.examples}


def _norm(value: Any) -> Any:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return None
    if hasattr(value, "item"):
        value = value.item()
    return value


def _rows(records: Iterable[dict[str, Any]], columns: list[str]) -> list[tuple[Any, ...]]:
    return [tuple(_norm(r.get(c)) for c in columns) for r in records]


def compare_rows(expected: list[dict[str, Any]], actual: pd.DataFrame, identity: list[str],
                 columns: list[str]) -> Comparison:
    """Rows told apart by ``identity``: each expected one must appear once with the expected
    ``columns``; anything else is a violation."""
    c = Comparison(expected=len(expected), actual=len(actual))
    want: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for row in _rows(expected, columns):
        want[row[: len(identity)]] = row
    got_records = actual.to_dict("records") if len(actual) else []
    counts: Counter[tuple[Any, ...]] = Counter()
    got: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for row in _rows(got_records, columns):
        ident = row[: len(identity)]
        counts[ident] += 1
        if ident in got and got[ident] != row:
            c.wrong_value += 1
            c.note(f"two different rows for {ident}: {got[ident]} and {row}")
        got[ident] = row
    for ident, n in counts.items():
        if n > 1:
            c.duplicated += n - 1
            c.note(f"{ident} appears {n} times")
        if ident not in want:
            c.unexpected += n
            c.note(f"unexpected row {got[ident]}")
        elif got[ident] != want[ident]:
            c.wrong_value += 1
            c.note(f"{ident}: expected {want[ident]}, got {got[ident]}")
    for ident in want:
        if ident not in counts:
            c.missing += 1
            c.note(f"missing row {want[ident]}")
    return c


def compare_main(expected: list[dict[str, Any]], out: str | pd.DataFrame) -> Comparison:
    """The main output (a sink's directory, or rows :func:`read_sink` read) against the
    expected rows: each once, with its values, in its batch's file."""
    actual = read_sink(out) if isinstance(out, str) else out
    if len(actual):
        wrong_file = actual[actual["_file_batch"] != actual["batch_id"]]
        actual = actual.drop(columns=["_file_batch", "_lineage"])
    else:
        wrong_file = actual
    fix = [{**r, "ts": -1 if r["ts"] is None else r["ts"]} for r in expected]
    if len(actual):
        actual = actual.assign(ts=actual["ts"].fillna(-1).astype("int64"))
    c = compare_rows(fix, actual, IDENTITY, OUTPUT_COLUMNS)
    if len(wrong_file):
        c.wrong_value += len(wrong_file)
        c.note(f"{len(wrong_file)} rows in another batch's file")
    return c


def compare_late(expected: list[dict[str, Any]], late: str | pd.DataFrame) -> Comparison:
    actual = read_sink(late) if isinstance(late, str) else late
    if len(actual):
        actual = pd.DataFrame({"batch_id": actual["_file_batch"], "seq": actual["seq"],
                               "key": actual["key"],
                               "ts_us": actual["ts"],
                               "value": actual["value"]})
    return compare_rows(expected, actual, ["batch_id", "seq"],
                        ["batch_id", "seq", "key", "ts_us", "value"])


# -- comparing state --------------------------------------------------------------------------

#: (state name) -> (kind, TTL ms or None)
STATES: dict[str, tuple[str, int | None]] = {
    "count": ("value", None), "last_seen": ("value", TTL_LAST_SEEN_MS), "etimer": ("value", None),
    "recent": ("list", TTL_RECENT_MS), "buckets": ("map", None),
    "touched": ("map", TTL_TOUCHED_MS), "total": ("value", None), "stats": ("value", None),
}


def states_of(definition: int = 0) -> dict[str, tuple[str, int | None]]:
    """:data:`STATES` as definition ``definition`` declares them (``buckets`` dropped,
    ``last_seen`` without TTL)."""
    d = Definition.of(definition)
    out = dict(STATES)
    if not d.last_seen_ttl:
        out["last_seen"] = ("value", None)
    if not d.buckets:
        del out["buckets"]
    return out


def expected_state(state: OracleState) -> dict[str, dict[Any, Any]]:
    """Live entries as of the logical time of ``state.batch_id``, per state name, in the
    shape of :func:`actual_state` (under the definition the state was written with)."""
    now = logical_now(state.batch_id)
    d = Definition.of(state.definition)
    out: dict[str, dict[Any, Any]] = {name: {} for name in states_of(state.definition)}
    out["timers"] = {}
    for key, ks in state.keys.items():
        if ks.count is not None:
            out["count"][key] = ks.count
        if ks.last_seen and not d.last_seen_ttl:
            out["last_seen"][key] = ks.last_seen[0]
        elif ks.last_seen and ks.last_seen[1] + TTL_LAST_SEEN_MS > now:
            out["last_seen"][key] = ks.last_seen
        if ks.etimer is not None:
            out["etimer"][key] = ks.etimer
        live = [(v, t) for v, t in ks.recent if t + TTL_RECENT_MS > now]
        if live:
            out["recent"][key] = live
        for bucket, total in ks.buckets.items():  # none while dropped
            out["buckets"][(key, bucket)] = total
        for name, (v, t) in ks.touched.items():
            if t + TTL_TOUCHED_MS > now:
                out["touched"][(key, name)] = (v, t)
        if ks.total is not None:
            out["total"][key] = ks.total
        if ks.stats is not None:
            out["stats"][key] = (*ks.stats, ks.stats_last) if d.evolved else ks.stats
    for ts, key in state.proc_timers:
        out["timers"][("processing_time", ts, key)] = True
    for ts, key in state.event_timers:
        out["timers"][("event_time", ts, key)] = True
    return out


def _ttl_ms(value: Any) -> int:
    if isinstance(value, pd.Timestamp):
        return int(value.value // 1_000_000)
    return int(value)


def actual_state(frames: dict[str, pd.DataFrame], batch_id: int, definition: int = 0
                 ) -> dict[str, dict[Any, Any]]:
    """The canonical rows a state reader returned (one DataFrame per state, ``timers``), as
    the live entries at the logical time of ``batch_id``; ``ttl_timestamp`` in ms. States
    as ``definition`` declares them; a frame of a state it does not declare is reported under
    its name (an unexpected state)."""
    now = logical_now(batch_id)
    declared = states_of(definition)
    out: dict[str, dict[Any, Any]] = {name: {} for name in declared}
    out["timers"] = {}
    for name in STATES:
        df = frames.get(name)
        if name not in declared and df is not None and len(df):
            out[name] = {f"row {i}": "a state this definition dropped"
                         for i in range(len(df))}
    for name, (kind, ttl) in declared.items():
        df = frames.get(name)
        if df is None or not len(df):
            continue
        rows = df.to_dict("records")
        if ttl is not None:
            rows = [r for r in rows if _ttl_ms(r["ttl_timestamp"]) + ttl > now]
        if kind == "list":
            lists: dict[str, list[tuple[int, int, int]]] = {}
            for r in rows:
                lists.setdefault(r["key"], []).append(
                    (int(r["position"]), int(r["value"]), _ttl_ms(r["ttl_timestamp"])))
            for key, items in lists.items():
                out[name][key] = [(v, t) for _, v, t in sorted(items)]
        elif kind == "map":
            for r in rows:
                mk = _norm(r["map_key"])
                value = int(r["value"])
                out[name][(r["key"], mk)] = (value, _ttl_ms(r["ttl_timestamp"])) if ttl else value
        elif name == "stats":
            for r in rows:
                v = r["value"]
                stats = (int(v["n"]), int(v["lo"]), int(v["hi"]))
                out[name][r["key"]] = (*stats, _norm(v["last"])) if "last" in v else stats
        else:
            for r in rows:
                value = int(r["value"])
                out[name][r["key"]] = (value, _ttl_ms(r["ttl_timestamp"])) if ttl else value
    timers = frames.get("timers")
    if timers is not None and len(timers):
        for r in timers.to_dict("records"):
            out["timers"][(str(r["domain"]), int(r["timestamp"]), r["key"])] = True
    return out


def compare_state(expected: dict[str, dict[Any, Any]], actual: dict[str, dict[Any, Any]]
                  ) -> Comparison:
    c = Comparison()
    for name in list(expected) + [n for n in actual if n not in expected]:
        want, got = expected.get(name, {}), actual.get(name, {})
        c.expected += len(want)
        c.actual += len(got)
        for k, v in want.items():
            if k not in got:
                c.missing += 1
                c.note(f"{name}[{k!r}] missing (expected {v!r})")
            elif _canon(got[k]) != _canon(v):
                c.wrong_value += 1
                c.note(f"{name}[{k!r}]: expected {v!r}, got {got[k]!r}")
        for k in got:
            if k not in want:
                c.unexpected += 1
                c.note(f"{name}[{k!r}] unexpected ({got[k]!r})")
    return c


def _canon(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_canon(v) for v in value)
    return value
