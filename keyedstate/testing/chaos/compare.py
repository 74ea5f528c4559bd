"""Comparing what the soak's job did with what :mod:`~keyedstate.testing.chaos.oracle`
expects: the rows a sink holds (each batch under its lineage branch, :func:`read_sink`,
:func:`sink_lineages`, :func:`match_branches`), compared row by row (:func:`compare_main`,
:func:`compare_late`), and the state a checkpoint holds (:func:`actual_state`) against the
oracle's (:func:`expected_state`, :func:`compare_state`). Each counts exactly-once
violations: an expected row missing, a row twice, a row nobody expected, a row with another
value, a state entry that differs.
"""

from __future__ import annotations

import json
import operator
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from keyedstate.testing.chaos.oracle import IDENTITY, OUTPUT_COLUMNS, OracleState
from keyedstate.testing.chaos.workload import (
    TTL_LAST_SEEN_MS,
    TTL_RECENT_MS,
    TTL_TOUCHED_MS,
    Definition,
    logical_now,
)

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

    def tally(self, label: str, want: Mapping[Any, Any], got: Mapping[Any, Any],
              seen: Mapping[Any, int] | None = None,
              same: Callable[[Any, Any], bool] = operator.eq) -> None:
        """Count what ``got`` holds against what it should (``want``), both by identity: each
        wanted entry missing or with another value (not ``same``), then each entry not wanted,
        ``seen[identity]`` times (default once). The examples name an entry
        ``label[identity]``."""
        for ident, value in want.items():
            if ident not in got:
                self.missing += 1
                self.note(f"{label}[{ident!r}]: missing (expected {value!r})")
            elif not same(got[ident], value):
                self.wrong_value += 1
                self.note(f"{label}[{ident!r}]: expected {value!r}, got {got[ident]!r}")
        for ident, value in got.items():
            if ident not in want:
                self.unexpected += 1 if seen is None else seen[ident]
                self.note(f"{label}[{ident!r}]: unexpected ({value!r})")

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
            c.note(f"row[{ident!r}]: appears {n} times")
    c.tally("row", want, got, seen=counts)
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
        c.tally(name, want, got, same=_same)
    return c


def _same(a: Any, b: Any) -> bool:
    return _canon(a) == _canon(b)


def _canon(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_canon(v) for v in value)
    return value
