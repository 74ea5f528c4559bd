"""What the examples share besides keyedstate: the directory a run works in, input files fed
one micro-batch at a time, and the JSON report with the oracle's verdicts.

Each example is a job a user would write (its ``KeyedProcessFunction``), a generator of its
input, an oracle computing the expected output from that input in plain Python, and a runner
per runtime. The runners here are the plumbing around them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from keyedstate.errors import TargetNotEmptyError

#: The file a run writes into its directory before anything else. It marks the directory as a
#: run's own: a later run (of any example, or ``keyedstate demo``) empties such a directory and
#: starts over; any other non-empty directory is refused.
MARKER = ".keyedstate-demo"

#: ``--dir``'s help, the same for every example and ``keyedstate demo``.
DIRECTORY_HELP = (
    "Where input, outputs and checkpoints go: a new or empty directory (created), or one an "
    "earlier run made (it holds " + MARKER + "; its content is deleted and written anew). "
    "Any other non-empty directory is refused and left as it is.")


def check_directory(directory: str) -> None:
    """The rule for a run's ``--dir``, checked before anything runs (reads only): it may be
    missing, an empty directory, or a directory holding :data:`MARKER` (an earlier run's).
    Raises :class:`~keyedstate.errors.TargetNotEmptyError` naming the directory and what is
    in it otherwise (a file, or a directory with anything else in it, ``--dir .`` in a
    working directory with files included): a run never deletes what it did not write."""
    if not os.path.lexists(directory):
        return
    if not os.path.isdir(directory):
        raise TargetNotEmptyError(
            f"--dir {directory} is a file; give a new directory, or an empty one")
    entries = sorted(os.listdir(directory))
    if not entries or MARKER in entries:
        return
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3
                                      else "")
    raise TargetNotEmptyError(
        f"--dir {os.path.abspath(directory)} is not empty ({shown}) and no earlier run made it "
        f"(it has no {MARKER} file); a run deletes its directory's content, so it only uses a "
        f"new or empty directory or its own. Give another --dir, e.g. a new subdirectory")


def prepare_directory(directory: str) -> None:
    """Make ``directory`` a run's own, empty but for :data:`MARKER`: check it
    (:func:`check_directory`), delete an earlier run's content (the directory itself stays:
    it may be the working directory), create it if missing, and write the marker first."""
    check_directory(directory)
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif name != MARKER:
            os.remove(path)
    with open(os.path.join(directory, MARKER), "w") as f:
        f.write("Made by a keyedstate example run (keyedstate demo, examples/*.py). A later run "
                "deletes everything in this directory.\n")


def add_directory_option(parser: argparse.ArgumentParser, default: str) -> None:
    """``--dir`` of an example's command line: checked as it is parsed
    (:func:`check_directory`), so a refused directory ends the command with its reason (exit
    status 2) before anything runs."""
    def directory(value: str) -> str:
        try:
            check_directory(value)
        except TargetNotEmptyError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        return value

    parser.add_argument("--dir", default=default, type=directory, help=DIRECTORY_HELP)


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


@dataclass(frozen=True)
class Check:
    """One verdict of an example's oracle. A report holds its checks by a stable snake_case
    identifier (what scripts match on); ``description`` is the sentence a person reads. In a
    report's JSON: ``"checks": {"<identifier>": {"passed": true, "description": "..."}}``.
    Truthy exactly when it passed."""

    passed: bool
    description: str

    def __bool__(self) -> bool:
        return self.passed


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
    checks: dict[str, Check] = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks.values())

    def print_json(self) -> int:
        """Print the report as JSON; returns the exit status: 0 verified, 1 not."""
        print(json.dumps({**asdict(self), "verified": self.verified}, indent=2, default=str))
        return 0 if self.verified else 1
