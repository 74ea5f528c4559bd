"""``keyedstate chaos``: the chaos soak (:mod:`keyedstate.testing.chaos`, ``docs/reliability.md``)."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from keyedstate.cli.output import EXIT_FAILED, json_option, stderr


@click.command()
@click.option("--batches", default=500, show_default=True, help="Micro-batches to run.")
@click.option("--seed", type=int, default=None,
              help="Seed of every random choice (printed first; default: random).")
@click.option("--master", default="local-cluster[2,1,1024]", show_default=True,
              help="Spark master; executor kills need local-cluster[E,C,M].")
@click.option("--faults-per-kind", type=int, default=None,
              help="Faults of each kind (worker, executor, driver, abort; storage: of each "
                   "of its 3 points; savepoint: of each of the 4 job ends; async: of each of "
                   "its 8 points; rollbacks; 3 same-session restarts with a changed "
                   "definition) [default: batches / 10; needs 9 per fault + 2 batches, and "
                   "with async jobs 8 more per fault in them].")
@click.option("--rows", "rows_per_batch", default=120, show_default=True,
              help="Input rows per batch.")
@click.option("--keys", default=400, show_default=True, help="Distinct keys.")
@click.option("--backend", type=click.Choice(["rocksdb", "heap"]), default="rocksdb",
              show_default=True)
@click.option("--checkpointing", type=click.Choice(["sync", "async", "mixed"]), default="sync",
              show_default=True,
              help="How the jobs checkpoint: sync (every job synchronous, the library's "
                   "default mode), async (every job with keyedstate.checkpointing.async-upload, "
                   "some with max-concurrent-checkpoints 2) or mixed (drawn per job start, and "
                   "per driver restarted after a kill: both modes and the restarts from one "
                   "to the other). With async jobs the soak also draws the asynchronous "
                   "phase's 8 fault points (storage errors on the upload, the "
                   "acknowledgement, _metadata and the registry; the driver killed before "
                   "and after the sink commit of a completed checkpoint and between Spark's "
                   "commit log entry and the completion; a worker killed while it uploads), "
                   "--faults-per-kind of each on free files of async jobs (the plan says "
                   "when they do not fit).")
@click.option("--s3", is_flag=True,
              help="Checkpoints and savepoints on a local S3 server (moto, started here).")
@click.option("--dir", "run_dir", type=click.Path(file_okay=False), default=None,
              help="A fresh run directory (default: a temporary one, kept on failure).")
@click.option("--keep", is_flag=True, help="Keep checkpoints and inputs after a passing run.")
@json_option("Print the report as JSON.")
def chaos(batches: int, seed: int | None, master: str, faults_per_kind: int | None,
          rows_per_batch: int, keys: int, backend: str, checkpointing: str, s3: bool,
          run_dir: str | None, keep: bool, as_json: bool) -> None:
    """Soak a keyed job under random kills, restarts, rescales, aborted checkpoints and
    corrupted files, and check it against an oracle (exit status 1 on any violation)."""
    from keyedstate.testing.chaos.runner import ChaosConfig, run_chaos

    config = ChaosConfig(batches=batches, seed=seed, master=master,
                         faults_per_kind=faults_per_kind, rows_per_batch=rows_per_batch,
                         keys=keys, backend=backend, s3=s3, run_dir=run_dir, keep=keep,
                         checkpointing=checkpointing)
    report = run_chaos(config, log=lambda msg: stderr.print(msg, highlight=False))
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, default=str))
    else:
        _print(report)
    if not report.passed:
        # The report above says what failed; no "Error:" line repeats it.
        raise SystemExit(EXIT_FAILED)


def _print(report: object) -> None:
    r = report.to_json()  # type: ignore[attr-defined]
    table = Table(title=f"keyedstate chaos, seed {r['seed']}: "
                        + ("[green]PASSED[/green]" if r["passed"] else "[red]FAILED[/red]"))
    table.add_column("what")
    table.add_column("value", justify="right")
    eo = r["exactly_once"]
    shared = r.get("shared_output", {})
    rows = [("batches", str(r["batches"])), ("seconds", str(r["seconds"])),
            ("drivers started", str(r["drivers_started"]))]
    for kind, n in r["injected"].items():
        rec = r["recoveries"].get(kind, {})
        rows.append((f"faults: {kind}", f"{n} of {r['planned'].get(kind, 0)} planned; "
                                        f"recovery median {rec.get('median_s')} s, "
                                        f"max {rec.get('max_s')} s"))
    cp = r.get("checkpointing") or {}
    if cp:
        points = {p.split(":", 1)[1]: n for p, n in r["injected_by_point"].items()
                  if p.startswith("async:")}
        rows += [("checkpointing", f"{cp['mode']}: jobs {json.dumps(cp['jobs'])}, query "
                                   f"starts {json.dumps(cp['query_starts'])}"),
                 ("  switches between modes", json.dumps(cp["switches"])),
                 ("  async points injected", json.dumps(points)),
                 ("  discards (batches) / unexplained",
                  f"{cp['discards']} ({cp['discarded_batches']}) / "
                  f"{len(cp['unexplained_discards'])}")]
    rows += [("plan note", note) for note in r.get("plan_notes", [])]
    rows += [("exactly-once violations", str(eo.get("violations"))),
             ("final state (state processor API)",
              f"{r['state'].get('expected', 0)} entries, {r['state'].get('violations')} differ"),
             ("corruption drills", json.dumps(r["drills"].get("outcomes", {}))),
             ("positions drills (refused / run)",
              f"{r['drills'].get('positions', {}).get('refused')} / "
              f"{r['drills'].get('positions', {}).get('count')}"),
             ("lineage branches (rows, violations)",
              ", ".join(f"{b['branch']}: {b['rows']}, {b['violations']}"
                        for b in eo.get("branches", []))),
             ("job ends (planned: taken by)",
              ", ".join(f"{b['planned']}: {b['via']}" for b in r.get("boundaries", []))),
             ("second job in the shared output path",
              f"{shared.get('second_job', {}).get('violations')} violations; soak rows lost "
              f"{sum(shared.get('soak_rows_lost_in_those_batches', {}).values())}"),
             ("orphans after gc / missing files",
              f"{r['checkpoint_dirs'].get('orphans_after_gc')} / "
              f"{len(r['checkpoint_dirs'].get('referenced_but_missing', []))}"),
             ("max RSS MiB (executor JVM / Python worker)",
              f"{r['memory'].get('max_rss_mib', {}).get('executor_jvm')} / "
              f"{r['memory'].get('max_rss_mib', {}).get('python_worker')}"),
             ("run directory", r["run_dir"])]
    for what, value in rows:
        table.add_row(what, value)
    Console().print(table)
    for failure in r["failures"]:
        stderr.print(f"[red]FAIL[/red] {failure}", highlight=False)

