"""What the examples share besides keyedstate: input files fed one micro-batch at a time, and
the JSON report with the oracle's verdicts.

Each example is a job a user would write (its ``KeyedProcessFunction``), a generator of its
input, an oracle computing the expected output from that input in plain Python, and a runner
per runtime. The runners here are the plumbing around them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet_files(directory: str, table: pa.Table, files: int) -> list[str]:
    """``table`` cut in order into ``files`` Parquet files ``<directory>/events-<n:04d>.parquet``
    (created); returns their paths in order. Each file is one micro-batch of the job."""
    os.makedirs(directory, exist_ok=True)
    per_file = -(-table.num_rows // files)
    paths = []
    for n in range(files):
        path = os.path.join(directory, f"events-{n:04d}.parquet")
        pq.write_table(table.slice(n * per_file, per_file), path)
        paths.append(path)
    return paths


def publish(paths: list[str], input_dir: str) -> None:
    """Copy ``paths`` into ``input_dir``, the directory a Spark file source reads, with
    modification times in their order: with ``maxFilesPerTrigger`` 1 the source takes one
    file per micro-batch, oldest first, and the examples' oracles rely on that order (it is
    the order a local run reads them in). The times follow the files' numbers, so files
    published by a later call come after."""
    os.makedirs(input_dir, exist_ok=True)
    for path in paths:
        target = os.path.join(input_dir, os.path.basename(path))
        shutil.copy(path, target)
        mtime = 1_700_000_000 + int(os.path.basename(path).split("-")[1].split(".")[0])
        os.utime(target, (mtime, mtime))


@dataclass
class Report:
    """What a run did and whether its outputs match the oracle (one verdict per check)."""

    example: str
    runtime: str
    events: int
    batches: int = 0
    seconds: float = 0.0
    outputs: dict[str, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def print_json(self) -> int:
        """Print the report as JSON; returns the exit status: 0 verified, 1 not."""
        print(json.dumps({**asdict(self), "verified": self.verified}, indent=2, default=str))
        return 0 if self.verified else 1
