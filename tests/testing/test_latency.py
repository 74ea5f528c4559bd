"""The latency-shaping filesystem (``kslatency://``, :mod:`keyedstate.testing.latency`): the
checkpoint storage's own tests pass through it (over a local directory and the local S3
server), a job's checkpoints are written and restored through it on both backends, it counts
every request of a checkpoint by kind and area with the seconds the model charges, and bad
parameters are refused naming the parameter. Counts and modeled seconds are exact; no test
times anything."""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import fsspec
import pyarrow as pa
import pytest

from keyedstate.checkpoint.properties import STAGED
from keyedstate.config import JobConfig
from keyedstate.errors import KeyedStateError, LatencyModelError
from keyedstate.runtime.local import LocalJob
from keyedstate.storage.cache import all_process_caches
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import area_of
from keyedstate.storage.transfer import TransferStats
from keyedstate.testing.latency import (
    KINDS,
    MODELS,
    LatencyModel,
    RequestCounts,
    behind_latency,
    counts_of,
    parse_latency,
    process_counts,
    read_request_log,
)
from tests.conftest import Store
from tests.s3 import test_object_storage as storage_tests
from tests.spark.jobs import COUNT_SCHEMA, IDLE_SCHEMA, IdleCounts

pytestmark = pytest.mark.integration

#: Small figures: the tests sleep what the model charges, so keep it short.
MODEL = LatencyModel("test", first_byte_ms=1.0, mb_per_s=500.0)
BACKENDS = ["rocksdb", "heap"]
INPUT = "user_id string, ts timestamp, amount double"
T0 = 1_700_000_000_000


def shaped(store: Store, log_dir: str | None = None) -> Store:
    """``store`` behind :data:`MODEL` (kind ``latency``: an object store as far as checkpoint
    storage can tell, with inlining, merging and the file cache on)."""
    url, options = behind_latency(store.base, store.options, MODEL, log_dir)
    return Store("latency", url, options)


def batch(b: int, users: int = 40) -> pa.Table:
    return pa.table({
        "user_id": [f"u{(b * 7 + i) % users:03d}" for i in range(3 * users)],
        "ts": pa.array([(T0 + b * 1000 + i) * 1000 for i in range(3 * users)],
                       pa.timestamp("us", tz="UTC")),
        "amount": [1.0] * (3 * users)})


def new_job(url: str, options: dict[str, Any], backend: str) -> LocalJob:
    return LocalJob(IdleCounts(), key_columns=["user_id"], input_schema=INPUT,
                    output_schema=COUNT_SCHEMA, side_outputs={"idle": IDLE_SCHEMA},
                    config=JobConfig(checkpoint_dir=url, storage_options=options,
                                     parallelism=2, backend=backend, watermark_column="ts"))


def sorted_rows(table: pa.Table) -> list[tuple[Any, ...]]:
    return sorted((tuple(r.values()) for r in table.to_pylist()), key=repr)


def charged(counts: RequestCounts, model: LatencyModel) -> None:
    """Every kind's modeled seconds are the model's: a first byte per request, plus its
    bytes at the stream's rate (a server-side copy moves none through the client)."""
    for kind in KINDS:
        cell = counts.cell(kind)
        transfer = 0.0 if kind in ("copy", "mkdir") else model.transfer_s(cell.bytes)
        first = 0.0 if kind == "mkdir" else cell.requests * model.first_byte_s
        assert math.isclose(cell.modeled_s, first + transfer, abs_tol=1e-9), kind


# -- the checkpoint storage's own tests, through the wrapper -------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_files_are_stored_once_and_referenced_in_place_through_it(store, tmp_path, backend):
    before = process_counts()
    storage_tests.test_every_file_is_stored_once_and_referenced_in_place(shaped(store),
                                                                          tmp_path, backend)
    moved = process_counts() - before
    assert moved.requests("write", "shared") > 0 and moved.requests("write", "metadata") == 4
    charged(moved, MODEL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_savepoints_and_no_claim_restores_are_duplicated_through_it(store, tmp_path, backend):
    before = process_counts()
    storage_tests.test_savepoint_and_no_claim_restore_are_duplicated_by_the_store(
        shaped(store), tmp_path, backend)
    moved = process_counts() - before
    # the store copies what it holds: server-side copies, not a byte through the client
    assert moved.requests("copy") > 0 and moved.bytes("copy") == 0
    charged(moved, MODEL)


def test_small_files_are_inlined_or_merged_through_it(store, tmp_path):
    storage_tests.test_small_files_are_inlined_or_merged_and_gc_sees_exact_references(
        shaped(store), tmp_path)


def test_a_restore_with_a_warm_cache_downloads_nothing_through_it(store, tmp_path):
    storage_tests.test_restore_with_a_warm_file_cache_downloads_nothing(shaped(store),
                                                                        tmp_path, "rocksdb")


# -- a job's checkpoints, request by request ---------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_job_checkpoints_and_restores_through_it_with_every_request_counted(
        store, tmp_path, backend):
    data = [batch(b) for b in range(4)]
    with new_job(store.url("plain"), store.options, backend) as plain:
        expected = [sorted_rows(plain.process_batch(t)["main"]) for t in data]
    wrapped = shaped(store, log_dir=str(tmp_path / "requests"))
    url, options = wrapped.url("job"), wrapped.options
    per_batch: list[RequestCounts] = []
    with new_job(url, options, backend) as job:
        for t, want in zip(data[:3], expected):
            before = process_counts()
            assert sorted_rows(job.process_batch(t)["main"]) == want
            per_batch.append(process_counts() - before)
            checkpoint = job.latest_checkpoint
            assert checkpoint is not None
            moved = per_batch[-1]
            # one _metadata PUT commits the checkpoint, one marker records the sinks' commit
            assert moved.requests("write", "metadata") == 1
            assert moved.requests("write", "commits") == 1
            # every state object the storage layer uploaded is one PUT (merged files: one)
            uploaded = TransferStats()
            for handle in checkpoint.metadata.handles:
                uploaded.merge(TransferStats.from_properties(handle.properties))
            assert moved.requests("write", "shared") + moved.requests("write", "checkpoint") \
                == uploaded.uploaded_objects
            staged = json.loads(checkpoint.metadata.properties[STAGED])
            assert moved.requests("write", "staging") == sum(len(p) for p in staged.values())
            # the staged files are read back by the commit, then deleted with the folder
            assert moved.requests("read", "staging") == moved.requests("write", "staging")
            assert moved.requests("delete", "staging") >= 1
            charged(moved, MODEL)
    # A new process (no cache, no live copy) restores from the same root through the model.
    for cache in all_process_caches():
        cache.clear()
    before = process_counts()
    with new_job(url, options, backend) as restored:
        assert sorted_rows(restored.process_batch(data[3])["main"]) == expected[3]
    restore = process_counts() - before
    assert restore.requests("read", "metadata") >= 1 and restore.bytes("read") > 0
    charged(restore, MODEL)
    # Each process (here: one) logged what it counted, request by request.
    logged = counts_of(read_request_log(str(tmp_path / "requests")))
    total = sum(per_batch, RequestCounts()) + restore
    assert logged.requests() >= total.requests()
    assert logged.requests("write", "metadata") == 4


def test_a_savepoint_of_a_job_goes_through_the_model_too(tmp_path):
    wrapped = shaped(Store("local", str(tmp_path / "store"), {}))
    with new_job(wrapped.url("job"), wrapped.options, "rocksdb") as job:
        job.process_batch(batch(0))
        before = process_counts()
        job.savepoint(wrapped.url("sp"))
    moved = process_counts() - before
    assert moved.requests("copy", "shared") > 0 and moved.requests("write", "metadata") == 1


# -- the model, its figures and its counts -------------------------------------------------------


def test_each_request_kind_is_counted_and_charged(tmp_path):
    url, options = behind_latency(str(tmp_path / "root"), {}, MODEL)
    fs, root = fsspec.core.url_to_fs(url, **options)
    before = process_counts()
    fs.makedirs(f"{root}/shared", exist_ok=True)
    fs.pipe_file(f"{root}/shared/a", b"x" * 5000)
    assert fs.cat_file(f"{root}/shared/a", start=0, end=100) == b"x" * 100
    assert fs.exists(f"{root}/shared/b") is False
    fs.copy(f"{root}/shared/a", f"{root}/shared/b")
    assert len(fs.ls(f"{root}/shared", detail=False)) == 2
    fs.rm_file(f"{root}/shared/b")
    with pytest.raises(FileNotFoundError):
        fs.info(f"{root}/shared/b")
    moved = process_counts() - before
    assert {k: moved.requests(k) for k in KINDS} == {
        "read": 1, "write": 1, "copy": 1, "list": 1, "head": 2, "delete": 1, "mkdir": 1}
    # a failed request (404) costs its round trip too; mkdir is no request of a store
    assert moved.requests() == 7
    assert moved.bytes("write", "shared") == 5000 and moved.bytes("read") == 100
    assert math.isclose(moved.modeled_s(), 7 * 0.001 + 5100 / 500e6, abs_tol=1e-9)
    charged(moved, MODEL)
    # a file opened for writing is one PUT of its bytes; one opened for reading one GET
    fs.makedirs(f"{root}/chk-1", exist_ok=True)
    before = process_counts()
    with fs.open(f"{root}/chk-1/data", "wb") as f:
        f.write(b"y" * 300)
        f.write(b"z" * 200)
    with fs.open(f"{root}/chk-1/data", "rb") as f:
        assert f.read() == b"y" * 300 + b"z" * 200
    moved = process_counts() - before
    assert moved.requests("write", "checkpoint") == moved.requests("read", "checkpoint") == 1
    assert moved.bytes("write") == moved.bytes("read") == 500


def test_listings_and_recursive_deletes_cost_one_request_per_thousand_objects(tmp_path):
    url, options = behind_latency(str(tmp_path / "root"), {}, LatencyModel("zero", 0.0))
    fs, root = fsspec.core.url_to_fs(url, **options)
    storage = CheckpointStorage(url, options)
    for i in range(1001):
        storage.write(f"staging/batch-1/main/part-{i:05d}", b"")
    before = process_counts()
    assert len(storage.list_files("staging")) == 1001
    storage.delete_dir("staging/batch-1")
    moved = process_counts() - before
    # 1001 objects: two pages to list, twice (the listing, then the delete's own), and two
    # DeleteObjects requests
    assert moved.requests("list", "staging") == 4
    assert moved.requests("delete", "staging") == 2
    assert fs.find(f"{root}/staging") == []


def test_counts_are_exact_under_parallel_uploads(tmp_path):
    url, options = behind_latency(str(tmp_path / "root"), {}, LatencyModel("zero", 0.0))
    storage = CheckpointStorage(url, options)
    storage.write("shared/first", b"")  # the folder exists before the threads race
    before = process_counts()

    def upload(t: int) -> None:
        for i in range(50):
            storage.write(f"shared/t{t}-{i}", b"x" * (t + 1))

    threads = [threading.Thread(target=upload, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    moved = process_counts() - before
    assert moved.requests("write", "shared") == 400
    assert moved.bytes("write", "shared") == 50 * sum(range(1, 9))


def test_the_named_model_and_figures_given_by_hand():
    named = parse_latency("s3-standard-same-region")
    assert named is MODELS["s3-standard-same-region"]
    assert (named.first_byte_ms, named.mb_per_s) == (100.0, 90.0) and "AWS" in named.source
    assert parse_latency("none") is None and parse_latency(" None ") is None
    custom = parse_latency("ms=30,mb_per_s=90")
    assert custom is not None and (custom.first_byte_ms, custom.mb_per_s) == (30.0, 90.0)
    changed = parse_latency("s3-standard-same-region,first_byte_ms=30")
    assert changed is not None and (changed.first_byte_ms, changed.mb_per_s) == (30.0, 90.0)
    assert changed.source == named.source and "changed" in changed.name
    # one request of 9 MB: the first byte, then 0.1 s at 90 MB/s
    assert math.isclose(named.request_s(9_000_000), 0.2)
    assert named.parameters()["first_byte_ms"] == 100.0
    # the storage options reproduce the model in every process that opens the filesystem
    url, options = behind_latency("s3://bucket/job", {"key": "k"}, custom)
    assert url == "kslatency://bucket/job"
    assert options["target_protocol"] == "s3" and options["target_options"] == {"key": "k"}
    assert behind_latency("s3://bucket/job", {"key": "k"}, None) == ("s3://bucket/job",
                                                                     {"key": "k"})


@pytest.mark.parametrize("spec, names", [
    ("mbps=90", "mbps"),
    ("ms=fast", "ms must be a number"),
    ("ms=-5", "first_byte_ms"),
    ("mb_per_s=0", "mb_per_s"),
    ("s3-express", "unknown model 's3-express'"),
    ("ms=30,latency=2", "'latency=2'"),
    ("", "empty"),
])
def test_bad_figures_are_refused_naming_the_parameter(spec, names):
    with pytest.raises(LatencyModelError, match=names) as caught:
        parse_latency(spec)
    assert isinstance(caught.value, KeyedStateError) and isinstance(caught.value, ValueError)


def test_bad_storage_options_are_refused_naming_the_option(tmp_path):
    base = {"target_protocol": "file", "skip_instance_cache": True}
    with pytest.raises(LatencyModelError, match=r"unknown storage option\(s\) \['latency_ms'\]"):
        fsspec.filesystem("kslatency", latency_ms=30, **base)
    with pytest.raises(LatencyModelError, match="unknown model 's3-slow'"):
        fsspec.filesystem("kslatency", model="s3-slow", **base)
    with pytest.raises(LatencyModelError, match="first_byte_ms must be a number >= 0"):
        fsspec.filesystem("kslatency", first_byte_ms="30", **base)
    with pytest.raises(LatencyModelError, match="mb_per_s must be a number > 0"):
        fsspec.filesystem("kslatency", mb_per_s=-1, **base)
    # without figures: the default model
    fs = fsspec.filesystem("kslatency", **base)
    assert fs.model is MODELS["s3-standard-same-region"]


@pytest.mark.parametrize("path, area", [
    ("bucket/job/chk-3/_metadata", "metadata"),
    ("/data/sp-1/_metadata", "metadata"),
    ("bucket/job/shared/chk-3-sub-0-1f2e-000012.sst", "shared"),
    ("bucket/job/chk-3/sub-1-private", "checkpoint"),
    ("bucket/job/staging/batch-4/main/part-00000-ab.parquet", "staging"),
    ("bucket/job/commits/batch-4-chk-5", "commits"),
    ("bucket/job/chk-2/_aborted", "markers"),
    ("bucket/job/_completed", "markers"),
    ("bucket/job/spark/offsets/4", "spark"),
    ("bucket/job", "other"),
])
def test_requests_are_counted_by_the_area_of_the_snapshot_root_they_touch(path, area):
    assert area_of(path) == area


@pytest.mark.parametrize("spec, message", [
    ("mbps=90", "'mbps' is ambiguous"),
    ("none", "benchmark 'access' has no latency model"),
])
def test_bench_refuses_a_latency_it_cannot_read_or_use_before_running(spec, message):
    from click.testing import CliRunner

    from keyedstate.cli import main

    result = CliRunner().invoke(main, ["bench", "access", "--keys", "10", "--latency", spec])
    assert result.exit_code == 2 and message in result.output
