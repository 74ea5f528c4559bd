"""Shared fixtures. The Spark session is started lazily, once per test session."""

from __future__ import annotations

import shutil
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

import examples
from keyedstate.storage.cache import all_process_caches
from keyedstate.testing.s3 import start_moto_server, stop_moto_server

# The venv's editable install maps ``keyedstate_examples`` (what ``keyedstate demo`` imports) to
# the main checkout's examples/; tests run from another checkout (a worktree) must run its own.
sys.modules["keyedstate_examples"] = examples


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that takes the ``spark`` fixture must be marked ``spark``: ``make test`` runs
    the unmarked tests on every core at once and the Spark tests in one process after them."""
    unmarked = [item.nodeid for item in items
                if "spark" in getattr(item, "fixturenames", ())
                and item.get_closest_marker("spark") is None]
    if unmarked:
        raise pytest.UsageError("tests taking the spark fixture without the spark marker: "
                                + ", ".join(unmarked))


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A ``local[2,4]`` SparkSession: two cores, up to 4 attempts per task (so a killed Python
    worker is retried as on a cluster). Java 17+ is required; CI always has it."""
    if shutil.which("java") is None:
        pytest.fail("Java 17+ is needed for the Spark tests (pytest -m 'not spark' skips them)")
    from keyedstate.spark.session import local_session

    session = local_session("local[2,4]", "keyedstate-tests")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A local S3-compatible server (moto) on loopback; yields its endpoint URL."""
    try:
        proc, endpoint = start_moto_server()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield endpoint
    stop_moto_server(proc, timeout_s=10)


S3_CREDENTIALS = {"key": "testing", "secret": "testing"}


@pytest.fixture
def s3_bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh bucket: yields (``s3://bucket``, fsspec storage options)."""
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = f"ks-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing"
                 ).create_bucket(Bucket=bucket)
    options = {**S3_CREDENTIALS, "client_kwargs": {"endpoint_url": s3_server}}
    yield f"s3://{bucket}", options


@dataclass
class Store:
    """A fresh snapshot root: ``url(name)`` is a folder in it, ``options`` its fsspec options,
    ``kind`` "local" or "s3" (or what a test wraps it in)."""

    kind: str
    base: str
    options: dict[str, Any]

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    """A fresh :class:`Store`, once a local directory and once a bucket of the local S3
    server (marked ``s3``): the object-storage suite (``tests/s3/``) and the same tests through
    the latency-shaping filesystem (``tests/testing/``) run on both. No test sees another's
    cached files."""
    if request.param == "local":
        yield Store("local", str(tmp_path / "store"), {})
    else:
        url, options = request.getfixturevalue("s3_bucket")
        yield Store("s3", url, options)
    for cache in all_process_caches():
        cache.clear()
