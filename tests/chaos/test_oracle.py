"""The soak's oracle without Spark: a drain in its schedule, and a sink directory in either
ParquetSink layout, written by one job or two."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyedstate.testing.chaos.oracle import Oracle, read_sink, split_jobs
from keyedstate.testing.chaos.workload import logical_now, write_input

pytestmark = pytest.mark.chaos


def test_a_drain_fires_every_event_timer_and_shifts_the_files(tmp_path):
    generated = str(tmp_path / "generated")
    write_input(generated, 5, 4, 60, 40)
    plain = Oracle(generated)
    drained = Oracle(generated, [(0, 0), (1, 1), (2, None), (3, 2)])
    for b in (0, 1):
        assert drained.step(b) == plain.step(b)
    before = drained.snapshot()
    assert before.event_timers, "keys with a pending event-time timer"
    rows, late = drained.step(2)
    assert late == []
    # Every event-time timer fires (the watermark is +infinity for the drain), the
    # processing-time timers due at the drain's logical time too; nothing else is output.
    fired = sorted((r["ts"], r["key"]) for r in rows if r["kind"] == "etimer")
    assert fired == sorted(before.event_timers)
    due = sorted(t for t in before.proc_timers if t[0] <= logical_now(2))
    assert sorted((r["ts"], r["key"]) for r in rows if r["kind"] == "ptimer") == due
    assert {r["kind"] for r in rows} <= {"etimer", "ptimer"}
    assert all(r["batch_id"] == 2 for r in rows)
    after = drained.state
    assert not after.event_timers and all(ks.etimer is None for ks in after.keys.values())
    assert after.watermark == before.watermark, "the drain read nothing: the watermark stays"
    # File 2 is batch 3 now: its rows carry batch id 3.
    rows, _ = drained.step(3)
    assert rows and all(r["batch_id"] == 3 for r in rows)
    # run() without a count runs the whole schedule.
    main, _ = Oracle(generated, [(0, 0), (1, 1), (2, None), (3, 2)]).run()
    assert sorted({r["batch_id"] for r in main}) == [0, 1, 2, 3]


def _table(batch: int, keys: list[str], job: str | None = None) -> pa.Table:
    columns = {"key": keys, "batch_id": [batch] * len(keys), "kind": ["row"] * len(keys),
               "ts": pa.array([None] * len(keys), pa.int64()), "count": [1] * len(keys)}
    if job is not None:
        columns["job"] = [job] * len(keys)
    return pa.table(columns)


def test_read_sink_reads_either_layout_and_tells_two_jobs_apart(tmp_path):
    out = tmp_path / "main"
    out.mkdir()
    # One directory: files named by batch (the layout of ParquetSink up to a421391).
    pq.write_table(_table(0, ["a", "b"]), out / "batch-0000000000-part-00000.parquet")
    # A directory per (query id, batch), published whole, with its manifest.
    batch_dir = out / "3b1f-7c2a-batch-0000000001"
    batch_dir.mkdir()
    pq.write_table(_table(1, ["a"]), batch_dir / "part-00000.parquet")
    (batch_dir / "_SUCCESS").write_text("{}")
    other = out / "99aa-batch-0000000000"
    other.mkdir()
    pq.write_table(_table(0, ["x"], job="second"), other / "part-00000.parquet")
    # What a reader does not see: a commit in progress, hidden files.
    hidden = out / "_temporary" / "3b1f-7c2a-batch-0000000002-uuid"
    hidden.mkdir(parents=True)
    pq.write_table(_table(2, ["z"]), hidden / "part-00000.parquet")
    pq.write_table(_table(2, ["z"]), out / ".batch-0000000002-part-00000.parquet")
    rows = read_sink(str(out))
    got = sorted(zip(rows["key"], rows["_file_batch"], rows["_lineage"]))
    assert got == [("a", 0, ""), ("a", 1, "3b1f-7c2a"), ("b", 0, ""), ("x", 0, "99aa")]
    soak, second = split_jobs(rows, "job", "second")
    assert sorted(soak["key"]) == ["a", "a", "b"] and list(second["key"]) == ["x"]
    assert "job" not in soak.columns and "job" not in second.columns
    assert list(second["_file_batch"]) == [0]


def test_read_sink_of_a_missing_directory_is_empty(tmp_path):
    assert len(read_sink(os.path.join(tmp_path, "nothing"))) == 0
