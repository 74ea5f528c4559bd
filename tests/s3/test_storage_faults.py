"""Faults and bad input on checkpoint storage: throttling, timeouts and 500s while uploading and
while restoring, refused credentials and a missing bucket. Faults come from the ``ksfault://``
wrapper (:mod:`keyedstate.testing.faults`) over a real store: the local S3 server, or a local
directory; credentials are checked by a local S3 server with authentication on."""

from __future__ import annotations

from typing import Any

import pytest

from keyedstate.errors import StorageAccessError, StorageLocationError, TransientStorageError
from keyedstate.processor.inspection import find_garbage
from keyedstate.runtime.local import LocalKeyedOperator
from keyedstate.storage.cache import all_process_caches
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.testing.faults import FaultPlan
from tests.conftest import Store
from tests.s3.conftest import TRANSFER
from tests.s3.test_object_storage import KEYS, add, counts

pytestmark = pytest.mark.integration

BACKENDS = ["rocksdb", "heap"]


@pytest.fixture
def faulty(store: Store, tmp_path: Any) -> tuple[FaultPlan, Store]:
    """``store`` seen through the fault-injecting wrapper, and its (empty) plan."""
    plan = FaultPlan(tmp_path / "faults.json")
    target = "s3" if store.kind == "s3" else "file"
    return plan, Store(store.kind, plan.url(store.base), plan.storage_options(target,
                                                                              store.options))


def open_job(store: Store, tmp_path: Any, backend: str, name: str = "job",
             **kwargs: Any) -> LocalKeyedOperator:
    return LocalKeyedOperator(store.url(name), key_types=["string"], backend=backend,
                              parallelism=2, local_dir=str(tmp_path / f"work-{name}"),
                              storage_options=store.options, transfer=TRANSFER, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("error", ["slowdown", "timeout", "internal"])
def test_transient_upload_errors_are_retried_within_the_checkpoint(faulty, tmp_path, backend,
                                                                   error):
    plan, store = faulty
    with open_job(store, tmp_path, backend) as op:
        op.process(((k, 1) for k in KEYS), add)
        plan.add("write", error, match="/shared/", times=2)
        checkpoint = op.checkpoint()
        assert len(plan.fired()) == 2 and op.storage.stats.retries >= 2
        assert find_garbage(op.storage).files == []
        expected = counts(op)
    plan.clear()
    with open_job(store, tmp_path, backend) as again:
        assert counts(again) == expected
        assert again.coordinator.latest_completed.checkpoint_id == checkpoint.checkpoint_id


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_failing_on_throttling_is_aborted_and_the_job_goes_on(faulty, tmp_path,
                                                                          backend):
    plan, store = faulty
    with open_job(store, tmp_path, backend) as op:
        op.process(((k, 1) for k in KEYS), add)
        first = op.checkpoint()
        op.process(((k, 2) for k in KEYS[:300]), add)
        plan.add("write", "slowdown", match="/shared/", times=-1)
        with pytest.raises(TransientStorageError, match="SlowDown"):
            op.checkpoint()
        plan.clear()
        # nothing the failed checkpoint wrote is left, nothing referenced was lost
        assert op.coordinator.latest_completed.checkpoint_id == first.checkpoint_id
        for f in first.metadata.files():
            op.storage.read_verified(f)
        # the job goes on: the retried checkpoint holds the batch's changes
        retried = op.checkpoint()
        assert retried.checkpoint_id > first.checkpoint_id
        # gc judges the failed checkpoint's id only below a committed one: nothing of it left
        assert find_garbage(op.storage).files == []
        expected = counts(op)
    with open_job(store, tmp_path, backend) as again:
        assert counts(again) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_retries_transient_read_errors_then_fails_clearly(faulty, tmp_path, backend):
    plan, store = faulty
    with open_job(store, tmp_path, backend) as op:
        op.process(((k, 1) for k in KEYS), add)
        op.checkpoint()
        expected = counts(op)
    for cache in all_process_caches():  # a new executor: every file is downloaded
        cache.clear()
    plan.add("read", "timeout", match="/shared/", times=2)
    with open_job(store, tmp_path, backend) as restored:
        assert counts(restored) == expected
        assert restored.storage.stats.retries >= 2
    for cache in all_process_caches():
        cache.clear()
    plan.add("read", "unavailable", match="/shared/", times=-1)
    with pytest.raises(TransientStorageError, match=r"shared/.*failed 5 times.*Retry later"):
        open_job(store, tmp_path, backend)


def test_access_refused_at_start_is_a_typed_error_before_anything_is_written(faulty,
                                                                             tmp_path):
    plan, store = faulty
    plan.add("any", "denied", times=-1)
    with pytest.raises(StorageAccessError, match="refused access.*credentials"):
        open_job(store, tmp_path, "rocksdb")
    plan.clear()
    plan.add("any", "nobucket", times=-1)
    with pytest.raises(StorageLocationError, match="does not exist.*create the bucket"):
        open_job(store, tmp_path, "rocksdb")


@pytest.mark.s3
def test_wrong_credentials_and_missing_bucket_fail_at_start(auth_s3, tmp_path):
    endpoint = {"client_kwargs": {"endpoint_url": auth_s3["endpoint"]}}
    good = {"key": auth_s3["key"], "secret": auth_s3["secret"], **endpoint}
    url = f"s3://{auth_s3['bucket']}/job"
    for wrong in ({**good, "key": "AKIAWRONGWRONGWRONG0"}, {**good, "secret": "not-it"}):
        with pytest.raises(StorageAccessError, match="refused access"):
            LocalKeyedOperator(url, key_types=["string"], storage_options=wrong,
                               local_dir=str(tmp_path / "w"))
    with pytest.raises(StorageLocationError, match="does not exist"):
        LocalKeyedOperator("s3://no-such-bucket-keyedstate/job", key_types=["string"],
                           storage_options=good, local_dir=str(tmp_path / "w"))
    # the right credentials work, and the probe left nothing behind
    with LocalKeyedOperator(url, key_types=["string"], storage_options=good,
                            local_dir=str(tmp_path / "w")) as op:
        op.process(((k, 1) for k in KEYS[:50]), add)
        op.checkpoint()
    files = CheckpointStorage(url, good).list_files()
    assert files and not [f for f in files if "probe" in f]


def test_local_directory_that_cannot_be_written_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageLocationError, match="not a directory"):
        LocalKeyedOperator(str(blocker / "job"), key_types=["string"])
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os

        if os.access(locked, os.W_OK):  # root ignores permissions
            pytest.skip("running as root")
        with pytest.raises(StorageAccessError, match="not writable"):
            LocalKeyedOperator(str(locked / "job"), key_types=["string"])
    finally:
        locked.chmod(0o700)
