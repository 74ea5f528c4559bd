"""End-to-end tests of keyed jobs on Spark (local[2,4]), against pandas over the input."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.config import JobConfig
from keyedstate.errors import BatchFailedError, ConfigurationError
from keyedstate.spark.api import key_by
from keyedstate.spark.sinks import ParquetSink
from tests.spark.jobs import (
    COUNT_SCHEMA,
    FailingSink,
    FailOnKey,
    KillWorkerOnce,
    MisspelledOutput,
    PerElementTotals,
    RunningTotals,
    VectorizedTotals,
    WrongOutput,
    write_batch_file,
)

pytestmark = pytest.mark.spark

SCHEMA = "user_id string, ts timestamp, amount double"


def write_files(directory: str, files: int, events: int = 1500, users: int = 150,
                seed: int = 1, first: int = 0) -> None:
    """``files`` Parquet files of events; modification times increase so that the file source
    takes them in order, one per batch."""
    rng = random.Random(seed + first)
    for n in range(first, first + files):
        write_batch_file(directory, n, pa.table({
            "user_id": [f"u{rng.randrange(users):04d}" for _ in range(events)],
            "ts": pa.array([1_700_000_000_000_000 + n * 10**9 + i for i in range(events)],
                           pa.timestamp("us", tz="UTC")),
            "amount": [round(rng.uniform(0, 10), 2) for _ in range(events)],
        }))


def run_job(spark: Any, root: str, fn: Any, parallelism: int, backend: str = "rocksdb",
            extra_sinks: tuple[Any, ...] = (), out: str | None = None, **config: Any) -> Any:
    events = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
              .parquet(os.path.join(root, "input")))
    job = key_by(events, "user_id").process(fn, COUNT_SCHEMA)
    job.sink(ParquetSink(out or os.path.join(root, "out")))
    for sink in extra_sinks:
        job.sink(sink)
    query = job.start(JobConfig(checkpoint_dir=os.path.join(root, "ckpt"),
                                parallelism=parallelism, backend=backend, **config),
                      trigger={"availableNow": True},
                      spark_checkpoint_location=os.path.join(root, "spark"))
    query.await_termination()
    query.stop()
    return query


def committed_and_aborted(root: Any) -> tuple[list[str], list[str]]:
    """The ``chk-N`` directories of a job's checkpoint directory: committed ones (with
    ``_metadata``) and aborted ones (only their tombstone ``_aborted`` left: ids are never
    reused, docs/checkpoints.md)."""
    dirs = sorted(root.glob("chk-*"))
    committed = [p.name for p in dirs if (p / "_metadata").exists()]
    aborted = [p.name for p in dirs if [f.name for f in p.iterdir()] == ["_aborted"]]
    assert len(committed) + len(aborted) == len(dirs), dirs
    return committed, aborted


def check_against_pandas(root: str, out: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every output row (``out``, default: the ParquetSink's files in ``<root>/out``) equals
    the running totals over the input files up to its batch, and each (user, batch) appears
    exactly once: nothing lost, nothing doubled."""
    files = sorted(os.listdir(os.path.join(root, "input")))
    if out is None:
        out = pd.read_parquet(os.path.join(root, "out"))
    assert not out.duplicated(["user_id", "batch_id"]).any()
    seen: list[pd.DataFrame] = []
    expected_rows = 0
    for batch_id, name in enumerate(files):
        batch = pd.read_parquet(os.path.join(root, "input", name))
        seen.append(batch[["user_id", "amount"]])
        cumulative = pd.concat(seen).groupby("user_id")["amount"].agg(["size", "sum"])
        got = out[out.batch_id == batch_id].set_index("user_id").sort_index()
        assert list(got.index) == sorted(batch.user_id.unique()), f"batch {batch_id}"
        assert (got["count"] == cumulative.loc[got.index, "size"]).all()
        assert ((got["total"] - cumulative.loc[got.index, "sum"]).abs() < 1e-6).all()
        expected_rows += batch.user_id.nunique()
    assert len(out) == expected_rows
    return out


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_results_equal_pandas(spark, tmp_path, backend):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    query = run_job(spark, root, RunningTotals(), parallelism=2, backend=backend)
    check_against_pandas(root)
    stats = [s for s in query.stats if s.checkpoint_id >= 0]
    assert len(stats) == 3
    assert all(s.full_bytes > 0 and len(s.state_bytes_per_subtask) == 2 for s in stats)
    assert stats[0].restored_subtasks == 2  # nothing to reuse in the first batch


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_vectorized_path_equals_pandas(spark, tmp_path, backend):
    """process_batch with bulk state calls and Arrow output, on Spark, over 3 batches; then a
    restart at another parallelism continues its state."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    run_job(spark, root, VectorizedTotals(), parallelism=2, backend=backend)
    write_files(os.path.join(root, "input"), 1, first=3)
    run_job(spark, root, VectorizedTotals(), parallelism=3, backend=backend)
    check_against_pandas(root)


def test_process_element_path(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    run_job(spark, root, PerElementTotals(), parallelism=2)
    check_against_pandas(root)


@pytest.mark.parametrize("new_parallelism", [1, 3, 8])
def test_restart_at_another_parallelism(spark, tmp_path, new_parallelism):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    run_job(spark, root, RunningTotals(), parallelism=2)
    write_files(os.path.join(root, "input"), 2, first=2)
    query = run_job(spark, root, RunningTotals(), parallelism=new_parallelism)
    check_against_pandas(root)
    first = [s for s in query.stats if s.checkpoint_id >= 0][0]
    assert first.restored_subtasks == new_parallelism
    assert len(first.state_bytes_per_subtask) == new_parallelism


@pytest.mark.parametrize("spark_tasks", [None, 1, 5])
def test_subtasks_grouped_into_fewer_spark_tasks(spark, tmp_path, spark_tasks):
    """5 subtasks in the cluster's 2 task slots (default), in 1 Spark task, or 1 per subtask:
    the same results and one snapshot per subtask; restarting at 3 regroups them."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    query = run_job(spark, root, RunningTotals(), parallelism=5, spark_tasks=spark_tasks)
    stats = [s for s in query.stats if s.checkpoint_id >= 0]
    assert {s.spark_tasks for s in stats} == {spark_tasks or 2}
    assert all(len(s.state_bytes_per_subtask) == 5 and all(s.state_bytes_per_subtask)
               for s in stats)
    write_files(os.path.join(root, "input"), 2, first=2)
    query = run_job(spark, root, RunningTotals(), parallelism=3, spark_tasks=spark_tasks)
    check_against_pandas(root)
    assert {s.spark_tasks for s in query.stats if s.checkpoint_id >= 0} == \
        {min(3, spark_tasks or 2)}


@pytest.mark.parametrize("parallelism", [2, 4])  # 4: two subtasks per Spark task
def test_user_function_error_names_batch_subtask_and_key_then_resumes(spark, tmp_path,
                                                                      parallelism):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 1)
    run_job(spark, root, RunningTotals(), parallelism=parallelism)
    write_files(os.path.join(root, "input"), 1, first=1)
    bad_key = pd.read_parquet(os.path.join(root, "input", "part-001.parquet")).user_id.iloc[0]
    with pytest.raises(BatchFailedError) as failure:
        run_job(spark, root, FailOnKey(bad_key), parallelism=parallelism)
    text = str(failure.value)
    assert "batch 1" in text and "subtask" in text and bad_key in text
    assert "cannot handle" in text
    # The last committed checkpoint is intact: a fixed job resumes from it.
    run_job(spark, root, RunningTotals(), parallelism=parallelism)
    check_against_pandas(root)


@pytest.mark.parametrize(("fn", "complaint"), [
    (WrongOutput(), "field 'count' is int64, got 'not a number'"),
    (MisspelledOutput(), "field 'totl' is not in the output schema"),
])
def test_output_not_matching_schema_stops_with_clear_error(spark, tmp_path, fn, complaint):
    """The error names the batch, the subtask, the output, the row's key and the field; a
    misspelled field is an error, not a column of nulls."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 1)
    with pytest.raises(BatchFailedError) as failure:
        run_job(spark, root, fn, parallelism=2)
    text = str(failure.value)
    assert re.match(r"batch 0, subtask \d: staging the output failed with OutputSchemaError: "
                    r"output 'main', row 0 \(key 'u\d{4}'\): ", text), text
    assert complaint in text
    assert not os.path.exists(os.path.join(root, "out"))


def test_missing_key_column(spark):
    df = spark.createDataFrame([("a", 1.0)], "user_id string, amount double")
    with pytest.raises(ConfigurationError, match="not in the DataFrame"):
        key_by(df, "customer")


@pytest.mark.parametrize("parallelism", [2, 4])  # 4: a kill takes a group of two subtasks
def test_killed_python_worker_mid_batch_exactly_once(spark, tmp_path, parallelism):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    markers = tmp_path / "markers"
    markers.mkdir()
    query = run_job(spark, root, KillWorkerOnce(batch_id=1, marker_dir=str(markers)),
                    parallelism=parallelism)
    assert list(markers.iterdir()), "the worker was never killed: the test proved nothing"
    assert {s.spark_tasks for s in query.stats if s.checkpoint_id >= 0} == {2}
    check_against_pandas(root)


def test_killed_python_worker_leaves_no_working_directory(spark, tmp_path):
    """A killed worker can't close its RocksDB instances: its directory
    (``worker-<pid>-<start time>`` below ``state.backend.local-dir``) is removed by the next
    process that creates its own there; instance directories never lie directly in it."""
    from keyedstate.backends.rocksdb import RocksDBStateBackend
    from keyedstate.keygroups import KeyGroupRange
    from keyedstate.keys import KeySerializer

    root = str(tmp_path)
    local = os.path.join(root, "local")
    write_files(os.path.join(root, "input"), 3)
    markers = tmp_path / "markers"
    markers.mkdir()
    run_job(spark, root, KillWorkerOnce(batch_id=1, marker_dir=str(markers)), parallelism=2,
            local_dir=local)
    killed = [int(m.read_text()) for m in markers.iterdir()]
    assert killed, "the worker was never killed: the test proved nothing"
    check_against_pandas(root)
    assert all(name.startswith("worker-") for name in os.listdir(local)), os.listdir(local)
    from keyedstate.backends.base.working_dirs import process_start_time

    # This process creates its directory there: every directory of an ended process goes.
    backend = RocksDBStateBackend().create_keyed_backend(KeyedStateBackendParameters(
        subtask_index=0, key_group_range=KeyGroupRange(0, 127), max_parallelism=128,
        key_serializer=KeySerializer(["string"]), local_dir=local))
    backend.close()
    me = f"worker-{os.getpid()}-{process_start_time(os.getpid())}"
    assert me in os.listdir(local)
    for name in os.listdir(local):
        assert int(name.split("-")[1]) not in killed, f"{name}: the killed worker's is left"


@given(st.integers(1, 300).flatmap(lambda p: st.tuples(st.just(p), st.integers(1, p))))
def test_spark_tasks_run_every_subtask_once_in_balanced_contiguous_groups(p_and_tasks):
    from keyedstate.runtime.grouping import subtasks_of_task

    parallelism, tasks = p_and_tasks
    groups = [subtasks_of_task(t, tasks, parallelism) for t in range(tasks)]
    assert [i for g in groups for i in g] == list(range(parallelism))
    assert max(map(len, groups)) - min(map(len, groups)) <= 1
    # the driver's routing expression sends subtask i to task i * tasks div p
    assert all(i * tasks // parallelism == t for t, g in enumerate(groups) for i in g)


def test_live_state_cache_is_bounded(tmp_path, monkeypatch):
    """A Python worker keeps at most ``MAX_LIVE`` live backends, or twice the subtasks of a
    Spark task if more (least recently used closed, its directory deleted), and closes those
    of other jobs idle for ``LIVE_IDLE_S``."""
    from collections import OrderedDict

    from keyedstate.backends.rocksdb import RocksDBStateBackend
    from keyedstate.checkpoint.properties import MIN_WATERMARK
    from keyedstate.config import LateEvents
    from keyedstate.runtime import live_copies
    from keyedstate.runtime import subtask as runtime
    from keyedstate.storage.checkpoint_storage import CheckpointStorage

    monkeypatch.setattr(live_copies, "MAX_LIVE", 2)
    monkeypatch.setattr(live_copies, "LIVE", OrderedDict())

    def run(job: str, index: int = 0, parallelism: int = 1, spark_tasks: int | None = None
            ) -> str:
        plan = runtime.BatchPlan(
            job_id=job, start_id="start", batch_id=0, checkpoint_id=1, parallelism=parallelism,
            spark_tasks=spark_tasks, max_parallelism=128,
            key_columns=["user_id"], key_types=["string"], backend=RocksDBStateBackend(),
            storage=CheckpointStorage(str(tmp_path / job)), function=RunningTotals(),
            output_schema=pa.schema([("user_id", pa.string())]), side_output_schemas={},
            watermark=MIN_WATERMARK, watermark_column=None,
            late_events=LateEvents.DROP, restore=None,
            share_restored_files=True, local_dir=str(tmp_path / "local"))
        list(runtime.process_subtask(plan, index, iter([])))
        return live_copies.LIVE[(job, index)].backend.instance_dir  # type: ignore[attr-defined]

    try:
        dirs = [run(f"job-{n}") for n in range(4)]
        assert list(live_copies.LIVE) == [("job-2", 0), ("job-3", 0)]
        assert [os.path.exists(d) for d in dirs] == [False, False, True, True]
        monkeypatch.setattr(live_copies, "LIVE_IDLE_S", 0.0)
        last = run("job-4")
        assert list(live_copies.LIVE) == [("job-4", 0)]
        assert [os.path.exists(d) for d in [*dirs, last]] == [False] * 4 + [True]
        # 4 subtasks in one Spark task: twice the group is kept, not MAX_LIVE
        group = [run("job-5", i, parallelism=4, spark_tasks=1) for i in range(4)]
        assert list(live_copies.LIVE) == [("job-5", i) for i in range(4)]  # job-4 idle: closed
        assert all(os.path.exists(d) for d in group)
    finally:
        live_copies.close_all_live()
    assert not os.path.exists(last)


def test_lost_metadata_of_the_only_checkpoint_fails_the_start(spark, tmp_path):
    """num_retained=1 and the latest ``_metadata`` deleted: the restarted job refuses to start
    (as the core runtime does) instead of starting from empty state and waiting for the next
    batch to notice the gap; with an older retained checkpoint it falls back and says so."""
    from keyedstate.errors import MissingCheckpointFileError

    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    query = run_job(spark, root, RunningTotals(), parallelism=2)
    latest = query.stats[-1].checkpoint_id
    os.remove(os.path.join(root, "ckpt", f"chk-{latest}", "_metadata"))
    with pytest.raises(MissingCheckpointFileError, match=f"lost its checkpoints.*chk-{latest}/"):
        run_job(spark, root, RunningTotals(), parallelism=2)


def test_driver_crash_between_checkpoint_and_sink_commit(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    crash = FailingSink(os.path.join(root, "out2"), 1, str(tmp_path / "crashed"))
    with pytest.raises(BatchFailedError, match="^batch 1: RuntimeError: driver stopped") as failure:
        run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(crash,))
    # the sink's own frame, not the driver's
    assert 'jobs.py", line' in str(failure.value) and "in commit" in str(failure.value)
    query = run_job(spark, root, RunningTotals(), parallelism=2, extra_sinks=(crash,))
    assert query.stats[0].skipped_replay, "batch 1 must be replayed from its checkpoint"
    out = check_against_pandas(root)
    out2 = pd.read_parquet(os.path.join(root, "out2"))
    pd.testing.assert_frame_equal(
        out.sort_values(["batch_id", "user_id"]).reset_index(drop=True),
        out2.sort_values(["batch_id", "user_id"]).reset_index(drop=True))


def test_two_jobs_writing_to_one_parquet_sink_path_keep_all_their_batches(spark, tmp_path):
    """Two jobs (own checkpoint directories and Spark checkpoint locations: batch ids from 0
    in both) share one output path: each one's batches are in directories named by its
    streaming query's id, and neither touches the other's."""
    import pyarrow.dataset as ds

    out = str(tmp_path / "out")
    queries = {}
    for job, seed in (("a", 1), ("b", 2)):
        write_files(str(tmp_path / job / "input"), 2, seed=seed)
        queries[job] = run_job(spark, str(tmp_path / job), RunningTotals(), parallelism=2,
                               out=out)
    assert len(pd.read_parquet(out)) == sum(  # every row of both jobs
        pd.read_parquet(str(tmp_path / job / "input" / name)).user_id.nunique()
        for job in queries for name in os.listdir(tmp_path / job / "input"))
    lineages = {job: str(q.query.id) for job, q in queries.items()}
    assert lineages["a"] != lineages["b"]
    assert sorted(d for d in os.listdir(out) if not d.startswith("_")) == sorted(
        f"{lineage}-batch-{b:010d}" for lineage in lineages.values() for b in (0, 1))
    files = ds.dataset(out, format="parquet").files
    for job, lineage in lineages.items():
        mine = [f for f in files if os.path.basename(os.path.dirname(f)).startswith(lineage)]
        check_against_pandas(str(tmp_path / job),
                             pd.concat(pd.read_parquet(f) for f in mine).reset_index(drop=True))


def test_another_job_on_a_checkpoint_directory_is_refused_at_start(spark, tmp_path):
    """A function whose states share nothing with the directory's job is refused by start(),
    naming the recorded job and the ways out, before anything is written; the directory's
    own job then restarts, with a restore path (its own directory) or not: own checkpoints
    win, and the restart resumes from them."""
    from keyedstate.errors import JobMismatchError
    from tests.spark.jobs import IdleCounts

    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 1)
    run_job(spark, root, RunningTotals(), parallelism=2)
    ckpt = os.path.join(root, "ckpt")
    before = sorted((d, f) for d, _, fs in os.walk(ckpt) for f in fs)
    with pytest.raises(JobMismatchError, match=r"states \['totals'\].*allow-job-change"):
        run_job(spark, root, IdleCounts(), parallelism=2)
    assert sorted((d, f) for d, _, fs in os.walk(ckpt) for f in fs) == before
    write_files(os.path.join(root, "input"), 1, first=1)
    run_job(spark, root, RunningTotals(), parallelism=2, restore_path=ckpt)
    check_against_pandas(root)


def test_demo_end_to_end_with_savepoint_rescale_and_drain(spark, tmp_path):
    from examples.click_sessions import run_spark

    report = run_spark(spark, str(tmp_path / "demo"), events=6000, users=80, files=4)
    assert report.verified, report.checks
    assert os.path.exists(report.savepoint)
    assert report.batches == 4 + 1  # four files and the drain


def test_unreadable_checkpoint_stops_with_the_file_named(spark, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 1)
    run_job(spark, root, RunningTotals(), parallelism=2)
    shared = sorted((tmp_path / "ckpt" / "shared").iterdir())
    assert shared
    shared[0].unlink()
    write_files(os.path.join(root, "input"), 1, first=1)
    # Another parallelism forces every subtask to restore from storage (no live copy fits).
    with pytest.raises(Exception, match="MissingCheckpointFileError") as failure:
        run_job(spark, root, RunningTotals(), parallelism=3)
    assert shared[0].name in str(failure.value) and "batch 1" in str(failure.value)
    # Nothing committed was lost or replaced: checkpoint 1 is still the latest.
    assert committed_and_aborted(tmp_path / "ckpt") == (["chk-1"], ["chk-2"])


LOCAL_CLUSTER_SCRIPT = """
import json, os, sys
from keyedstate.spark.session import local_session
from examples.click_sessions import run_spark
spark = local_session("local-cluster[2,1,1024]", "keyedstate-local-cluster")
report = run_spark(spark, sys.argv[1], events=6000, users=80, files=4)
print(json.dumps({"verified": report.verified, "batches": report.batches}))
spark.stop()
"""


@pytest.mark.slow
def test_local_cluster_two_executors(tmp_path):
    """The demo job on two executor JVMs (separate processes, own Python workers)."""
    result = subprocess.run(
        [sys.executable, "-c", LOCAL_CLUSTER_SCRIPT, str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["batches"] == 5 and summary["verified"], summary


KILL_EXECUTOR_SCRIPT = """
import os, sys
from keyedstate.spark.session import local_session
from tests.spark.jobs import KillExecutorOnce
from tests.spark.test_job import check_against_pandas, run_job, write_files
root = sys.argv[1]
spark = local_session("local-cluster[2,1,1024]", "keyedstate-kill-executor",
                      {"spark.task.maxFailures": "4"})
write_files(os.path.join(root, "input"), 3)
os.makedirs(os.path.join(root, "markers"))
run_job(spark, root, KillExecutorOnce(1, os.path.join(root, "markers")), parallelism=2)
assert os.listdir(os.path.join(root, "markers")), "no executor was killed"
check_against_pandas(root)
print("ok")
spark.stop()
"""


@pytest.mark.slow
def test_killed_executor_jvm_exactly_once(tmp_path):
    """An executor JVM SIGKILLed mid-batch on local-cluster: the batch re-runs elsewhere from
    committed state; every output row appears exactly once with the right value."""
    result = subprocess.run(
        [sys.executable, "-c", KILL_EXECUTOR_SCRIPT, str(tmp_path / "job")],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
