"""Shared fixtures. The Spark session is started lazily, once per test session."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import uuid
from typing import Any, Iterator

import pytest


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A local S3-compatible server (moto) on loopback; yields its endpoint URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("the local S3 server (moto) did not start")
            time.sleep(0.2)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


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
