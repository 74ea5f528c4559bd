"""Sinks: a ParquetSink batch is named by (lineage, batch id), published once and whole (one
rename on a local disk, ``_SUCCESS`` last on S3); a callback sink gets the staged rows as a
DataFrame of the declared schema whatever the checkpoint storage. Most tests need no Spark:
``ParquetSink.commit`` does not use it."""

from __future__ import annotations

import json
import os
import sys
import uuid
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from keyedstate.spark import sinks
from keyedstate.spark.sinks import (
    SUCCESS_FILE,
    TEMPORARY_DIR,
    CallbackSink,
    ParquetSink,
    StagedOutput,
    batch_dir_name,
    published_batches,
    read_published,
)
from keyedstate.storage.checkpoint_storage import CheckpointStorage

SCHEMA = pa.schema([("user_id", pa.string()), ("count", pa.int64()),
                    ("ts", pa.timestamp("us", tz="UTC")), ("batch_id", pa.int64())])
LINEAGE = str(uuid.UUID(int=1))


def stage(storage: CheckpointStorage, batch_id: int, parts: int, rows: int = 5,
          lineage: str = LINEAGE) -> StagedOutput:
    """``parts`` staged Parquet files of ``rows`` rows each, as the runtime stages them."""
    paths = []
    for n in range(parts):
        table = pa.table({
            "user_id": [f"u{n}-{i}" for i in range(rows)],
            "count": list(range(rows)),
            "ts": pa.array([1_700_000_000_000_000 + i for i in range(rows)],
                           pa.timestamp("us", tz="UTC")),
            "batch_id": [batch_id] * rows,
        }, schema=SCHEMA)
        relative = f"staging/batch-{batch_id}/main/part-{n:05d}-{uuid.uuid4().hex}.parquet"
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        storage.write(relative, sink.getvalue().to_pybytes())
        paths.append(relative)
    return StagedOutput(storage, paths, SCHEMA, lineage)


def published(out: str) -> dict[str, list[str]]:
    """Every entry of a local sink directory: ``{directory: sorted file names}``."""
    return {os.path.relpath(d, out): sorted(files) for d, _, files in os.walk(out)
            if os.path.relpath(d, out) != "."}


class CrashAroundCommit:
    """Mixed into a table sink: dies once in batch ``crash_batch``'s commit, before or after
    the sink's own commit (``after``): a driver killed between the checkpoint commit and its
    sink-commit marker. ``marker`` is written when it dies (so it dies once)."""

    crash_batch: int
    marker: str
    after: bool
    table_format = "table"

    def crash_once(self, batch_id: int, marker: str, after: bool) -> None:
        self.crash_batch, self.marker, self.after = batch_id, marker, after

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        crash = batch_id == self.crash_batch and not os.path.exists(self.marker)
        if crash and self.after:
            super().commit(spark, batch_id, staged)  # type: ignore[misc]
        if crash:
            open(self.marker, "w").close()
            raise RuntimeError(f"driver stopped around the {self.table_format} commit")
        super().commit(spark, batch_id, staged)  # type: ignore[misc]


class Crash(Exception):
    pass


def crash_before_publish(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next commit dies after writing every part, before the publish step."""
    publish = ParquetSink._publish
    crashed: list[bool] = []

    def crash_once(self: ParquetSink, *args: Any) -> None:
        if not crashed:
            crashed.append(True)
            raise Crash("driver killed before the publish step")
        publish(self, *args)

    monkeypatch.setattr(ParquetSink, "_publish", crash_once)


# -- local disk ----------------------------------------------------------------------------------

def test_jobs_of_other_lineages_never_touch_each_others_batches(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    out = str(tmp_path / "out")
    sink = ParquetSink(out)
    first, second = stage(storage, 0, 2, lineage="job-a"), stage(storage, 0, 3, lineage="job-b")
    sink.commit(None, 0, first)
    before = {n: open(os.path.join(out, "job-a-batch-0000000000", n), "rb").read()
              for n in ("part-00000.parquet", "part-00001.parquet")}
    sink.commit(None, 0, second)  # a new job: its batch ids start at 0 again
    assert published(out) == {
        "job-a-batch-0000000000": ["_SUCCESS", "part-00000.parquet", "part-00001.parquet"],
        "job-b-batch-0000000000": ["_SUCCESS", "part-00000.parquet", "part-00001.parquet",
                                   "part-00002.parquet"],
        TEMPORARY_DIR: [],
    }
    assert all(open(os.path.join(out, "job-a-batch-0000000000", n), "rb").read() == data
               for n, data in before.items())
    assert len(pd.read_parquet(out)) == 25


def test_a_replayed_commit_leaves_exactly_one_copy(tmp_path, monkeypatch):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    out = str(tmp_path / "out")
    sink = ParquetSink(out)
    batch0, batch1 = stage(storage, 0, 3), stage(storage, 1, 2)
    sink.commit(None, 0, batch0)
    sink.commit(None, 0, batch0)  # a replay: published already, nothing happens
    name0, name1 = batch_dir_name(LINEAGE, 0), batch_dir_name(LINEAGE, 1)
    assert published(out) == {name0: [SUCCESS_FILE, "part-00000.parquet", "part-00001.parquet",
                                      "part-00002.parquet"], TEMPORARY_DIR: []}
    manifest = json.loads(open(os.path.join(out, name0, SUCCESS_FILE)).read())
    assert (manifest["lineage"], manifest["batch_id"]) == (LINEAGE, 0)
    assert [f["name"] for f in manifest["files"]] == [f"part-0000{n}.parquet" for n in range(3)]
    # A commit killed before its publish step leaves a temporary directory no reader sees.
    crash_before_publish(monkeypatch)
    with pytest.raises(Crash):
        sink.commit(None, 1, batch1)
    [leftover] = os.listdir(os.path.join(out, TEMPORARY_DIR))
    assert leftover.startswith(f"{name1}-")
    assert sorted(os.listdir(os.path.join(out, TEMPORARY_DIR, leftover))) == [
        "part-00000.parquet", "part-00001.parquet"]
    assert len(pd.read_parquet(out)) == 15 and len(ds.dataset(out).files) == 3
    # The restarted driver commits the batch again: one copy, the leftover gone.
    sink.commit(None, 1, batch1)
    assert published(out) == {
        name0: [SUCCESS_FILE, "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"],
        name1: [SUCCESS_FILE, "part-00000.parquet", "part-00001.parquet"],
        TEMPORARY_DIR: [],
    }
    got = pd.read_parquet(out)
    assert len(got) == 25 and not got.duplicated(["user_id", "batch_id"]).any()


def test_a_reader_never_sees_part_of_a_batch(tmp_path, monkeypatch):
    """Between every function call of a commit (the profiler's hook after each returns), the
    Parquet files pyarrow / pandas find in the sink directory are every file of the batch,
    whole, or none: also for a replay after a crash that left a temporary directory."""
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    out = str(tmp_path / "out")
    sink = ParquetSink(out)
    batch0, batch1 = stage(storage, 0, 4, rows=2000), stage(storage, 1, 3, rows=2000)
    # One thread does every step, so that the hook runs between all of them.
    monkeypatch.setattr(sinks, "parallel_map", lambda fn, items, threads: [fn(x) for x in items])
    expected: dict[str, bytes] = {}
    views: list[frozenset[str]] = []

    def visible() -> dict[str, int]:
        """What pyarrow's discovery lists (no file read: the schema is given)."""
        if not os.path.isdir(out):
            return {}
        return {os.path.relpath(f, out): os.path.getsize(f)
                for f in ds.dataset(out, schema=SCHEMA, format="parquet").files}

    last: list[dict[str, int]] = [{}]

    def check(frame: Any, event: str, arg: Any) -> None:
        if event not in ("return", "c_return"):
            return
        now = visible()
        if now == last[0]:
            return
        last[0] = now
        views.append(frozenset(now))
        for path in now:
            with open(os.path.join(out, path), "rb") as f:
                assert f.read() == expected[path], f"{path} is visible but not whole"

    def commit_watched(batch_id: int, staged: StagedOutput) -> None:
        name = batch_dir_name(LINEAGE, batch_id)
        for n, relative in enumerate(sorted(staged.paths)):
            expected[f"{name}/part-{n:05d}.parquet"] = storage.read(relative)
        sys.setprofile(check)
        try:
            sink.commit(None, batch_id, staged)
        finally:
            sys.setprofile(None)

    commit_watched(0, batch0)
    crash_before_publish(monkeypatch)
    with pytest.raises(Crash):
        commit_watched(1, batch1)
    commit_watched(1, batch1)
    batch = {b: frozenset(p for p in expected if p.startswith(batch_dir_name(LINEAGE, b)))
             for b in (0, 1)}
    # Each change of the visible set added one whole batch, at once.
    assert views == [batch[0], batch[0] | batch[1]]


def test_an_unknown_lineage_still_commits_once(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    out = str(tmp_path / "out")
    staged = stage(storage, 7, 2, lineage="")
    ParquetSink(out).commit(None, 7, staged)
    ParquetSink(out).commit(None, 7, staged)
    assert published(out)["batch-0000000007"] == [SUCCESS_FILE, "part-00000.parquet",
                                                  "part-00001.parquet"]
    assert len(pd.read_parquet(out)) == 10


def test_a_batch_without_rows_writes_nothing(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    ParquetSink(str(tmp_path / "out")).commit(None, 0, StagedOutput(storage, [], SCHEMA, LINEAGE))
    assert not os.path.exists(tmp_path / "out")


def test_a_lineage_that_cannot_name_a_directory_is_refused():
    from keyedstate.errors import ConfigurationError

    for bad in ("_hidden", ".hidden", "a/b", "-x"):
        with pytest.raises(ConfigurationError, match="can't name a directory"):
            batch_dir_name(bad, 0)


def test_the_names_written_match_the_published_patterns(tmp_path):
    """BATCH_DIR_PATTERN and PART_FILE_PATTERN (what docs/spark.md is checked against) parse
    back what a commit writes, with and without a lineage."""
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    out = str(tmp_path / "out")
    ParquetSink(out).commit(None, 12, stage(storage, 12, 3))
    ParquetSink(out).commit(None, 3, stage(storage, 3, 1, lineage=""))
    parsed = {}
    for name, files in published(out).items():
        if name == TEMPORARY_DIR:
            continue
        match = sinks.BATCH_DIR_PATTERN.match(name)
        assert match, name
        parsed[match["lineage"]] = int(match["batch_id"])
        parts = [sinks.PART_FILE_PATTERN.match(f) for f in files if f != SUCCESS_FILE]
        assert all(parts) and sorted(int(p["n"]) for p in parts) == list(range(len(parts)))
    assert parsed == {LINEAGE: 12, None: 3}
    assert not sinks.BATCH_DIR_PATTERN.match(TEMPORARY_DIR)


# -- object store --------------------------------------------------------------------------------

@pytest.mark.s3
@pytest.mark.parametrize("staging", ["same-bucket", "local"])
def test_object_store_commit_writes_success_last_and_completes_a_crashed_batch(
        s3_bucket, tmp_path, monkeypatch, staging):
    """No rename on S3: the parts go straight into the batch directory (a server-side copy
    from staging in the same store, else streamed), ``_SUCCESS`` after the last one. A crashed
    commit's parts stay until the replay, which rewrites them and adds ``_SUCCESS``."""
    import s3fs

    url, options = s3_bucket
    storage = (CheckpointStorage(f"{url}/ckpt", options) if staging == "same-bucket"
               else CheckpointStorage(str(tmp_path / "ckpt")))
    sink = ParquetSink(f"{url}/out", options)
    fs = s3fs.S3FileSystem(**options, use_listings_cache=False)
    root = f"{url[len('s3://'):]}/out"
    name = batch_dir_name(LINEAGE, 3)
    batch = stage(storage, 3, 3)
    order: list[str] = []
    write, copy = CheckpointStorage.write, sinks.duplicate_object

    def record_write(self: CheckpointStorage, relative: str, data: bytes) -> Any:
        order.append(relative)
        return write(self, relative, data)

    def record_copy(source: Any, source_path: str, target: Any, target_path: str,
                    *args: Any, **kwargs: Any) -> str:
        how = copy(source, source_path, target, target_path, *args, **kwargs)
        order.append(f"{target_path} ({how})")
        return how

    monkeypatch.setattr(CheckpointStorage, "write", record_write)
    monkeypatch.setattr(sinks, "duplicate_object", record_copy)
    # A crashed commit of another staged set of the batch (only possible without a lineage)
    # left an extra part: the commit deletes it.
    fs.pipe(f"{root}/{name}/part-00009.parquet", b"left over")
    with monkeypatch.context() as crash:
        crash_before_publish(crash)
        with pytest.raises(Crash):
            sink.commit(None, 3, batch)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(f"{root}/{name}")) == [
        "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    order.clear()
    sink.commit(None, 3, batch)
    how = "server-copy" if staging == "same-bucket" else "stream"
    assert sorted(order[:-1]) == [f"{name}/part-0000{n}.parquet ({how})" for n in range(3)]
    assert order[-1] == f"{name}/{SUCCESS_FILE}"
    order.clear()
    sink.commit(None, 3, batch)  # complete: nothing is written again
    assert order == []
    manifest = json.loads(fs.cat(f"{root}/{name}/{SUCCESS_FILE}"))
    assert [f["name"] for f in manifest["files"]] == [f"part-0000{n}.parquet" for n in range(3)]
    assert len(pd.read_parquet(f"{url}/out", storage_options=options)) == 15


@pytest.mark.s3
def test_readers_on_an_object_store_see_only_whole_batches_through_the_manifests(
        s3_bucket, tmp_path, monkeypatch):
    """On S3 parts appear one by one and a crashed commit's parts stay until the replay:
    ``published_batches`` / ``read_published`` list and read only batches whose ``_SUCCESS``
    exists, and only the parts it lists; a plain reader of the path sees the partial batch."""
    url, options = s3_bucket
    storage = CheckpointStorage(f"{url}/ckpt", options)
    sink = ParquetSink(f"{url}/out", options)
    branch = str(uuid.UUID(int=2))
    sink.commit(None, 0, stage(storage, 0, 2))
    branched = stage(storage, 1, 1, lineage=branch)
    sink.commit(None, 1, StagedOutput(branched.storage, branched.paths, SCHEMA, branch,
                                      parent_lineage=LINEAGE, fork_batch_id=0))
    with monkeypatch.context() as crash:
        crash_before_publish(crash)
        with pytest.raises(Crash):
            sink.commit(None, 1, stage(storage, 1, 3))  # parts written, no _SUCCESS
    assert len(pd.read_parquet(f"{url}/out", storage_options=options)) == 30, \
        "a plain reader sees the partial batch"
    batches = published_batches(f"{url}/out", options)
    assert [(b.lineage, b.batch_id, b.parent_lineage, b.fork_batch_id, len(b.parts))
            for b in batches] == [(LINEAGE, 0, "", -1, 2), (branch, 1, LINEAGE, 0, 1)]
    assert all(p.startswith(f"{url}/out/") for b in batches for p in b.parts)
    assert len(read_published(f"{url}/out", options)) == 15
    assert read_published(f"{url}/out", options, lineage=branch).column("batch_id"
                                                                        ).to_pylist() == [1] * 5
    # the part URLs as pyarrow reads them through fsspec
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    urls = [p[len("s3://"):] for b in batches for p in b.parts]
    assert ds.dataset(urls, filesystem=fs, format="parquet").count_rows() == 15
    sink.commit(None, 1, stage(storage, 1, 3))  # the replay completes it
    assert len(read_published(f"{url}/out", options)) == 30


def test_a_parquet_sink_tells_which_batches_of_a_lineage_it_holds_after_a_batch(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    sink = ParquetSink(str(tmp_path / "out"))
    assert sink.batches_after(LINEAGE, 0) == []  # no path yet
    for batch_id in (0, 2, 3):
        sink.commit(None, batch_id, stage(storage, batch_id, 1))
    sink.commit(None, 4, stage(storage, 4, 1, lineage=str(uuid.UUID(int=3))))
    with pytest.MonkeyPatch.context() as crash:
        crash_before_publish(crash)
        with pytest.raises(Crash):
            sink.commit(None, 5, stage(storage, 5, 1))  # never published
    assert sink.batches_after(LINEAGE, 0) == [2, 3]
    assert sink.batches_after(LINEAGE, 3) == []
    assert sink.batches_after("", 0) is None


# -- readers and callbacks (Spark) ---------------------------------------------------------------

@pytest.mark.spark
def test_readers_see_every_batch_and_no_extra_column(spark, tmp_path, monkeypatch):
    """pandas, pyarrow, Spark (recursiveFileLookup) and DuckDB read the batches of two
    lineages, nothing of a crashed commit's temporary directory, and only the output's
    columns (no partition column from the batch directories)."""
    import duckdb

    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    out = str(tmp_path / "out")
    sink = ParquetSink(out)
    sink.commit(spark, 0, stage(storage, 0, 2, lineage="job-a"))
    sink.commit(spark, 1, stage(storage, 1, 1, lineage="job-a"))
    sink.commit(spark, 0, stage(storage, 0, 3, lineage="job-b"))
    crash_before_publish(monkeypatch)
    with pytest.raises(Crash):
        sink.commit(spark, 1, stage(storage, 1, 2, lineage="job-b"))
    names = SCHEMA.names
    frames = {
        "pandas": pd.read_parquet(out),
        "pyarrow": ds.dataset(out, format="parquet").to_table().to_pandas(),
        "spark": spark.read.option("recursiveFileLookup", "true").parquet(out).toPandas(),
        "duckdb": duckdb.sql(f"SELECT * FROM read_parquet('{out}/*/*.parquet')").df(),
    }
    for reader, frame in frames.items():
        assert list(frame.columns) == names, reader
        assert len(frame) == 30, reader
    # DuckDB's ** also walks into hidden directories: it reads the crashed commit's 10 rows
    # too, until the batch is committed again.
    def duckdb_rows(glob: str) -> int:
        [(rows,)] = duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/{glob}')").fetchall()
        return int(rows)

    assert duckdb_rows("**/*.parquet") == 40
    sink.commit(spark, 1, stage(storage, 1, 2, lineage="job-b"))
    assert duckdb_rows("**/*.parquet") == duckdb_rows("*/*.parquet") == 40


@pytest.mark.spark
def test_callback_gets_the_rows_with_the_declared_schema(spark, tmp_path):
    from keyedstate.spark.schema import to_spark_schema

    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    got: list[tuple[int, Any, pd.DataFrame]] = []
    sink = CallbackSink(lambda df, batch_id: got.append((batch_id, df.schema, df.toPandas())))
    staged = stage(storage, 4, 3)
    sink.commit(spark, 4, staged)
    sink.commit(spark, 5, StagedOutput(storage, [], SCHEMA, LINEAGE))
    declared = to_spark_schema(SCHEMA)
    assert [(b, s) for b, s, _ in got] == [(4, declared), (5, declared)]
    expected = pd.concat(pq.read_table(pa.BufferReader(storage.read(p))).to_pandas()
                         for p in sorted(staged.paths))
    pd.testing.assert_frame_equal(got[0][2].reset_index(drop=True),
                                  expected.reset_index(drop=True), check_dtype=False)
    assert got[1][2].empty and list(got[1][2].columns) == SCHEMA.names
