"""Keyed jobs over Spark Connect (docs/spark.md, "Spark Connect"), against a local Connect
server started from pyspark's own distribution: the quick start equals pandas, failures reach
the client typed and a restart is exactly once, the asynchronous mode too (the stop completes
the checkpoints in flight; the server's copy of the driver killed mid-flight, a failed upload),
and what Connect can't give fails at start().

One server for the module (about 20 s to start). pyspark marks a process that made a Connect
session as Connect-only (``SPARK_CONNECT_MODE_ENABLED``: ``pyspark.sql.functions`` then build
Connect columns, and the classic ``SparkSession.builder`` a Connect session), so the mark is
set only while a test of this module runs and removed after, for the classic tests that share
the process."""

from __future__ import annotations

import os
import sys
import textwrap
import threading
from typing import Any, Iterator

import pandas as pd
import pytest

from keyedstate import JobConfig, ValueStateDescriptor
from keyedstate.checkpoint.properties import BATCH_ID
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.errors import (
    BatchFailedError,
    CheckpointDiscardedError,
    SparkConnectServerError,
    SparkConnectUnsupportedError,
)
from keyedstate.spark import KeyedProcessFunction, ParquetSink, key_by
from keyedstate.spark.offsets import OffsetLog
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.testing.connect_server import (
    missing_prerequisite,
    start_connect_server,
    stop_connect_server,
)
from keyedstate.testing.faults import FaultPlan
from tests.spark.jobs import COUNT_SCHEMA, FailingSink, FailOnKey, KillingSink, RunningTotals
from tests.spark.test_job import SCHEMA, check_against_pandas, write_files

pytestmark = pytest.mark.spark

#: pyspark's process-wide mark of a Connect client (see the module docstring)
CONNECT_MODE = "SPARK_CONNECT_MODE_ENABLED"
#: the checkout under test: the server's Python workers import keyedstate and tests from it
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local Spark Connect server for this module; always stopped, with every process it
    started."""
    reason = missing_prerequisite()
    if reason is not None:
        pytest.skip(f"no local Spark Connect server: {reason}")
    server = start_connect_server(str(tmp_path_factory.mktemp("connect-server")),
                                  python_path=[CHECKOUT])
    try:
        yield server.url
    finally:
        stop_connect_server(server)


@pytest.fixture(scope="module")
def connect_session(connect_url: str) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    before = os.environ.get(CONNECT_MODE)
    session = SparkSession.builder.remote(connect_url).create()
    _restore_mode(before)
    try:
        yield session
    finally:
        os.environ[CONNECT_MODE] = "1"
        try:
            session.stop()
        finally:
            _restore_mode(before)


def _restore_mode(before: str | None) -> None:
    if before is None:
        os.environ.pop(CONNECT_MODE, None)
    else:
        os.environ[CONNECT_MODE] = before


@pytest.fixture
def remote(connect_session: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The Connect session, with pyspark in Connect mode for this test only."""
    monkeypatch.setenv(CONNECT_MODE, "1")
    return connect_session


class CountPerKey(KeyedProcessFunction):
    """The README's quick start function."""

    count = ValueStateDescriptor("count", "bigint", default=0)

    def open(self, ctx: Any) -> None:
        self.state = ctx.get_state(self.count)

    def process_key(self, key: Any, rows: Any, ctx: Any) -> Any:
        self.state.update(self.state.value() + rows.num_rows)
        yield {"key": key, "count": self.state.value()}


def stream(spark: Any, root: str) -> Any:
    return (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
            .parquet(os.path.join(root, "input")))


def start(spark: Any, root: str, fn: Any, sink: Any, location: str = "spark",
          **config: Any) -> Any:
    """``fn`` keyed by user over ``root/input`` into ``sink``, every available file processed
    (checkpoints in ``root/ckpt`` unless ``config`` says otherwise, Spark's log in
    ``root/<location>``)."""
    job = key_by(stream(spark, root), "user_id").process(fn, COUNT_SCHEMA).sink(sink)
    config.setdefault("checkpoint_dir", os.path.join(root, "ckpt"))
    query = job.start(JobConfig(parallelism=2, **config),
                      trigger={"availableNow": True},
                      spark_checkpoint_location=os.path.join(root, location))
    query.await_termination()
    return query


def test_quick_start_over_connect_equals_pandas(remote, tmp_path):
    """The README's quick start (its function, a callback sink) with the session from
    ``SparkSession.builder.remote``: the last count per key equals pandas over the input,
    ``query.stats`` is read from the checkpoints, and a savepoint taken at the stop restores
    a job that goes on exactly once."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    out = os.path.join(root, "out")

    def write_batch(df: Any, batch_id: int) -> None:  # runs in the Connect server
        rows = df.toPandas()
        # Connect's toPandas puts its plan metrics in attrs, which to_parquet can't write.
        rows.attrs.clear()
        rows.assign(batch_id=batch_id).to_parquet(os.path.join(out, f"batch-{batch_id}.parquet"))

    os.makedirs(out)
    events = stream(remote, root).withColumnRenamed("user_id", "key")
    job = (key_by(events, "key").process(CountPerKey(), output_schema="key string, count bigint")
           .sink(write_batch))
    config = JobConfig(checkpoint_dir=os.path.join(root, "ckpt"), parallelism=2)
    query = job.start(config, trigger={"availableNow": True},
                      spark_checkpoint_location=os.path.join(root, "spark"))
    query.await_termination()
    savepoint = query.stop(savepoint=os.path.join(root, "savepoint"))
    assert savepoint is not None and os.path.exists(savepoint)

    events_pd = pd.read_parquet(os.path.join(root, "input"))
    counts = pd.read_parquet(out).sort_values("batch_id").groupby("key")["count"].last()
    expected = events_pd.groupby("user_id").size()
    assert counts.sort_index().to_dict() == expected.sort_index().to_dict()
    assert [s.batch_id for s in query.stats] == [0, 1, 2]
    assert sum(s.rows_in for s in query.stats) == len(events_pd)

    # Restored from the savepoint in a new checkpoint directory and Spark location: the
    # next file only is read, and the counts go on.
    write_files(os.path.join(root, "input"), 1, first=3)
    restored = job.start(JobConfig(checkpoint_dir=os.path.join(root, "ckpt-2"), parallelism=3,
                                   restore_path=savepoint),
                         trigger={"availableNow": True},
                         spark_checkpoint_location=os.path.join(root, "spark-2"))
    restored.await_termination()
    restored.stop()
    events_pd = pd.read_parquet(os.path.join(root, "input"))
    counts = pd.read_parquet(out).sort_values("batch_id").groupby("key")["count"].last()
    assert counts.sort_index().to_dict() == events_pd.groupby("user_id").size().to_dict()
    assert [s.batch_id for s in restored.stats] == [3]


def test_driver_failure_after_the_checkpoint_commit_restarts_exactly_once(remote, tmp_path):
    """A failure between batch 1's checkpoint commit and its sink commit (in the Connect
    server): the client gets it typed; the restart commits batch 1's output without running
    the batch again, then goes on; every row equals pandas, none twice."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    failing = FailingSink(os.path.join(root, "out"), 1, os.path.join(root, "failed-once"))
    with pytest.raises(BatchFailedError, match="between checkpoint commit and sink commit"):
        start(remote, root, RunningTotals(), failing)
    query = start(remote, root, RunningTotals(), ParquetSink(os.path.join(root, "out")))
    query.stop()
    check_against_pandas(root)
    assert [s.batch_id for s in query.stats] == [2], "batch 1 was not run again"


def test_subtask_failure_reaches_the_client_typed_and_the_restart_is_exactly_once(remote,
                                                                                  tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 2)
    with pytest.raises(BatchFailedError) as failed:
        start(remote, root, FailOnKey("u0007"), ParquetSink(os.path.join(root, "out")))
    error = failed.value
    assert error.batch_id == 0 and error.key == "'u0007'" and error.subtask in (0, 1)
    assert "ValueError: cannot handle u0007" in str(error)
    assert "raise ValueError" in (error.user_traceback or "")
    start(remote, root, RunningTotals(), ParquetSink(os.path.join(root, "out"))).stop()
    check_against_pandas(root)


def test_what_needs_the_coordinator_in_the_client_is_refused(remote, tmp_path):
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 1)
    query = start(remote, root, RunningTotals(), ParquetSink(os.path.join(root, "out")))
    for call in (lambda: query.add_listener(print),
                 lambda: query.trigger_savepoint(os.path.join(root, "sp")),
                 lambda: query.stop(drain=True)):
        with pytest.raises(SparkConnectUnsupportedError, match="Connect server"):
            call()
    query.stop()
    check_against_pandas(root)


class LockedSink(ParquetSink):
    """A sink that opens a lock in its constructor: it can't be pickled."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.lock = threading.Lock()


def test_a_sink_that_does_not_pickle_fails_at_start(remote, tmp_path):
    """The server gets the job pickled: a sink that can't be pickled is named by start(),
    before anything is restored or written."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 1)
    job = key_by(stream(remote, root), "user_id").process(RunningTotals(), COUNT_SCHEMA)
    job.sink(LockedSink(os.path.join(root, "out")))
    with pytest.raises(SparkConnectUnsupportedError, match="LockedSink.*can't be pickled"):
        job.start(JobConfig(checkpoint_dir=os.path.join(root, "ckpt"), parallelism=2),
                  spark_checkpoint_location=os.path.join(root, "spark"))
    assert not os.path.exists(os.path.join(root, "ckpt"))


def files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def completed_batches(checkpoint_dir: str) -> list[int]:
    """The batches the completed checkpoints in ``checkpoint_dir`` cover, oldest first."""
    storage = CheckpointStorage(checkpoint_dir)
    return [int(storage.read_metadata(storage.metadata_path(i)).properties[BATCH_ID])
            for i in storage.checkpoint_ids()]


def test_async_uploads_over_connect_equal_pandas_and_stop_completes_the_flight(remote,
                                                                              tmp_path):
    """The asynchronous mode over Spark Connect (docs/spark.md, "Spark Connect"): batches
    return after their synchronous phase, so once the query ran every file the last batch's
    checkpoint is still in flight, recorded by the server's copy of the driver;
    ``stop(savepoint=...)`` completes it and commits its output (here, in the client) before
    it takes the savepoint. The output equals pandas, exactly once; the savepoint is of the
    last batch and restores a job that goes on, asynchronous too."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 3)
    ckpt = os.path.join(root, "ckpt")
    query = start(remote, root, RunningTotals(), ParquetSink(os.path.join(root, "out")),
                  async_upload=True)
    # Spark recorded every batch as done; batch 1's checkpoint completed during batch 2,
    # whose own is in flight.
    assert OffsetLog.at(os.path.join(root, "spark")).last_committed() == 2
    assert completed_batches(ckpt) == [1]
    assert [s.batch_id for s in query.stats] == [0, 1]
    # Batch 2's checkpoint (3) is recorded in flight; batch 1's (2) completed beside batch 2,
    # which may have restored from its acknowledgements: those are kept until the next
    # completion, or its subsumption (the stop's, below).
    records = sorted(p for p in files_under(ckpt) if p.endswith("/_acks/flight"))
    assert [p.split(os.sep)[-3] for p in records] == ["chk-2", "chk-3"]
    savepoint = query.stop(savepoint=os.path.join(root, "savepoint"))
    assert savepoint is not None
    check_against_pandas(root)
    assert [s.batch_id for s in query.stats] == [0, 1, 2]
    assert resolve_snapshot(savepoint).metadata.properties[BATCH_ID] == "2"
    assert not [p for p in files_under(ckpt) if "/_acks/" in p]

    write_files(os.path.join(root, "input"), 1, first=3)
    restored = start(remote, root, RunningTotals(), ParquetSink(os.path.join(root, "out")),
                     location="spark-2", checkpoint_dir=os.path.join(root, "ckpt-2"),
                     restore_path=savepoint, async_upload=True)
    restored.stop()
    check_against_pandas(root)
    assert [s.batch_id for s in restored.stats] == [3]


def test_the_servers_driver_killed_mid_flight_restarts_exactly_once(remote, tmp_path):
    """The server's copy of the driver dies (SIGKILL) after Spark recorded batch 1 as done
    and before batch 1's checkpoint completed: with two checkpoints in flight allowed, batch
    0's completes during batch 2, and its sink kills the process as it commits it. The client
    gets the query's failure; the restart commits batch 0's output (in the client), rewinds
    Spark's log to batch 0, and batches 1-3 run again from their logged offsets, one input
    file each: every row equals pandas, none twice. Its stop completes the last two
    checkpoints in the client, and the next restart goes on after them."""
    from pyspark.errors import StreamingQueryException

    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 4)
    marker = os.path.join(root, "killed")
    config = dict(async_upload=True, max_concurrent_checkpoints=2)
    with pytest.raises(StreamingQueryException):
        start(remote, root, RunningTotals(),
              KillingSink(os.path.join(root, "out"), 0, marker), **config)
    assert os.path.exists(marker)
    log = OffsetLog.at(os.path.join(root, "spark"))
    assert log.last_committed() == 1
    assert completed_batches(os.path.join(root, "ckpt")) == [0]
    query = start(remote, root, RunningTotals(), ParquetSink(os.path.join(root, "out")),
                  **config)
    query.stop()
    check_against_pandas(root)
    assert [(s.batch_id, s.rows_in) for s in query.stats] == [(1, 1500), (2, 1500), (3, 1500)]
    assert log.batches("commits") == [0, 1, 2, 3]
    # The stop completed batches 2 and 3 in the client: a restart goes on from batch 3.
    write_files(os.path.join(root, "input"), 1, first=4)
    again = start(remote, root, RunningTotals(), ParquetSink(os.path.join(root, "out")),
                  **config)
    again.stop()
    check_against_pandas(root)
    assert [s.batch_id for s in again.stats] == [4]


def test_a_failed_upload_reaches_the_client_typed_and_the_restart_is_exactly_once(remote,
                                                                                  tmp_path):
    """Batch 1's upload (checkpoint 2, in a worker of the Connect server) is refused: the
    server's copy of the driver discards batch 1 (and batch 2, unless a subtask of batch 2,
    waiting for that upload, failed it first) during batch 2, and the client gets
    :class:`CheckpointDiscardedError` with the discarded batches. The restart rewinds
    Spark's log to batch 0 and runs batches 1-3 again: exactly once."""
    root = str(tmp_path)
    write_files(os.path.join(root, "input"), 4)
    plan = FaultPlan(tmp_path / "faults.json")
    plan.add("write", "denied", match="/shared/chk-2-")
    faulty = dict(checkpoint_dir=plan.url(os.path.join(root, "ckpt")),
                  storage_options=plan.storage_options("file"), transfer_attempts=1,
                  async_upload=True, checkpoint_timeout="30 s")
    with pytest.raises(CheckpointDiscardedError) as failed:
        start(remote, root, RunningTotals(), ParquetSink(os.path.join(root, "out")), **faulty)
    assert plan.fired()
    assert failed.value.discarded_batches[0] == 1 and failed.value.last_batch_id == 0
    assert "checkpoint 2 failed in its asynchronous phase" in str(failed.value)
    assert OffsetLog.at(os.path.join(root, "spark")).last_committed() == 1
    query = start(remote, root, RunningTotals(), ParquetSink(os.path.join(root, "out")),
                  **faulty)
    query.stop()
    check_against_pandas(root)
    assert [s.batch_id for s in query.stats] == [1, 2, 3]


def test_a_function_the_server_cannot_import_fails_at_start(remote, tmp_path, monkeypatch):
    """The function's module is on the client's path only: the server's foreachBatch process
    can't unpickle the job, and start() raises naming the module."""
    module = tmp_path / "client_only_module.py"
    module.write_text(textwrap.dedent("""
        from tests.spark.jobs import RunningTotals

        class ClientOnly(RunningTotals):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "client_only_module", raising=False)
    from client_only_module import ClientOnly  # type: ignore[import-not-found]

    root = str(tmp_path / "job")
    write_files(os.path.join(root, "input"), 1)
    job = key_by(stream(remote, root), "user_id").process(ClientOnly(), COUNT_SCHEMA)
    job.sink(ParquetSink(os.path.join(root, "out")))
    with pytest.raises(SparkConnectServerError, match="client_only_module"):
        job.start(JobConfig(checkpoint_dir=os.path.join(root, "ckpt"), parallelism=2),
                  spark_checkpoint_location=os.path.join(root, "spark"))
