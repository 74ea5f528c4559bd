"""``keyedstate bench NAME``: run one of the benchmarks (figures go to docs/benchmarks.md).

The benchmarks are the package ``keyedstate_benchmarks`` (the source tree's ``benchmarks/``
folder, installed under that name by ``pip install -e .``); they are imported by name only
when a benchmark runs, so the library and the other commands never need them."""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any, Callable

import click

from keyedstate.cli.output import stderr
from keyedstate.errors import LatencyModelError

BENCHMARKS = {
    "checkpoint": "keyedstate_benchmarks.checkpoint",
    "backend-rescale": "keyedstate_benchmarks.backend_rescale",
    "access": "keyedstate_benchmarks.access",
    "throughput": "keyedstate_benchmarks.throughput",
    "remote": "keyedstate_benchmarks.remote",
    "rescale": "keyedstate_benchmarks.rescale",
    "evolution": "keyedstate_benchmarks.evolution",
    "sinks": "keyedstate_benchmarks.sinks",
    "growth": "keyedstate_benchmarks.growth",
    "scale-model": "keyedstate_benchmarks.scale_model",
    "shards": "keyedstate_benchmarks.shards",
}
#: the benchmarks ``--sweep`` runs over a grid of sizes instead of one, and the module of each
SWEEPS = {"throughput": "keyedstate_benchmarks.throughput_sweep"}


def _load_benchmark(name: str, sweep: bool = False) -> Any:
    try:
        return importlib.import_module(SWEEPS[name] if sweep else BENCHMARKS[name])
    except ModuleNotFoundError as exc:
        # Either the benchmarks are not installed (a wheel built without them, or an editable
        # install older than their package-dir entry) or one of them needs a missing extra.
        raise click.ClickException(
            f"benchmark {name!r} can't be imported ({exc}); install keyedstate from a source "
            f"checkout with its benchmark extra: pip install -e '.[bench]'"
        ) from exc


@click.command()
@click.argument("name", type=click.Choice(sorted(BENCHMARKS)))
@click.option("--keys", type=int, default=None, help="Override the benchmark's key count.")
@click.option("--batches", type=click.IntRange(min=2), default=None,
              help="Override the benchmark's measured batches (growth, remote, shards, sinks, "
                   "throughput: with --interleave, the rounds).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Also write the JSON result to this file.")
@click.option("--latency", metavar="MODEL", default=None,
              help="Put the checkpoints and savepoints behind a latency model (growth, "
                   "remote, scale-model): none, s3-standard-same-region, or figures such as "
                   "ms=30,mb_per_s=90 (docs/object-storage.md).")
@click.option("--sweep", is_flag=True,
              help="Run over a grid of batch sizes instead of one (throughput: events per "
                   "batch 100 K to 5 M, distinct keys 10 K to 1 M; --keys sets the key count "
                   "of the events sweep; docs/benchmarks-spark.md).")
@click.option("--cold-restore", is_flag=True,
              help="remote only: measure just a restore on a worker without a copy (both "
                   "backends; docs/object-storage.md).")
@click.option("--compare-checkpointing", is_flag=True,
              help="growth only: at --keys, per backend, checkpoints on local disk, behind "
                   "the latency model (default s3-standard-same-region) synchronous, and "
                   "asynchronous, judged by the asynchronous phase's goals "
                   "(docs/benchmarks.md).")
@click.option("--interleave", is_flag=True,
              help="throughput only: run the floors and the systems compared batch by batch "
                   "in turns in one Spark session (each round one batch of each, the order "
                   "rotating, every query and its state kept across rounds), so that the "
                   "machine's load drifts under all alike, and compare RocksDB's state "
                   "overhead with the heap's round by round (docs/benchmarks-spark.md).")
@click.option("--systems", metavar="NAMES", default=None,
              help="throughput only: the systems to run, comma-separated names or named "
                   "sets: all, interleaved (--interleave's default), floor (that, the "
                   "built-in aggregation and the stateless systems, judged against it round "
                   "by round; docs/benchmarks-spark.md).")
def bench(name: str, keys: int | None, batches: int | None, as_json: bool, out: str | None,
          latency: str | None, sweep: bool, cold_restore: bool,
          compare_checkpointing: bool, interleave: bool, systems: str | None) -> None:
    """Run a benchmark (figures belong in docs/benchmarks.md)."""
    if sweep and name not in SWEEPS:
        raise click.BadParameter(f"benchmark {name!r} has no sweep; only "
                                 f"{', '.join(sorted(SWEEPS))} has one", param_hint="--sweep")
    module = _load_benchmark(name, sweep)
    kwargs: dict[str, Any] = {}
    if keys is not None:
        kwargs["keys"] = keys
    if batches is not None:
        if "batches" not in inspect.signature(module.run).parameters:
            raise click.BadParameter(f"benchmark {name!r} has no batch count to set",
                                     param_hint="--batches")
        kwargs["batches"] = batches
    if cold_restore:
        if "cold_restore" not in inspect.signature(module.run).parameters:
            raise click.BadParameter(f"benchmark {name!r} has no cold-restore measurement; "
                                     f"only remote has", param_hint="--cold-restore")
        kwargs["cold_restore"] = True
    if compare_checkpointing:
        if "checkpointing" not in inspect.signature(module.run).parameters:
            raise click.BadParameter(f"benchmark {name!r} has no checkpointing comparison; "
                                     f"only growth has", param_hint="--compare-checkpointing")
        kwargs["checkpointing"] = module.MODES
    if interleave:
        if "interleave" not in inspect.signature(module.run).parameters:
            raise click.BadParameter(f"benchmark {name!r}{' --sweep' if sweep else ''} has no "
                                     f"interleaved mode; only throughput has",
                                     param_hint="--interleave")
        kwargs["interleave"] = True
    if systems is not None:
        kwargs["systems"] = _systems(module, name, systems)
    if latency is not None:
        from keyedstate.testing.latency import parse_latency

        try:
            kwargs["latency"] = parse_latency(latency)
        except LatencyModelError as exc:
            raise click.BadParameter(str(exc), param_hint="--latency") from exc
        if "latency" not in inspect.signature(module.run).parameters:
            raise click.BadParameter(f"benchmark {name!r} has no latency model; only those "
                                     f"with checkpoints on a store take one (growth, remote, "
                                     f"scale-model)",
                                     param_hint="--latency")
        if compare_checkpointing and kwargs["latency"] is None:
            raise click.BadParameter("--compare-checkpointing compares checkpoints behind a "
                                     "latency model with local disk: give one (or leave "
                                     "--latency out for s3-standard-same-region), not none",
                                     param_hint="--latency")
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


def _systems(module: Any, name: str, value: str) -> list[str]:
    """``--systems``' value as the benchmark's ``systems``: each comma-separated part a
    system's name or a set's (the benchmark's ``system_sets()``), expanded in order, each
    system once. Refused where ``run`` takes no systems, and for a name the benchmark does
    not know (its ``SYSTEMS``, where it has one)."""
    if "systems" not in inspect.signature(module.run).parameters:
        raise click.BadParameter(f"benchmark {name!r} has no systems to choose",
                                 param_hint="--systems")
    sets: dict[str, tuple[str, ...]] = (module.system_sets() if hasattr(module, "system_sets")
                                        else {})
    names: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        names.extend(sets.get(part, (part,)) if part else ())
    known = getattr(module, "SYSTEMS", None)
    unknown = [n for n in names if known is not None and n not in known]
    if unknown or not names:
        raise click.BadParameter(
            f"unknown systems {unknown}; known: {', '.join([*sets, *(known or ())])}"
            if unknown else "name at least one system", param_hint="--systems")
    return list(dict.fromkeys(names))
