"""The ``keyedstate`` command line: one click group, :func:`main` (the console script
``keyedstate = keyedstate.cli:main``, also ``python -m keyedstate.cli``).

One module per command family, each attached here explicitly; what they share (``--json``,
``--storage-options``, byte formats, error -> exit status) is :mod:`keyedstate.cli.output`.
"""

from __future__ import annotations

import click

from keyedstate.cli.bench import bench
from keyedstate.cli.chaos import chaos
from keyedstate.cli.checkpoints import checkpoints
from keyedstate.cli.demo import demo
from keyedstate.cli.gc import gc
from keyedstate.cli.metrics import metrics
from keyedstate.cli.savepoint import savepoint
from keyedstate.cli.state import state_group
from keyedstate.cli.storage import storage


@click.group()
# The installed distribution's version (importlib.metadata), under the command's own name also
# when run as ``python -m keyedstate.cli``.
@click.version_option(package_name="keyedstate", prog_name="keyedstate")
def main() -> None:
    """keyedstate: Flink-grade keyed state for stateful stream processing on PySpark."""


main.add_command(demo)
main.add_command(bench)
main.add_command(checkpoints)
main.add_command(savepoint)
main.add_command(gc)
main.add_command(state_group)
main.add_command(storage)
main.add_command(metrics)
main.add_command(chaos)

__all__ = ["main"]
