"""The vectorized keyed API (``KeyedProcessFunction.process_batch``) on the local runtime: the
same output and state as the per-key path, with timers and late rows in the same job; a
vectorized count against pandas; the batch it gets; its errors."""

from __future__ import annotations

import random
import time
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.errors import BatchFailedError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.processor.canonical import read_range_tables
from keyedstate.runtime.function import Context, KeyedBatch, KeyedProcessFunction
from keyedstate.runtime.grouping import keyed_batch, sort_by_key
from keyedstate.runtime.local import LocalJob
from keyedstate.runtime.wire import KG_COLUMN, SUBTASK_COLUMN
from keyedstate.state.descriptors import ValueStateDescriptor
from tests.property_budget import budget
from tests.runtime.test_local_job import INPUT, batches, config, new_job, reference, rows
from tests.spark.jobs import COUNT_SCHEMA, VectorizedIdleCounts, VectorizedTotals

pytestmark = pytest.mark.integration


def state_rows(savepoint: str, state: str) -> list[tuple]:
    snapshot = resolve_snapshot(savepoint)
    everything = KeyGroupRange(0, snapshot.metadata.max_parallelism - 1)
    tables = list(read_range_tables(snapshot, everything, state, now_ms=int(time.time() * 1000)))
    return sorted(tuple(r.values()) for t in tables for r in t.to_pylist())


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_vectorized_function_with_timers_gives_the_per_key_output_and_state(tmp_path, backend):
    """VectorizedIdleCounts (bulk state, timers set per key in process_batch, on_timer per
    key, late rows to a side output) against IdleCounts (per key): same outputs over batches,
    a restore at another parallelism and a drain; same state in a savepoint."""
    data = batches(4)
    savepoints = {}
    for name, fn in (("per-key", None), ("vectorized", VectorizedIdleCounts())):
        with new_job(config(tmp_path / name, backend=backend), fn) as job:
            for table in data[:3]:
                job.process_batch(table)
            savepoints[name] = job.savepoint(str(tmp_path / f"{name}-savepoint"))
    for state in ("count", "last"):
        assert state_rows(savepoints["vectorized"], state) == \
            state_rows(savepoints["per-key"], state), state
    assert state_rows(savepoints["vectorized"], "count")

    cfg = config(tmp_path / "run", backend=backend)
    with new_job(cfg, VectorizedIdleCounts()) as job:
        outputs = [job.process_batch(t) for t in data[:2]]
    with new_job(cfg.replace(parallelism=3), VectorizedIdleCounts()) as job:
        outputs += [job.process_batch(t) for t in data[2:]]
        outputs.append(job.drain())
    got, expected = rows(outputs), reference(tmp_path, data, backend)
    assert got == expected
    assert got["idle"] and got["late-events"]


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_vectorized_totals_equal_pandas(tmp_path, backend):
    rng = random.Random(3)
    data = [pa.table({"user_id": [f"u{rng.randrange(40):03d}" for _ in range(500)],
                      "ts": pa.array([None] * 500, pa.timestamp("us", tz="UTC")),
                      "amount": [round(rng.uniform(0, 10), 2) for _ in range(500)]})
            for _ in range(3)]
    cfg = config(tmp_path, backend=backend, parallelism=3, watermark_column=None)
    seen: list[pd.DataFrame] = []
    with LocalJob(VectorizedTotals(), key_columns=["user_id"], input_schema=INPUT,
                  output_schema=COUNT_SCHEMA, config=cfg) as job:
        for batch_id, table in enumerate(data):
            out = job.process_batch(table)["main"].to_pandas().set_index("user_id").sort_index()
            seen.append(table.to_pandas())
            cumulative = pd.concat(seen).groupby("user_id")["amount"].agg(["size", "sum"])
            assert list(out.index) == sorted(table.column("user_id").unique().to_pylist())
            assert (out["count"] == cumulative.loc[out.index, "size"]).all()
            assert ((out["total"] - cumulative.loc[out.index, "sum"]).abs() < 1e-6).all()
            assert (out["batch_id"] == batch_id).all()


def _key_runs(table: pa.Table, key_columns: list[str]) -> list[tuple[Any, int, int, int]]:
    """The oracle: (key, key group, start, length) of each run of equal keys, compared in
    Python row by row."""
    cols = [table.column(c).to_pylist() for c in key_columns]
    kgs = table.column(KG_COLUMN).to_pylist()
    keys: list[Any] = cols[0] if len(cols) == 1 else list(zip(*cols))
    runs, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            runs.append((keys[start], kgs[start], start, i - start))
            start = i
    return runs


def test_keyed_batch_groups_rows_as_the_per_key_path():
    """Key runs (composite keys, nulls, arrival order within a key), key bytes and key groups
    equal those the per-key path uses."""
    serializer = KeySerializer(["string", "bigint"])
    rng = random.Random(5)
    n = 300
    table = pa.table({
        "a": [rng.choice(["x", "y", None]) for _ in range(n)],
        "b": [rng.choice([1, 2, None]) for _ in range(n)],
        "seq": list(range(n)),
    })
    keys = list(zip(table.column("a").to_pylist(), table.column("b").to_pylist()))
    table = table.append_column(KG_COLUMN, pa.array([serializer.key_group(k, 128) for k in keys],
                                                    pa.int32()))
    table = table.append_column(SUBTASK_COLUMN, pa.array([0] * n, pa.int32()))
    table = table.take(pc.sort_indices(table, [("a", "ascending"), ("b", "ascending")]))
    batch = keyed_batch(table, ["a", "b"], serializer)
    runs = _key_runs(table, ["a", "b"])
    assert list(batch.keys.keys) == [k for k, _, _, _ in runs]
    assert list(batch.keys.key_groups) == [g for _, g, _, _ in runs]
    assert list(batch.keys.key_bytes) == [serializer.serialize(k) for k, _, _, _ in runs]
    assert batch.offsets.to_pylist() == [s for _, _, s, _ in runs] + [n]
    assert batch.counts.to_pylist() == [length for _, _, _, length in runs]
    assert batch.rows.column_names == ["a", "b", "seq"]
    assert batch.key_columns.to_pylist() == [{"a": a, "b": b} for a, b in batch.keys.keys]
    for i, (_, _, start, length) in enumerate(runs):
        assert batch.rows_of(i).equals(table.slice(start, length).select(["a", "b", "seq"]))
        seq = batch.rows_of(i).column("seq").to_pylist()
        assert seq == sorted(seq)  # arrival order within a key
    assert batch.key_index().to_pylist() == [i for i, (_, _, _, length) in enumerate(runs)
                                             for _ in range(length)]


class _Vectorized(KeyedProcessFunction):
    count = ValueStateDescriptor("count", "bigint")

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def open(self, ctx: Context) -> None:
        self.state = ctx.get_state(self.count)

    def process_batch(self, batch: KeyedBatch, ctx: Context) -> Any:
        if self.mode == "per-key-state-without-key":
            self.state.value()
        if self.mode == "extra-column":
            return pa.table({"user_id": batch.key_columns.column("user_id"),
                             "count": batch.counts, "total": pa.repeat(0.0, len(batch)),
                             "batch_id": pa.repeat(0, len(batch)), "cuont": batch.counts})
        if self.mode == "wrong-type":
            return pa.table({"user_id": batch.key_columns.column("user_id"),
                             "count": pa.repeat("many", len(batch)),
                             "total": pa.repeat(0.0, len(batch)),
                             "batch_id": pa.repeat(0, len(batch))})
        if self.mode == "rows":
            # Rows work too, and a per-key call after ctx.set_current_key.
            ctx.set_current_key(batch.keys.keys[0])
            self.state.update(5)
            return [(key, self.state.value() if i == 0 else n, 0.0, ctx.batch_id)
                    for i, (key, n) in enumerate(zip(batch.keys.keys,
                                                     batch.counts.to_pylist()))]
        raise AssertionError(self.mode)


@pytest.mark.parametrize("mode,complaint", [
    ("per-key-state-without-key", "without a current key"),
    ("extra-column", "column 'cuont', which is not in the output schema"),
    ("wrong-type", "column 'count' returned by process_batch is string"),
])
def test_vectorized_function_errors_fail_the_batch(tmp_path, mode, complaint):
    with new_job(config(tmp_path, watermark_column=None), _Vectorized(mode)) as job:
        with pytest.raises(BatchFailedError, match=complaint):
            job.process_batch(batches(1)[0])
        assert job.latest_checkpoint is None


def test_vectorized_function_may_return_rows_and_use_per_key_calls(tmp_path):
    with new_job(config(tmp_path, watermark_column=None, parallelism=1),
                 _Vectorized("rows")) as job:
        out = job.process_batch(pa.table({
            "user_id": ["b", "a", "b"], "ts": pa.array([None] * 3, pa.timestamp("us", "UTC")),
            "amount": [1.0, 1.0, 1.0]}))["main"]
    assert sorted(out.to_pylist(), key=lambda r: r["user_id"]) == [
        {"user_id": "a", "count": 5, "total": 0.0, "batch_id": 0},
        {"user_id": "b", "count": 2, "total": 0.0, "batch_id": 0}]


@settings(max_examples=budget(60), deadline=None)
@given(keys=st.lists(st.one_of(st.none(), st.text(max_size=4)), max_size=60),
       binary=st.booleans(), chunk=st.integers(1, 7))
def test_sort_by_key_orders_rows_as_a_stable_sort_of_the_key(keys: list[str | None],
                                                             binary: bool, chunk: int) -> None:
    """The dictionary path for one string or binary key equals sort_indices over the table:
    ascending, nulls last, arrival order kept within a key; on chunked input too."""
    values = [None if k is None else k.encode() for k in keys] if binary else keys
    key_type = pa.binary() if binary else pa.string()
    column = pa.chunked_array([pa.array(values[i:i + chunk], key_type)
                               for i in range(0, len(values), chunk)], key_type)
    table = pa.table({"k": column, "seq": pa.array(range(len(values)), pa.int64())})
    expected = table.take(pc.sort_indices(table, [("k", "ascending")]))
    assert sort_by_key(table, ["k"]).equals(expected)
