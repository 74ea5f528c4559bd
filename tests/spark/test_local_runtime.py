"""The local runtime and Spark run one KeyedProcessFunction to the same output and state."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.keygroups import KeyGroupRange
from keyedstate.processor.canonical import read_range_tables
from keyedstate.spark.api import key_by
from keyedstate.spark.sinks import ParquetSink
from tests.runtime.test_local_job import INPUT, batches, config, new_job
from tests.spark.jobs import COUNT_SCHEMA, IDLE_SCHEMA, IdleCounts, file_stream

pytestmark = pytest.mark.spark

OUTPUTS = ("main", "idle", "late-events")


def plain(table: pa.Table) -> list[tuple]:
    """Rows sorted, timestamps as integers (Spark and pyarrow differ in time zones only)."""
    columns = [c.cast(pa.int64()) if pa.types.is_timestamp(c.type) else c for c in table.columns]
    return sorted(tuple(r.values()) for r in pa.table(columns, names=table.column_names).to_pylist())


def state_rows(savepoint: str, state: str) -> list[tuple]:
    snapshot = resolve_snapshot(savepoint)
    everything = KeyGroupRange(0, snapshot.metadata.max_parallelism - 1)
    tables = list(read_range_tables(snapshot, everything, state,
                                    now_ms=int(time.time() * 1000)))
    return plain(pa.concat_tables(tables)) if tables else []


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_local_job_gives_the_output_and_state_of_the_spark_job(spark, tmp_path, backend):
    data = batches(3)

    # On Spark: one file per micro-batch, stopped with drain and a savepoint.
    events = file_stream(spark, str(tmp_path / "input"), data, INPUT)
    job = key_by(events, "user_id").process(IdleCounts(), COUNT_SCHEMA,
                                            side_outputs={"idle": IDLE_SCHEMA})
    for output in OUTPUTS:
        job.sink(ParquetSink(str(tmp_path / "spark-out" / output)), output=output)
    query = job.start(config(tmp_path / "spark", backend=backend),
                      trigger={"availableNow": True},
                      spark_checkpoint_location=str(tmp_path / "spark" / "offsets"))
    query.await_termination()
    spark_savepoint = query.stop(drain=True, savepoint=str(tmp_path / "spark-savepoint"))
    assert spark_savepoint is not None

    # Locally: the same batches, drain and savepoint.
    local: dict[str, list[pa.Table]] = {tag: [] for tag in OUTPUTS}
    with new_job(config(tmp_path / "local", backend=backend)) as job_here:
        for table in data:
            for tag, out in job_here.process_batch(table).items():
                local[tag].append(out)
        local_savepoint = job_here.stop(drain=True, savepoint=str(tmp_path / "local-savepoint"))
        for tag, out in job_here.last_outputs.items():
            local[tag].append(out)
    assert local_savepoint is not None

    for tag in OUTPUTS:
        on_spark = pq.read_table(str(tmp_path / "spark-out" / tag))
        here = pa.concat_tables(local[tag])
        assert plain(here.select(on_spark.column_names)) == plain(on_spark), tag
    assert len(plain(pa.concat_tables(local["idle"]))) > 0
    assert len(plain(pa.concat_tables(local["late-events"]))) > 0
    for state in ("count", "last"):
        assert state_rows(local_savepoint, state) == state_rows(spark_savepoint, state), state
    assert state_rows(local_savepoint, "count")
