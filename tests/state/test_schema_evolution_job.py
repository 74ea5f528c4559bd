"""A job restarted with changed state descriptors continues (state schema evolution): every rule ×
backend × snapshot kind (checkpoint, native savepoint, canonical savepoint, the savepoints
rescaled), on the local runtime; the output equals pandas over the whole input. Incompatible changes
fail at job start, naming the field, with the checkpoint directory unchanged."""

from __future__ import annotations

import datetime as dt
import random
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.config import JobConfig
from keyedstate.errors import ConfigurationError, JobMismatchError, StateTypeMismatchError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.processor.canonical import read_range_tables
from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.runtime.local import LocalJob
from keyedstate.state.descriptors import StateTtlConfig, ValueStateDescriptor
from keyedstate.state.evolution import SchemaEvolution
from keyedstate.storage.handles import CheckpointMetadata
from tests.checkpoint.test_savepoints import files_under

pytestmark = pytest.mark.integration

INPUT = "user_id string, amount double"
OUTPUT = "user_id string, count bigint, total double, peak double"
V1 = "struct<count:int,total:double,peak:float,first:double>"

#: rule -> (new type, evolution, the name of the count field in the new type)
RULES: dict[str, tuple[str, SchemaEvolution | None, str]] = {
    "widen": ("struct<count:bigint,total:double,peak:double,first:double>", None, "count"),
    "add-nullable": ("struct<count:int,total:double,peak:float,first:double,note:string>",
                     None, "count"),
    "add-default": ("struct<count:int,total:double,peak:float,first:double,visits:bigint>",
                    SchemaEvolution(defaults={"visits": 0}), "count"),
    "remove-reorder": ("struct<peak:float,total:double,count:int>", None, "count"),
    "rename": ("struct<n:int,total:double,peak:float,first:double>",
               SchemaEvolution(renames={"n": "count"}), "n"),
}


class Totals(KeyedProcessFunction):
    """Running count, total and peak amount per user, in a struct state of a given type."""

    def __init__(self, type_: str = V1, evolution: SchemaEvolution | None = None,
                 count: str = "count", ttl: StateTtlConfig | None = None) -> None:
        self.type_, self.evolution, self.count, self.ttl = type_, evolution, count, ttl

    def open(self, ctx: Context) -> None:
        self.acc = ctx.get_state(ValueStateDescriptor("totals", self.type_, ttl=self.ttl,
                                                      evolution=self.evolution))

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> Any:
        acc = dict(self.acc.value() or {})
        amounts = rows.column("amount").to_pylist()
        acc[self.count] = (acc.get(self.count) or 0) + len(amounts)
        acc["total"] = (acc.get("total") or 0.0) + sum(amounts)
        acc["peak"] = max([acc.get("peak") or 0.0, *amounts])
        if "first" in acc and acc["first"] is None:
            acc["first"] = amounts[0]
        if "visits" in acc:
            assert acc["visits"] is not None, "the default was not applied"
            acc["visits"] += 1
        self.acc.update(acc)
        yield (key, acc[self.count], acc["total"], acc["peak"])


def _batches(n: int = 4, events: int = 200, users: int = 30) -> list[pa.Table]:
    rnd = random.Random(5)
    return [pa.table({"user_id": [f"u{rnd.randrange(users):02d}" for _ in range(events)],
                      # quarters: exact as float32 too (the peak starts as a float)
                      "amount": [rnd.randint(1, 400) / 4 for _ in range(events)]})
            for _ in range(n)]


def _oracle(batches: list[pa.Table]) -> list[tuple[Any, ...]]:
    """pandas over the whole input: each batch's users with their running aggregates."""
    frames = [b.to_pandas().assign(batch=i) for i, b in enumerate(batches)]
    df = pd.concat(frames, ignore_index=True)
    per_batch = df.groupby(["batch", "user_id"]).agg(n=("amount", "size"), s=("amount", "sum"),
                                                     m=("amount", "max")).reset_index()
    per_batch = per_batch.sort_values(["user_id", "batch"])
    g = per_batch.groupby("user_id")
    per_batch["count"] = g["n"].cumsum()
    per_batch["total"] = g["s"].cumsum()
    per_batch["peak"] = g["m"].cummax()
    return sorted((r.user_id, int(r.count), float(r.total), float(r.peak))
                  for r in per_batch.itertuples())


def _job(cfg: JobConfig, fn: Totals) -> LocalJob:
    return LocalJob(fn, key_columns=["user_id"], input_schema=INPUT, output_schema=OUTPUT,
                    config=cfg)


def _rows(outputs: list[dict[str, pa.Table]]) -> list[tuple[Any, ...]]:
    return sorted(tuple(r.values()) for out in outputs for r in out["main"].to_pylist())


def _first_run(tmp_path: Path, backend: str, kind: str, fn: Totals | None = None
               ) -> tuple[list[dict[str, pa.Table]], JobConfig]:
    """Two batches with ``fn`` (default: ``Totals`` of ``V1``), then a checkpoint or a stop with
    a savepoint of ``kind``; the config a restarted job uses to continue (a savepoint: in
    another directory, at parallelism 3)."""
    data = _batches()
    cfg = JobConfig(checkpoint_dir=str(tmp_path / "one"), backend=backend, parallelism=2)
    with _job(cfg, fn or Totals()) as job:
        outputs = [job.process_batch(t) for t in data[:2]]
        if kind == "checkpoint":
            return outputs, cfg
        job.stop(savepoint=str(tmp_path / "savepoint"),
                 format="canonical" if kind == "canonical" else "native")
    return outputs, JobConfig(checkpoint_dir=str(tmp_path / "two"), backend=backend,
                              parallelism=3, restore_path=str(tmp_path / "savepoint"))


KINDS = ["checkpoint", "native", "canonical"]


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_restarted_job_with_an_evolved_state_continues(tmp_path, backend, kind, rule):
    data = _batches()
    outputs, cfg = _first_run(tmp_path, backend, kind)
    type_, evolution, count = RULES[rule]
    with _job(cfg, Totals(type_, evolution, count)) as job:
        outputs += [job.process_batch(t) for t in data[2:3]]
    # The checkpoint after the migration restores with the new code alone (at parallelism 1).
    with _job(cfg.replace(parallelism=1), Totals(type_, evolution, count)) as job:
        outputs += [job.process_batch(t) for t in data[3:]]
    assert _rows(outputs) == _oracle(data)


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("new_type, evolution, field", [
    ("struct<count:string,total:double,peak:float,first:double>", None, "count"),
    ("struct<count:int,total:float,peak:float,first:double>", None, "total"),
    ("struct<n:int,total:double,peak:float,first:double>", None, "n"),
    ("struct<count:int,total:double,peak:float,first:double,v:bigint not null>", None, "v"),
], ids=["string-to-int", "narrowing", "rename-without-mapping", "not-null-without-default"])
def test_incompatible_change_fails_at_start_and_changes_nothing(tmp_path, backend, kind,
                                                                new_type, evolution, field):
    _, cfg = _first_run(tmp_path, backend, kind)
    roots = [tmp_path / "one"] + ([tmp_path / "savepoint"] if kind != "checkpoint" else [])
    before = [files_under(str(r)) for r in roots]
    if "not null" in new_type:
        new_type = pa.struct([pa.field("count", pa.int32()), pa.field("total", pa.float64()),
                              pa.field("peak", pa.float32()), pa.field("first", pa.float64()),
                              pa.field("v", pa.int64(), nullable=False)])
    with pytest.raises(StateTypeMismatchError, match=f"'{field}'") as info:
        _job(cfg, Totals(new_type, evolution))
    assert "'totals'" in str(info.value)
    assert [files_under(str(r)) for r in roots] == before
    assert not (tmp_path / "two").exists() or not any((tmp_path / "two").rglob("_metadata"))


class Two(Totals):
    """``Totals`` plus a second state, ``extra``: the batches each user appeared in."""

    def open(self, ctx: Context) -> None:
        super().open(ctx)
        self.extra = ctx.get_state(ValueStateDescriptor("extra", "bigint"))

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> Any:
        self.extra.update((self.extra.value() or 0) + 1)
        yield from super().process_key(key, rows, ctx)


class OnlyExtra(KeyedProcessFunction):
    def open(self, ctx: Context) -> None:
        self.extra = ctx.get_state(ValueStateDescriptor("extra", "bigint"))

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> Any:
        yield (key, self.extra.value(), 0.0, 0.0)


def _state_names(metadata: CheckpointMetadata) -> set[str]:
    return {m.name for h in metadata.handles for m in h.states}


def _values(path: str, state: str) -> dict[Any, Any]:
    """Every key's value of a value ``state`` in the snapshot at ``path``."""
    snapshot = resolve_snapshot(path)
    everything = KeyGroupRange(0, snapshot.metadata.max_parallelism - 1)
    tables = list(read_range_tables(snapshot, everything, state, now_ms=time.time_ns() // 10**6))
    rows = pa.concat_tables(tables).to_pylist() if tables else []
    return {r["user_id"]: r["value"] for r in rows}


def test_states_added_kept_and_dropped(tmp_path):
    """A new descriptor starts empty; a state no descriptor asks for is kept until listed in
    drop_states; a state both declared and listed to drop is refused at start."""
    data = _batches()
    cfg = JobConfig(checkpoint_dir=str(tmp_path / "ckpt"), backend="rocksdb", parallelism=2)
    with _job(cfg, Totals()) as job:
        outputs = [job.process_batch(t) for t in data[:2]]
    with _job(cfg, Two()) as job:  # "extra" is new: starts empty
        outputs += [job.process_batch(t) for t in data[2:3]]
    assert _rows(outputs) == _oracle(data[:3])
    with _job(cfg, OnlyExtra()) as job:  # "totals" kept though nobody asks for it
        job.process_batch(data[3])
    states = {m.name for h in job.latest_checkpoint.metadata.handles for m in h.states}
    assert states == {"totals", "extra"}
    with pytest.raises(ConfigurationError, match="drop"):
        _job(cfg.replace(drop_states=("extra",)), OnlyExtra())
    with _job(cfg.replace(drop_states="totals"), OnlyExtra()) as job:
        job.process_batch(data[3])
        states = {m.name for h in job.latest_checkpoint.metadata.handles for m in h.states}
    assert states == {"extra"}
    # Totals now shares no state with the directory's job: another job, refused at start;
    # restarted on purpose, it finds its state gone and starts empty.
    with pytest.raises(JobMismatchError, match=r"states \['extra'\] -> \['totals'\]"):
        _job(cfg, Totals())
    with _job(cfg.replace(allow_job_change=True), Totals()) as job:
        again = _rows([job.process_batch(data[0])])
    assert again == _oracle(data[:1])


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("kind", KINDS)
def test_dropped_state_goes_and_the_others_continue(tmp_path, backend, kind):
    """drop_states on each backend, from each snapshot kind (a savepoint restored at another
    parallelism): the restarted job's checkpoints no longer hold the state, the kept state
    carries on (output equals pandas), the snapshot restored from is unchanged, the option
    left in the configuration does nothing afterwards, and the state declared again starts
    empty."""
    data = _batches()
    outputs, cfg = _first_run(tmp_path, backend, kind, Two())
    source = cfg.restore_path or cfg.checkpoint_dir
    assert _state_names(resolve_snapshot(source).metadata) == {"totals", "extra"}
    savepoint_files = files_under(source) if kind != "checkpoint" else None
    dropping = cfg.replace(drop_states="extra")
    with _job(dropping, Totals()) as job:
        outputs.append(job.process_batch(data[2]))
        assert job.latest_checkpoint is not None
        assert _state_names(job.latest_checkpoint.metadata) == {"totals"}
    assert _rows(outputs) == _oracle(data[:3])
    if savepoint_files is not None:  # NO_CLAIM: the savepoint still holds both states
        assert files_under(source) == savepoint_files
        assert _state_names(resolve_snapshot(source).metadata) == {"totals", "extra"}
    # Still listed, at parallelism 1: nothing to drop any more, the totals go on.
    with _job(dropping.replace(parallelism=1), Totals()) as job:
        outputs.append(job.process_batch(data[3]))
    assert _rows(outputs) == _oracle(data)
    # Declared again (no longer listed): it starts empty, the totals go on.
    with _job(cfg, Two()) as job:
        outputs.append(job.process_batch(data[0]))
        assert job.latest_checkpoint is not None
        assert _state_names(job.latest_checkpoint.metadata) == {"totals", "extra"}
    assert _values(cfg.checkpoint_dir, "extra") == {u: 1 for u in data[0]["user_id"].to_pylist()}
    assert _rows(outputs) == _oracle(data + data[:1])


def test_open_that_fails_at_start_is_reported_with_its_cause(tmp_path):
    class Broken(Totals):
        def open(self, ctx: Context) -> None:
            raise RuntimeError("needs the executor's GPU")

    cfg = JobConfig(checkpoint_dir=str(tmp_path / "ckpt"), backend="heap", parallelism=1)
    with pytest.raises(ConfigurationError, match="open\\(\\) failed when run at job start") as e:
        _job(cfg, Broken())
    assert isinstance(e.value.__cause__, RuntimeError)


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("kind", KINDS)
def test_ttl_switched_on_then_off_keeps_the_state(tmp_path, backend, kind):
    """TTL switched on stamps the restored values with the restore time (a day to live: the
    job goes on with its totals); switched off again, the timestamps go and the values stay."""
    data = _batches()
    outputs, cfg = _first_run(tmp_path, backend, kind)
    day = StateTtlConfig(dt.timedelta(days=1))
    with _job(cfg, Totals(RULES["widen"][0], ttl=day)) as job:
        outputs += [job.process_batch(t) for t in data[2:3]]
    with _job(cfg.replace(parallelism=1), Totals(RULES["widen"][0])) as job:
        outputs += [job.process_batch(t) for t in data[3:]]
    assert _rows(outputs) == _oracle(data)
