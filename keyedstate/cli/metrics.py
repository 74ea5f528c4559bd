"""``keyedstate metrics``: a job's checkpoint statistics as Prometheus metrics
(:mod:`keyedstate.processor.metrics`, docs/metrics.md)."""

from __future__ import annotations

import threading

import click

from keyedstate.cli.output import parse_storage_options, reported_errors, storage_options_option


@click.group()
def metrics() -> None:
    """Prometheus metrics of a job, read from its checkpoints (pip install
    'keyedstate[metrics]')."""


@metrics.command("show")
@click.argument("path")
@storage_options_option("fsspec options as a JSON object (credentials, endpoint).")
def show(path: str, storage_options: str | None) -> None:
    """Print the metrics of PATH's latest checkpoint once, in Prometheus' text format (PATH: a
    job's checkpoint directory, a checkpoint or a savepoint). Reads only."""
    from keyedstate.processor.metrics import metrics_text

    with reported_errors():
        click.echo(metrics_text(path, parse_storage_options(storage_options)), nl=False)


@metrics.command("serve")
@click.argument("path")
@click.option("--port", default=9464, show_default=True, type=click.IntRange(1, 65535),
              help="Port of the HTTP endpoint (/metrics).")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface, on purpose).")
@storage_options_option("fsspec options as a JSON object (credentials, endpoint).")
def serve(path: str, port: int, address: str, storage_options: str | None) -> None:
    """Serve the metrics of the job whose checkpoint directory is PATH at
    http://ADDRESS:PORT/metrics until interrupted (a sidecar beside the job: each scrape reads
    the latest checkpoint; keyedstate_up is 0 while there is none). Reads only."""
    from keyedstate.processor.metrics import serve_metrics

    with reported_errors():
        server = serve_metrics(path, port, address=address,
                               storage_options=parse_storage_options(storage_options))
        click.echo(f"serving the metrics of {path} at http://{address}:{port}/metrics", err=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            server.shutdown()
