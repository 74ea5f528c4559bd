"""Canonical savepoints without Spark: native snapshot -> Parquet -> any backend, any parallelism.

Real backends, real files: a job's state (every kind, typed and pickled, TTL, timers) is
checkpointed by one backend, converted with ``write_canonical_savepoint``, read by pandas and
DuckDB as plain Parquet, and restored into the other backend at other parallelisms with
``restore_canonical``; the restored state must equal the original (``dump`` of the backend
contract), TTL timestamps included. Bad savepoints fail with typed errors before any state is
built.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import KeyedStateBackend, StateRecord, meta_info_of
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.errors import (
    CorruptCheckpointError,
    KeyGroupRangeError,
    MaxParallelismMismatchError,
    MissingCheckpointFileError,
    SerializationError,
    SnapshotExistsError,
    StateTypeMismatchError,
    TargetNotEmptyError,
)
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.processor.canonical import (
    TIMERS_ENTRY,
    open_snapshot_range,
    restore_canonical,
    write_canonical_savepoint,
)
from keyedstate.serde import VOID_NAMESPACE, serializer_for, type_from_string
from keyedstate.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
)
from keyedstate.state.timers import TimeDomain
from keyedstate.state.ttl import ManualTimeProvider
from tests.backends.contract.common import (
    ALL_NAMES,
    T0,
    Harness,
    dump,
    dump_timers,
    register_all,
    ttl,
    write,
)

pytestmark = pytest.mark.integration

MAX_P = 8
TTL_MS = 1000
KEYS = [f"u{i:03d}" for i in range(40)]
RICH_TYPE = ("struct<ts:timestamp,day:date,amount:decimal(20,4),tags:map<string,bigint>,"
             "local:timestamp_ntz>")
EXTRA = {
    "rich": ValueStateDescriptor("rich", RICH_TYPE),
    "ttl_value": ValueStateDescriptor("ttl_value", "bigint", ttl=ttl(TTL_MS)),
    "ttl_list": ListStateDescriptor("ttl_list", "string", ttl=ttl(TTL_MS)),
    "ttl_map": MapStateDescriptor("ttl_map", "string", "double", ttl=ttl(TTL_MS)),
}
NAMES = [*ALL_NAMES, *sorted(EXTRA)]
TTL_NAMES = ["ttl_list", "ttl_map", "ttl_value"]


def rich_value(i: int) -> dict[str, Any]:
    return {"ts": dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=i),
            "day": dt.date(2024, 2, 1) + dt.timedelta(days=i),
            "amount": decimal.Decimal(i).scaleb(-4) + decimal.Decimal("1234567890.5"),
            "tags": {"a": i, "b": -i}, "local": dt.datetime(2024, 3, 1, 12, 0, i % 60)}


class Source:
    """A job's state checkpointed by one backend: every kind, TTL entries half expired."""

    def __init__(self, tmp: Path, backend: str, parallelism: int) -> None:
        self.harness = h = Harness(load_backend(backend), tmp, key_types=("string",),
                                   max_parallelism=MAX_P)
        backends = h.create_all(parallelism)
        register_all(backends)
        write(h, backends, KEYS, seed=7)
        for i, key in enumerate(KEYS):
            b = h.at(backends, key)
            b.get_state(EXTRA["rich"]).update(rich_value(i))
            # First half written at T0 (expired at T0 + 1200), second half at T0 + 600.
            h.clock.set(T0 if i < len(KEYS) // 2 else T0 + 600)
            b.get_state(EXTRA["ttl_value"]).update(i)
            b.get_state(EXTRA["ttl_list"]).add_all([f"{key}-a", f"{key}-b"])
            b.get_state(EXTRA["ttl_map"]).put_all({"x": i / 2, "y": -1.5})
        h.clock.set(T0 + 1200)
        self.expected = dump(h, backends, NAMES), dump_timers(h, backends)
        self.ttl_stamps = ttl_stamps(backends)
        h.snapshot_all(backends)
        self.snapshot = resolve_snapshot(h.storage.url)
        self.tmp = tmp

    def canonical(self, name: str = "sp", **kwargs: Any) -> str:
        target = str(self.tmp / name)
        write_canonical_savepoint(self.snapshot, target, time_provider=self.harness.clock,
                                  **kwargs)
        return target

    def restore(self, path: str, backend: str, parallelism: int, clock: Any = None,
                **kwargs: Any) -> list[KeyedStateBackend]:
        snapshot = resolve_snapshot(path)
        restored = []
        for i in range(parallelism):
            restored.append(restore_canonical(
                load_backend(backend), snapshot, subtask_index=i,
                key_group_range=KeyGroupRange.of_operator(MAX_P, parallelism, i),
                max_parallelism=MAX_P, key_serializer=self.harness.key_serializer,
                time_provider=clock or self.harness.clock, **kwargs))
        self.harness.backends.extend(restored)
        return restored


def ttl_stamps(backends: list[KeyedStateBackend]) -> dict[tuple[str, bytes, bytes, Any], list[int]]:
    out: dict[tuple[str, bytes, bytes, Any], list[int]] = {}
    for b in backends:
        for name in TTL_NAMES:
            for r in b.iter_records(name):
                out.setdefault((name, r.key_bytes, r.namespace_bytes, r.user_key),
                               []).append(r.ttl_timestamp)
    return out


@pytest.fixture
def source(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    backend, parallelism = getattr(request, "param", ("rocksdb", 2))
    src = Source(tmp_path, backend, parallelism)
    yield src
    src.harness.close_all()


@pytest.mark.parametrize(("source", "backend", "parallelism"), [
    (("rocksdb", 2), "heap", 1),
    (("heap", 3), "rocksdb", MAX_P),
    (("rocksdb", 2), "rocksdb", 3),
], indirect=["source"])
def test_restores_into_any_backend_at_any_parallelism(source, backend, parallelism):
    restored = source.restore(source.canonical(), backend, parallelism)
    assert [b.name for b in restored] == [backend] * parallelism
    assert (dump(source.harness, restored, NAMES), dump_timers(source.harness, restored)) == \
        source.expected
    assert ttl_stamps(restored) == source.ttl_stamps  # last-access times survive
    # The job goes on: registered descriptors read the restored values, and the first
    # snapshot restores natively at yet another parallelism.
    h = source.harness
    b = h.at(restored, KEYS[3])
    assert b.get_state(EXTRA["rich"]).value() == rich_value(3)
    handles = h.snapshot_all(restored)
    again = h.create_all(2, handles=handles, state_backend=load_backend(backend))
    assert dump(h, again, NAMES) == source.expected[0]


def test_ttl_expired_entries_are_left_out_and_timestamps_kept(source):
    path = source.canonical()
    values = pq.read_table(os.path.join(path, "states", "ttl_value")).to_pylist()
    assert sorted(r["key"] for r in values) == KEYS[len(KEYS) // 2:]
    young = dt.datetime.fromtimestamp((T0 + 600) / 1000, dt.timezone.utc)
    assert {r["ttl_timestamp"] for r in values} == {young}
    # Restored with a clock past the young entries' TTL: nothing of them is left.
    late = ManualTimeProvider(T0 + 600 + TTL_MS)
    restored = source.restore(path, "heap", 2, clock=late)
    assert all(not d for n, d in dump(source.harness, restored, TTL_NAMES).items())


def test_pandas_reads_the_files_without_keyedstate(source):
    path = source.canonical()
    script = f"""
import json, sys, pandas as pd
out = {{}}
for name in ("value", "list", "map", "rich"):
    df = pd.read_parquet({path!r} + "/states/" + name)
    df["namespace"] = df["namespace"].map(bytes.hex)
    out[name] = json.loads(df.to_json(orient="records", date_format="iso"))
out["timers"] = int(len(pd.read_parquet({path!r} + "/timers")))
out["imported"] = [m for m in sys.modules if m.startswith("keyedstate")]
print(json.dumps(out))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd="/", check=True)
    got = json.loads(result.stdout)
    assert got["imported"] == []
    ks = source.harness.key_serializer
    expected = {name: {(ks.deserialize(k), ns.hex(), uk): v for (k, ns, uk), v in entries.items()}
                for name, entries in source.expected[0].items()}
    assert {(r["key"], r["namespace"], None): r["value"] for r in got["value"]} == \
        expected["value"]
    lists: dict[tuple[str, str, None], list[tuple[int, str]]] = {}
    for r in got["list"]:
        lists.setdefault((r["key"], r["namespace"], None), []).append((r["position"],
                                                                       r["value"]))
    assert {k: [v for _, v in sorted(p)] for k, p in lists.items()} == expected["list"]
    assert {(r["key"], r["namespace"], r["map_key"]): r["value"] for r in got["map"]} == \
        expected["map"]
    rich = {r["key"]: r["value"] for r in got["rich"]}
    assert rich[KEYS[5]]["amount"] == pytest.approx(1234567890.5005)
    assert rich[KEYS[5]]["day"].startswith("2024-02-06")
    assert got["timers"] == len(source.expected[1])


def test_duckdb_reads_the_files(source):
    duckdb = pytest.importorskip("duckdb")
    path = source.canonical()
    con = duckdb.connect()
    rows = con.execute(
        f"SELECT key, value.sum, value.count FROM read_parquet('{path}/states/aggregating/*')"
    ).fetchall()
    ks = source.harness.key_serializer
    expected = sorted((ks.deserialize(k), v["sum"], v["count"])
                      for (k, _, _), v in source.expected[0]["aggregating"].items())
    assert sorted(rows) == expected
    n = con.execute(f"SELECT count(*) FROM read_parquet('{path}/timers/*') "
                    f"WHERE domain = 'event_time'").fetchone()[0]
    assert n == sum(1 for t in source.expected[1] if t[0] == str(TimeDomain.EVENT_TIME))


def test_canonical_to_canonical_with_more_splits_and_key_names(source):
    first = source.canonical("sp1")
    again_src = resolve_snapshot(first)
    target = str(source.tmp / "sp2")
    write_canonical_savepoint(again_src, target, splits=MAX_P, key_columns=["user"],
                              time_provider=source.harness.clock)
    snap = resolve_snapshot(target)
    assert snap.metadata.parallelism == MAX_P and snap.metadata.format == "canonical"
    assert all(len(h.key_group_range) == 1 for h in snap.metadata.handles)
    for handle in snap.metadata.handles:
        for entry, file in handle.private.items():
            names = pq.read_schema(snap.storage.path(file.path)).names
            assert "user" in names and ("domain" in names) == (entry == TIMERS_ENTRY)
    restored = source.restore(target, "rocksdb", 2)
    assert dump(source.harness, restored, NAMES) == source.expected[0]
    # Every file path is relative: the directory moves.
    moved = str(source.tmp / "moved")
    os.rename(target, moved)
    assert dump(source.harness, source.restore(moved, "heap", 1), NAMES) == source.expected[0]


def test_incompatible_job_is_refused(source):
    path = source.canonical()
    snap = resolve_snapshot(path)
    kwargs = dict(subtask_index=0, key_group_range=KeyGroupRange(0, MAX_P - 1))
    with pytest.raises(StateTypeMismatchError, match="'value'"):
        restore_canonical(load_backend("heap"), snap, max_parallelism=MAX_P,
                          key_serializer=source.harness.key_serializer,
                          descriptors=[ValueStateDescriptor("value", "string")], **kwargs)
    with pytest.raises(StateTypeMismatchError, match="keyed by"):
        restore_canonical(load_backend("heap"), snap, max_parallelism=MAX_P,
                          key_serializer=KeySerializer(["bigint"]), **kwargs)
    with pytest.raises(MaxParallelismMismatchError, match="SavepointWriter"):
        restore_canonical(load_backend("heap"), snap, max_parallelism=16,
                          key_serializer=source.harness.key_serializer,
                          subtask_index=0, key_group_range=KeyGroupRange(0, 15))
    # Registered later, as a job's open() does: the restored state's type is checked too.
    restored = source.restore(path, "rocksdb", 1)[0]
    with pytest.raises(StateTypeMismatchError, match="'list'"):
        restored.get_state(ListStateDescriptor("list", "bigint"))


@pytest.mark.parametrize("damage", ["altered", "missing"])
def test_damaged_file_is_refused_before_any_state_is_built(source, damage):
    path = source.canonical()
    snap = resolve_snapshot(path)
    victim = snap.storage.path(snap.metadata.handles[1].private["list"].path)
    if damage == "altered":
        data = bytearray(Path(victim).read_bytes())
        data[len(data) // 2] ^= 0xFF
        Path(victim).write_bytes(bytes(data))
        expected: type[Exception] = CorruptCheckpointError
    else:
        os.remove(victim)
        expected = MissingCheckpointFileError
    local = source.tmp / "local-restore"
    local.mkdir()
    with pytest.raises(expected, match="list"):
        source.restore(path, "rocksdb", 1, local_dir=str(local))
    # No RocksDB instance was even created (this process's directory there stays empty).
    assert [os.listdir(local / d) for d in os.listdir(local)] in ([], [[]])
    # A subtask whose key groups don't include the damaged split still restores.
    first = snap.metadata.handles[0].key_group_range
    ok = restore_canonical(load_backend("heap"), snap, subtask_index=0,
                           key_group_range=first, max_parallelism=MAX_P,
                           key_serializer=source.harness.key_serializer,
                           time_provider=source.harness.clock)
    ok.close()


def test_target_holding_a_savepoint_is_refused(source):
    path = source.canonical()
    before = sorted(p for p in Path(path).rglob("*"))
    with pytest.raises(SnapshotExistsError, match="already holds a savepoint"):
        source.canonical()
    assert sorted(p for p in Path(path).rglob("*")) == before


def test_a_target_holding_an_interrupted_writes_files_is_refused_and_kept(source):
    # Files keyedstate did not write in this call are never replaced or deleted: the user
    # deletes an interrupted write's leftovers.
    stray = source.tmp / "sp" / "states" / "value" / "kg-00000-00003-deadbeef0000.parquet"
    stray.parent.mkdir(parents=True)
    pq.write_table(pa.table({"key_group": pa.array([0], pa.int32())}), stray)
    with pytest.raises(TargetNotEmptyError, match="not empty"):
        source.canonical()
    assert [p.name for p in (source.tmp / "sp").rglob("*.parquet")] == [stray.name]
    assert not (source.tmp / "sp" / "_metadata").exists()


def test_open_snapshot_range_reads_native_and_canonical_alike(source):
    path = source.canonical()
    for snap in (source.snapshot, resolve_snapshot(path)):
        with open_snapshot_range(snap, KeyGroupRange(0, MAX_P - 1),
                                 time_provider=source.harness.clock) as b:
            assert dump(source.harness, [b], NAMES) == source.expected[0]


# --------------------------------------------------------------------------------------------
# the backends' bulk load (load_records / iter_records)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", ["heap", "rocksdb"])
def test_load_records_contract(tmp_path, backend_name):
    h = Harness(load_backend(backend_name), tmp_path, key_types=("string",),
                max_parallelism=MAX_P)
    b = h.create(0, 1)
    ks = h.key_serializer
    rec = lambda key, user_key, value, ts=None: StateRecord(  # noqa: E731
        ks.key_group(key, MAX_P), ks.serialize(key), VOID_NAMESPACE, user_key, value, ts)
    lst = ListStateDescriptor("l", "bigint", ttl=ttl(TTL_MS))
    mp = MapStateDescriptor("m", "string", None)
    assert b.load_records(meta_info_of(lst), serializer_for("bigint"), None,
                          [rec("a", None, 1, T0 - 10), rec("a", None, 2), rec("b", None, 3)]) == 3
    assert b.load_records(meta_info_of(mp), serializer_for(None), serializer_for("string"),
                          [rec("a", "x", {1}), rec("a", "x", {2}), rec("a", "y", None)]) == 3
    assert b.load_records(meta_info_of(lst), serializer_for("bigint"), None,
                          [rec("a", None, 4)]) == 1  # appends to the loaded list
    assert [(r.value, r.ttl_timestamp) for r in b.iter_records("l")
            if r.key_bytes == ks.serialize("a")] == [(1, T0 - 10), (2, T0), (4, T0)]
    b.set_current_key("a")
    assert b.get_state(lst).get() == [1, 2, 4]
    assert dict(b.get_state(mp).items()) == {"x": {2}, "y": None}
    with pytest.raises(StateTypeMismatchError, match="'m'"):
        b.load_records(meta_info_of(MapStateDescriptor("m", "string", "bigint")),
                       serializer_for("bigint"), serializer_for("string"), [])
    with pytest.raises(SerializationError, match="'l'"):
        b.load_records(meta_info_of(lst), serializer_for("bigint"), None, [rec("a", None, "x")])
    outside = next(k for k in (f"k{i}" for i in range(100)) if ks.key_group(k, MAX_P) != 0)
    small = h.create(0, MAX_P)  # owns key group 0 only
    with pytest.raises(KeyGroupRangeError):
        small.load_records(meta_info_of(lst), serializer_for("bigint"), None,
                           [rec(outside, None, 1)])
    # Loaded state is snapshotted and restored like any other, incrementally too.
    h.snapshot(b)
    b.load_records(meta_info_of(lst), serializer_for("bigint"), None, [rec("b", None, 5)])
    handle = h.snapshot(b)
    again = h.create(0, 1, handles=[handle])
    again.set_current_key("b")
    assert again.get_state(lst).get() == [3, 5]
    h.close_all()


@pytest.mark.parametrize(("text", "expected"), [
    ("struct<count: int64, total: double>",
     pa.struct([("count", pa.int64()), ("total", pa.float64())])),
    ("map<string, struct<a: int32, b: list<item: string>>>",
     pa.map_(pa.string(), pa.struct([("a", pa.int32()), ("b", pa.list_(pa.string()))]))),
    ("timestamp[us, tz=UTC]", pa.timestamp("us", tz="UTC")),
    ("timestamp[us]", pa.timestamp("us")),
    ("decimal128(20, 4)", pa.decimal128(20, 4)),
    ("date32[day]", pa.date32()),
    ("list<item: bool>", pa.list_(pa.bool_())),
    # Spark DDL, as a Spark job records its key types
    ("bigint", pa.int64()),
    ("count bigint, total double", pa.struct([("count", pa.int64()), ("total", pa.float64())])),
])
def test_type_strings_round_trip(text, expected):
    assert type_from_string(text) == expected
    if text == str(expected):
        assert str(type_from_string(str(expected))) == text


def test_unrebuildable_type_string_is_a_typed_error():
    with pytest.raises(SerializationError, match="can't be rebuilt"):
        type_from_string("vector<int64>")


# --------------------------------------------------------------------------------------------
# keyedstate state read (no Spark)
# --------------------------------------------------------------------------------------------


def _cli() -> Any:
    import click

    from keyedstate.cli.state import state_group

    @click.group()
    def main() -> None:
        pass

    main.add_command(state_group)
    return main


def test_state_read_command_on_native_and_canonical(source):
    from click.testing import CliRunner

    canonical = source.canonical()
    runner = CliRunner()
    ks = source.harness.key_serializer
    expected = {(ks.deserialize(k), v) for (k, ns, _), v in source.expected[0]["value"].items()
                if ns == VOID_NAMESPACE}
    for path in (source.harness.storage.url, canonical):
        result = runner.invoke(_cli(), ["state", "read", path, "--state", "value",
                                        "--limit", "1000", "--json"])
        assert result.exit_code == 0, result.output
        rows = json.loads(result.output)
        assert {(r["key"], r["value"]) for r in rows if r["namespace"] is None} == expected
        out = source.tmp / f"out-{len(os.listdir(source.tmp))}"
        result = runner.invoke(_cli(), ["state", "read", path, "--state", "pmap", "--out",
                                        str(out), "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["rows"] == len(source.expected[0]["pmap"]) == \
            pq.read_table(str(out)).num_rows
    table = runner.invoke(_cli(), ["state", "read", canonical, "--state", "map", "--limit", "3"])
    assert table.exit_code == 0 and "map_key" in table.output and "first 3 rows" in table.output
    # The command reads as of now: every TTL entry of 1970 has expired.
    expired = runner.invoke(_cli(), ["state", "read", canonical, "--state", "ttl_map"])
    assert expired.exit_code == 0 and "first 0 rows" in expired.output
    assert "ttl_timestamp" in expired.output
    missing = runner.invoke(_cli(), ["state", "read", canonical, "--state", "nope"])
    assert missing.exit_code == 1 and "StateNotFoundError" in missing.output
    both = runner.invoke(_cli(), ["state", "read", canonical, "--state", "value", "--limit",
                                  "1", "--out", str(source.tmp / "x")])
    assert both.exit_code == 2


def test_a_canonical_savepoint_carries_what_a_native_one_does():
    """One rule for every savepoint (the house plan): the job's properties travel, including a
    runtime's own (Spark's offset location and query id), which the processor never names;
    job-local ones, the context's, transfer figures and the source format's bookkeeping stay."""
    from keyedstate.checkpoint import properties as p
    from keyedstate.processor.canonical.layout import PROP_SOURCE, carried_properties

    job = {p.BATCH_ID: "7", p.WATERMARK: "1000", p.RESTORED_FROM: "/sp", p.DRAINED: "false",
           "spark_checkpoint_location": "/spark", "spark_query_id": "q-1", "key_columns": '["u"]'}
    local = {p.TOKENS: "[]", p.STAGED: "{}", p.CONTEXT: '["spark_source_log"]',
             "spark_source_log": "context/spark-source", "transfer.uploaded-bytes": "5",
             p.SAVEPOINT_OF: "/cp/chk-7/_metadata", PROP_SOURCE: "/other/_metadata"}
    assert carried_properties({**job, **local}) == job
    assert p.portable_properties({**job, **local}) == {
        **job, p.SAVEPOINT_OF: "/cp/chk-7/_metadata", PROP_SOURCE: "/other/_metadata"}
