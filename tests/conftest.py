"""Shared fixtures. Spark sessions are started lazily, once per test session."""

from __future__ import annotations

import os
import shutil
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator["object"]:
    """A ``local[2]`` SparkSession (skips only when Java is absent, which CI never is)."""
    if shutil.which("java") is None:
        pytest.skip("Java 17+ is needed for Spark tests")
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", os.sys.executable)  # type: ignore[attr-defined]
    session = (
        SparkSession.builder.master("local[2]")
        .appName("keyedstate-tests")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    yield session
    session.stop()
