"""``keyedstate bench NAME``: run one of the benchmarks (figures go to docs/benchmarks.md)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any, Callable

import click

from keyedstate.cli.output import stderr

BENCHMARKS = {
    "checkpoint": "benchmarks.checkpoint",
    "backend-rescale": "benchmarks.backend_rescale",
    "access": "benchmarks.access",
    "throughput": "benchmarks.throughput",
    "remote": "benchmarks.remote",
    "rescale": "benchmarks.rescale",
}


def _load_benchmark(name: str) -> Any:
    # Benchmarks live in the source tree's benchmarks/ folder, beside the package.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        return importlib.import_module(BENCHMARKS[name])
    except ModuleNotFoundError as exc:
        raise click.ClickException(
            f"benchmark {name!r} needs a source checkout of keyedstate (benchmarks/): {exc}"
        ) from exc


@click.command()
@click.argument("name", type=click.Choice(sorted(BENCHMARKS)))
@click.option("--keys", type=int, default=None, help="Override the benchmark's key count.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON result to this file.")
def bench(name: str, keys: int | None, as_json: bool, out: str | None) -> None:
    """Run a benchmark (figures belong in docs/benchmarks.md)."""
    module = _load_benchmark(name)
    kwargs: dict[str, Any] = {}
    if keys is not None:
        kwargs["keys"] = keys
    with stderr.status(f"bench {name}") as status:
        progress: Callable[[str], None] = lambda msg: status.update(f"bench {name}: {msg}")
        result = module.run(progress=progress, **kwargs)
    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    if as_json:
        click.echo(text)
    else:
        stderr.print_json(text)
