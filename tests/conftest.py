"""Shared fixtures. The Spark session is started lazily, once per test session."""

from __future__ import annotations

import shutil
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
