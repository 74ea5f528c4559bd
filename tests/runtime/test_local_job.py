"""The local runtime runs a KeyedProcessFunction as Spark does (no Java): timers, late rows,
restore and rescale from checkpoints and savepoints, on real RocksDB and heap state."""

from __future__ import annotations

import random
from typing import Any

import pyarrow as pa
import pytest

from keyedstate.config import JobConfig
from keyedstate.errors import BatchFailedError, ConfigurationError, JobDrainedError
from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.runtime.local import LocalJob
from tests.spark.jobs import COUNT_SCHEMA, IDLE_AFTER_MS, IDLE_SCHEMA, FailOnKey, IdleCounts

pytestmark = pytest.mark.integration

INPUT = "user_id string, ts timestamp, amount double"
T0 = 1_700_000_000_000  # ms


def batches(n: int, events: int = 300, users: int = 25, seed: int = 7) -> list[pa.Table]:
    """``n`` batches 5 s of event time apart; rows up to 3 s out of order, so with a 1 s
    watermark delay some of them are late."""
    rng = random.Random(seed)
    out = []
    for b in range(n):
        ts = [T0 + b * 5000 + rng.randint(0, 4000) - rng.randint(0, 3000) for _ in range(events)]
        out.append(pa.table({
            "user_id": [f"u{rng.randrange(users):03d}" for _ in range(events)],
            "ts": pa.array([t * 1000 for t in ts], pa.timestamp("us", tz="UTC")),
            "amount": [1.0] * events,
        }))
    return out


def config(root: Any, **changes: Any) -> JobConfig:
    base = dict(checkpoint_dir=str(root / "ckpt"), parallelism=2, backend="rocksdb",
                watermark_column="ts", watermark_delay=1000, late_events="side-output")
    return JobConfig(**{**base, **changes})


def new_job(cfg: JobConfig, fn: KeyedProcessFunction | None = None) -> LocalJob:
    return LocalJob(fn or IdleCounts(), key_columns=["user_id"], input_schema=INPUT,
                    output_schema=COUNT_SCHEMA, side_outputs={"idle": IDLE_SCHEMA}, config=cfg)


def rows(outputs: list[dict[str, pa.Table]]) -> dict[str, list[tuple]]:
    """Every output's rows over several batches, sorted (order across subtasks is free)."""
    merged: dict[str, list[tuple]] = {}
    for out in outputs:
        for tag, table in out.items():
            merged.setdefault(tag, []).extend(tuple(r.values()) for r in table.to_pylist())
    return {tag: sorted(values, key=repr) for tag, values in merged.items()}


def reference(tmp_path: Any, data: list[pa.Table], backend: str) -> dict[str, list[tuple]]:
    """The outputs of one uninterrupted run at parallelism 1, drained at the end."""
    with new_job(config(tmp_path / "reference", parallelism=1, backend=backend)) as job:
        outputs = [job.process_batch(t) for t in data]
        outputs.append(job.drain())
    return rows(outputs)


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_timers_and_late_rows_as_on_spark(tmp_path, backend):
    cfg = config(tmp_path, backend=backend, watermark_delay=0)
    with new_job(cfg) as job:
        def batch(*events: tuple[str, int]) -> dict[str, list[tuple]]:
            table = pa.table({"user_id": [e[0] for e in events],
                              "ts": pa.array([(T0 + e[1]) * 1000 for e in events],
                                             pa.timestamp("us", tz="UTC")),
                              "amount": [1.0] * len(events)})
            return rows([job.process_batch(table)])

        first = batch(("a", 100), ("b", 105), ("a", 101))
        assert first["main"] == [("a", 2, 0.0, 0), ("b", 1, 0.0, 0)]
        assert first["idle"] == [] and first["late-events"] == []
        # The watermark is now T0 + 105: an older row is late (a side output, not counted).
        second = batch(("a", 50), ("c", 20_000))
        assert second["main"] == [("c", 1, 0.0, 1)]
        assert [r[0] for r in second["late-events"]] == ["a"]
        # Watermark T0 + 20000: the timers of a and b (their last event + 10 s) fire first.
        third = batch(("a", 20_001))
        assert third["idle"] == [("a", T0 + 101 + IDLE_AFTER_MS, 2),
                                 ("b", T0 + 105 + IDLE_AFTER_MS, 1)]
        assert third["main"] == [("a", 3, 0.0, 2)]
        # Drain: the watermark goes to +infinity, every timer fires; no batch after it.
        drained = rows([job.drain()])
        assert drained["idle"] == [("a", T0 + 20_001 + IDLE_AFTER_MS, 3),
                                   ("c", T0 + 20_000 + IDLE_AFTER_MS, 1)]
        with pytest.raises(JobDrainedError):
            job.process_batch(pa.table({"user_id": ["a"], "ts": [None], "amount": [1.0]}))
    with pytest.raises(JobDrainedError, match="stopped with drain"):
        new_job(cfg)


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_restore_from_own_checkpoint_at_another_parallelism(tmp_path, backend):
    data = batches(4)
    cfg = config(tmp_path, backend=backend, parallelism=2)
    with new_job(cfg) as job:
        outputs = [job.process_batch(t) for t in data[:2]]
    with new_job(cfg.replace(parallelism=3)) as job:
        assert job.last_batch_id == 1
        outputs += [job.process_batch(t) for t in data[2:]]
        outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data, backend)


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
@pytest.mark.parametrize("mode,fmt", [("NO_CLAIM", "native"), ("CLAIM", "native"),
                                      ("NO_CLAIM", "canonical")])
def test_restore_from_savepoint_at_another_parallelism(tmp_path, backend, mode, fmt):
    data = batches(4)
    with new_job(config(tmp_path / "one", backend=backend, parallelism=2)) as job:
        outputs = [job.process_batch(t) for t in data[:2]]
        savepoint = job.stop(savepoint=str(tmp_path / "savepoint"), format=fmt)
    assert savepoint is not None
    cfg = config(tmp_path / "two", backend=backend, parallelism=3,
                 restore_path=str(tmp_path / "savepoint"), restore_mode=mode)
    with new_job(cfg) as job:
        assert (job.last_batch_id, job.share_restored_files) == (1, mode == "CLAIM")
        outputs += [job.process_batch(t) for t in data[2:3]]
    # A restart recovers the job's own checkpoint (at yet another parallelism).
    with new_job(cfg.replace(parallelism=1)) as job:
        outputs += [job.process_batch(t) for t in data[3:]]
        outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data, backend)


def test_function_error_names_batch_and_key_and_leaves_the_last_checkpoint(tmp_path):
    good, bad = batches(2)[0], "bad-user"
    with new_job(config(tmp_path, watermark_column=None), FailOnKey(bad)) as job:
        job.process_batch(good)
        failing = pa.concat_tables([good, pa.table({"user_id": [bad], "ts": good["ts"][:1],
                                                    "amount": [1.0]}).cast(good.schema)])
        with pytest.raises(BatchFailedError, match=f"batch 1.*{bad}") as failure:
            job.process_batch(failing)
        assert failure.value.key == repr(bad)
        assert job.latest_checkpoint is not None and job.last_batch_id == 0
        # The batch without the bad key runs from the last checkpoint: counts doubled once.
        counts = job.process_batch(good)["main"].column("count").to_pylist()
        assert job.last_batch_id == 1 and all(c % 2 == 0 for c in counts)


def test_input_without_a_key_column_is_refused(tmp_path):
    class Nothing(KeyedProcessFunction):
        def process_element(self, row: dict[str, Any], ctx: Context) -> None:
            return None

    with pytest.raises(ConfigurationError, match="user"):
        LocalJob(Nothing(), key_columns=["user"], input_schema=INPUT,
                 output_schema=COUNT_SCHEMA, config=config(tmp_path))


@pytest.mark.parametrize("backend, options, unknown", [
    ("rocksdb", {"key_group_shards": 4}, "'key_group_shards'"),  # a RocksDBOptions field
    ("heap", {"max_chain_lenght": 3}, "'max_chain_lenght'"),
])
def test_an_unknown_backend_option_is_refused_at_start(tmp_path, backend, options, unknown):
    """A misspelled or misplaced ``keyedstate.backend.options`` entry is a ConfigurationError
    naming it and what the backend takes, before anything is written."""
    with pytest.raises(ConfigurationError, match=f"no option {unknown}.*it takes") as refused:
        new_job(config(tmp_path, backend=backend, backend_options=options))
    assert not isinstance(refused.value.__cause__, TypeError)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_routing_hashes_each_distinct_key_as_each_row(tmp_path):
    """A single key column is hashed once per distinct key (nulls included), with the key
    group each row would get."""
    with new_job(config(tmp_path, parallelism=3)) as job:
        users = ["u1", None, "u2", "u1", None, "ü" * 40]
        table = pa.table({"user_id": users, "ts": pa.array([None] * 6, pa.timestamp("us", "UTC")),
                          "amount": [1.0] * 6})
        routed = job._route(table)
        expected = [job.key_serializer.key_group(u, job.max_parallelism) for u in users]
        assert routed.column("_ks_key_group").to_pylist() == expected
        assert routed.column("_ks_subtask").to_pylist() == [
            kg * 3 // job.max_parallelism for kg in expected]


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_a_row_without_an_event_time_is_never_late_even_beside_late_rows(tmp_path, backend):
    from keyedstate_benchmarks.throughput import OUTPUT_DDL, KeyedCount

    cfg = config(tmp_path, backend=backend, parallelism=1, watermark_delay=0)
    with LocalJob(KeyedCount(), key_columns=["user_id"], input_schema=INPUT,
                  output_schema=OUTPUT_DDL, config=cfg) as job:
        def batch(*events: tuple[str, int | None]) -> dict[str, list[tuple]]:
            table = pa.table({"user_id": [e[0] for e in events],
                              "ts": pa.array([None if e[1] is None else (T0 + e[1]) * 1000
                                              for e in events], pa.timestamp("us", tz="UTC")),
                              "amount": [1.0] * len(events)})
            return rows([job.process_batch(table)])

        assert batch(("a", 100), ("b", 105))["main"] == [("a", 1), ("b", 1)]
        # Watermark T0 + 105: a's row is late (the side output); b's row has no event time
        # and counts, in the same subtask as the late row.
        second = batch(("a", 50), ("b", None))
        assert second["main"] == [("b", 2)]
        assert [r[0] for r in second["late-events"]] == ["a"]
