"""A local SparkSession configured for keyedstate (demo, benchmarks, tests)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def local_session(master: str = "local[2]", app_name: str = "keyedstate",
                  extra: dict[str, str] | None = None) -> SparkSession:
    """``master`` may be ``local[N]``, ``local[N,F]`` (F task attempts) or
    ``local-cluster[E,C,M]`` (E executor JVMs). Executors' Python is this interpreter."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # Python workers import keyedstate (and the caller's modules) from the driver's path.
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
        [*os.environ.get("PYTHONPATH", "").split(os.pathsep), *paths]).keys()).strip(os.pathsep)
    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true"))
    for key, value in (extra or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
