"""The soak's oracle without Spark: a drain in its schedule, a sink directory in either
ParquetSink layout, written by one job or two, lineage branches (a branch from its parent's
state at the fork, matched to the sinks' lineages by their manifests), and changed
definitions (an evolved state type, TTL switched off and on, a dropped state)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyedstate.testing.chaos.compare import (
    actual_state,
    compare_rows,
    compare_state,
    expected_state,
    lineage_conflicts,
    match_branches,
    read_sink,
    sink_lineages,
    split_jobs,
)
from keyedstate.testing.chaos.oracle import Oracle, OracleState, run_branches
from keyedstate.testing.chaos.workload import (
    STATS_LAST_DEFAULT,
    TTL_LAST_SEEN_MS,
    ChaosFunction,
    Definition,
    definition_change,
    logical_now,
    write_input,
)

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


# -- lineage branches -------------------------------------------------------------------------

@dataclass
class _Branch:
    index: int
    parent: int | None
    fork: int
    batches: list[tuple[int, int | None]]
    jobs: list[int] = field(default_factory=list)


def test_a_branch_starts_from_its_parents_state_at_the_fork(tmp_path):
    generated = str(tmp_path / "generated")
    write_input(generated, 9, 6, 60, 30)
    root = _Branch(0, None, -1, [(b, b) for b in range(4)])
    # A rollback to batch 1 that reads files 2 and 3 again, then goes on.
    again = _Branch(1, 0, 1, [(b, b) for b in range(2, 6)])
    # Another branch of batch 1 reading other files: its batches 2-3 are not the root's.
    other = _Branch(2, 0, 1, [(2, 4), (3, 5)])
    outcomes = run_branches(generated, [root, again, other])
    plain_main, plain_late = Oracle(generated).run(6)
    assert outcomes[0].main == [r for r in plain_main if r["batch_id"] < 4]
    assert outcomes[1].main == [r for r in plain_main if r["batch_id"] >= 2]
    assert outcomes[1].late == [r for r in plain_late if r["batch_id"] >= 2]
    assert expected_state(outcomes[1].state) == expected_state(_run(generated, 6))
    skipping = Oracle(generated, [(0, 0), (1, 1), (2, 4), (3, 5)])
    skipping_main, _ = skipping.run()
    assert outcomes[2].main == [r for r in skipping_main if r["batch_id"] >= 2]
    assert outcomes[2].main != outcomes[0].main[-len(outcomes[2].main):]
    assert expected_state(outcomes[2].state) == expected_state(skipping.state)
    # The root's own batches after the fork are untouched by its branches.
    assert outcomes[0].state.batch_id == 3
    with pytest.raises(ValueError, match="never ran it"):
        run_branches(generated, [root, _Branch(1, 0, 7, [(8, 5)])])


def _run(generated: str, batches: int, definitions: dict[int, int] | None = None) -> OracleState:
    oracle = Oracle(generated, [(b, b) for b in range(batches)], definitions)
    oracle.run()
    return oracle.state


def _batch_dir(out: Any, lineage: str, batch: int, parent: str = "", fork: int = -1) -> None:
    directory = out / f"{lineage}-batch-{batch:010d}"
    directory.mkdir(parents=True)
    pq.write_table(_table(batch, ["a"]), directory / "part-00000.parquet")
    manifest: dict[str, Any] = {"lineage": lineage, "batch_id": batch}
    if parent:
        manifest.update(parent_lineage=parent, fork_batch_id=fork)
    (directory / "_SUCCESS").write_text(json.dumps({**manifest, "files": []}))


def test_branches_are_matched_to_the_sinks_lineages_by_their_manifests(tmp_path):
    out = tmp_path / "main"
    for b in range(4):
        _batch_dir(out, "q-root", b)
    _batch_dir(out, "q-second", 0)  # the second job: no parent either
    _batch_dir(out, "q-fresh", 4, "q-root", 3)
    _batch_dir(out, "q-fresh", 5, "q-root", 3)
    _batch_dir(out, "q-rollback", 5, "q-fresh", 4)
    # A crashed commit's parts without _SUCCESS name no lineage.
    (out / "q-ghost-batch-0000000009").mkdir()
    lineages = sink_lineages(str(out))
    assert lineages == {"q-root": ("", -1), "q-second": ("", -1), "q-fresh": ("q-root", 3),
                        "q-rollback": ("q-fresh", 4)}
    branches = [_Branch(0, None, -1, []), _Branch(1, 0, 3, []), _Branch(2, 1, 4, [])]
    matched, problems = match_branches(branches, lineages, exclude={"q-second"})
    assert matched == {0: "q-root", 1: "q-fresh", 2: "q-rollback"} and problems == []
    # Without telling the second job apart, the first branch is ambiguous, and so is all below.
    matched, problems = match_branches(branches, lineages)
    assert matched == {} and len(problems) == 3 and "2 lineages" in problems[0]
    # A branch the sinks never saw, and one whose fork differs from the plan's.
    matched, problems = match_branches([*branches, _Branch(3, 2, 9, [])], lineages, {"q-second"})
    assert 3 not in matched and "fork batch 9" in problems[0]
    _batch_dir(out, "q-fresh", 6, "q-root", 2)
    assert lineage_conflicts(str(out)) == ["lineage q-fresh names parents "
                                           "[('q-root', 2), ('q-root', 3)]"]


# -- definitions ------------------------------------------------------------------------------

def test_definitions_rotate_through_the_changes():
    assert [definition_change(n) for n in range(1, 7)] == [
        "evolve-stats", "switch-ttl", "toggle-buckets", "switch-ttl", "toggle-buckets",
        "switch-ttl"]
    assert Definition.of(0) == Definition(0, False, True, True)
    assert Definition.of(3) == Definition(3, True, False, False)
    assert Definition.of(5) == Definition(5, True, True, True)
    assert Definition.of(3).drop_states() == ("buckets",) and Definition.of(5).drop_states() == ()
    descriptors = ChaosFunction(None, 3).descriptors()
    assert "buckets" not in descriptors and descriptors["last_seen"].ttl is None
    assert descriptors["stats"] is ChaosFunction.stats_evolved


def test_a_changed_definition_takes_effect_at_its_first_batch(tmp_path):
    generated = str(tmp_path / "generated")
    write_input(generated, 3, 12, 80, 40)
    at = 6
    plain = _run(generated, at)
    # Definitions 1-3 from batch 6 on: stats evolved, last_seen without TTL, buckets dropped.
    changed = Oracle(generated, [(b, b) for b in range(12)], {b: 3 for b in range(at, 12)})
    changed.run(at)
    assert changed.state.definition == 0
    rows, _ = changed.step(at)
    st = changed.state
    assert st.definition == 3
    now = logical_now(at)
    touched = {r["key"] for r in rows if r["kind"] == "row"}
    for key, before in plain.keys.items():
        ks = st.keys[key]
        if key not in touched:
            # stats' new field takes its declared default; buckets are gone; an expired
            # last_seen is dropped when TTL is switched off, a live one is kept.
            assert ks.stats_last == (STATS_LAST_DEFAULT if before.stats else None)
            assert ks.buckets == {}
            live = before.last_seen is not None and before.last_seen[1] + TTL_LAST_SEEN_MS > now
            assert (ks.last_seen is not None) == live
    assert all(r["buckets"] == "[]" for r in rows if r["kind"] == "row")
    for r in (r for r in rows if r["kind"] == "row"):
        assert st.keys[r["key"]].stats_last is not None and st.keys[r["key"]].stats_last >= 0
    # Without TTL nothing expires from then on: a key seen at batch 6 and again at 11 or
    # later shows batch 6 as its last sighting, however far back.
    later = [r for b in range(at + 1, 12) for r in changed.step(b)[0]]
    back = [r for r in later if r["kind"] == "row" and r["batch_id"] >= at + 3
            and r["prev_seen"] is not None]
    assert any(r["batch_id"] - r["prev_seen"] >= 3 for r in back), "older than the TTL"
    state = expected_state(changed.state)
    assert "buckets" not in state
    assert all(isinstance(v, int) for v in state["last_seen"].values())
    assert all(len(v) == 4 for v in state["stats"].values())


def test_ttl_switched_on_stamps_every_entry_with_its_first_batch(tmp_path):
    generated = str(tmp_path / "generated")
    write_input(generated, 4, 10, 60, 30)
    # 2: TTL off from batch 3; 4 (and buckets back, 5) from batch 7.
    defs = {**{b: 3 for b in range(3, 7)}, **{b: 5 for b in range(7, 10)}}
    oracle = Oracle(generated, [(b, b) for b in range(10)], defs)
    oracle.run(7)
    off = {k: ks.last_seen for k, ks in oracle.state.keys.items() if ks.last_seen}
    rows, _ = oracle.step(7)
    touched = {r["key"] for r in rows if r["kind"] == "row"}
    for key, (value, _) in off.items():
        if key not in touched:
            assert oracle.state.keys[key].last_seen == (value, logical_now(7))
    assert Definition.of(oracle.state.definition).buckets
    for r in rows:
        if r["kind"] == "row":  # declared again: it starts empty, so only this batch's values
            assert all(int(b) == b for b, _ in json.loads(r["buckets"]))
    with pytest.raises(ValueError, match="only move on"):
        Oracle(generated, [(0, 0), (1, 1)], {0: 2, 1: 1}).run()


def test_the_state_readers_rows_are_read_under_the_definition(tmp_path):
    import pandas as pd

    frames = {
        "stats": pd.DataFrame({"key": ["a", "b"], "value": [
            {"n": 2, "lo": 1, "hi": 5, "last": 5}, {"n": 1, "lo": 3, "hi": 3, "last": None}]}),
        "last_seen": pd.DataFrame({"key": ["a"], "value": [4]}),
        "buckets": pd.DataFrame({"key": ["a"], "map_key": [1], "value": [7]}),
    }
    state = actual_state(frames, 9, definition=3)
    assert state["stats"] == {"a": (2, 1, 5, 5), "b": (1, 3, 3, None)}
    assert state["last_seen"] == {"a": 4}
    # buckets is dropped by definition 3: its rows are a state nobody expects.
    assert len(state["buckets"]) == 1
    assert compare_state({"stats": state["stats"], "last_seen": {"a": 4}}, state).unexpected == 1


def test_rows_and_state_entries_are_counted_by_identity():
    """Exactly-once accounting: a row or entry missing, one with another value, one not
    expected (a row as often as it appears), a row twice."""
    expected = [{"k": "a", "v": 1}, {"k": "b", "v": 2}, {"k": "c", "v": 3}, {"k": "d", "v": 4}]
    actual = pd.DataFrame({"k": ["a", "b", "d", "d", "x", "x"], "v": [1, 20, 4, 4, 9, 9]})
    rows = compare_rows(expected, actual, ["k"], ["k", "v"])
    assert (rows.expected, rows.actual, rows.missing, rows.wrong_value, rows.unexpected,
            rows.duplicated) == (4, 6, 1, 1, 2, 2)
    assert rows.violations == 6 and len(rows.examples) == 5

    state = compare_state({"s": {"a": [1, 2], "b": 2, "c": 3}, "gone": {"z": 0}},
                          {"s": {"a": (1, 2), "b": 20, "x": 9}, "new": {"y": 1}})
    assert (state.expected, state.actual, state.missing, state.wrong_value,
            state.unexpected) == (4, 4, 2, 1, 2)
    assert len(state.examples) == 5
