"""A job's checkpoint statistics as Prometheus metrics, read from its checkpoint directory.

Every completed checkpoint records its statistics in ``_metadata`` (:mod:`keyedstate.checkpoint.
stats`: Flink's ``CompletedCheckpointStats``), whichever runtime wrote it (Spark, Spark Connect,
the local runtime). :class:`CheckpointMetricsCollector` turns the latest one into Prometheus
gauges on every scrape, so metrics need no hook in the running job: a scrape reads one small
``_metadata`` (the same read ``keyedstate checkpoints list`` does). Serve them from the job's
driver or notebook (:func:`serve_metrics`) or from a sidecar (``keyedstate metrics serve DIR``);
docs/metrics.md has the metric names and a scrape configuration.

prometheus_client is an optional dependency (``pip install 'keyedstate[metrics]'``), imported
when a collector is made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any, Mapping

from keyedstate.checkpoint.properties import WATERMARK
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.stats import CompletedCheckpointStats, stats_of
from keyedstate.errors import KeyedStateError, MissingDependencyError, NoCheckpointError
from keyedstate.storage.checkpoint_storage import CheckpointStorage

log = logging.getLogger("keyedstate")

#: Prefix of every metric name.
NAMESPACE = "keyedstate"

#: Gauges of the latest checkpoint: name (after ``keyedstate_last_checkpoint_``), help, the
#: :class:`CompletedCheckpointStats` field and the factor to the metric's base unit.
CHECKPOINT_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("id", "Id of the latest completed checkpoint", "checkpoint_id", 1),
    ("batch_id", "Micro-batch the latest checkpoint covers", "batch_id", 1),
    ("timestamp_seconds", "When the latest checkpoint was triggered (Unix time)",
     "trigger_ms", 1e-3),
    ("end_to_end_seconds", "Trigger to the last subtask's acknowledgement (the batch's work)",
     "end_to_end_ms", 1e-3),
    ("sync_seconds", "Synchronous snapshot phase, slowest subtask", "sync_ms", 1e-3),
    ("async_seconds", "Asynchronous snapshot phase (upload), slowest subtask", "async_ms", 1e-3),
    ("restore_seconds", "Getting the state before the batch, slowest subtask", "restore_ms",
     1e-3),
    ("full_size_bytes", "All state the checkpoint references", "full_bytes", 1),
    ("incremental_size_bytes", "Bytes the checkpoint wrote", "incremental_bytes", 1),
    ("uploaded_bytes", "Bytes uploaded to checkpoint storage", "uploaded_bytes", 1),
    ("downloaded_bytes", "Bytes restores downloaded before the batch", "downloaded_bytes", 1),
    ("parallelism", "Subtasks of the checkpoint", "parallelism", 1),
    ("reused_subtasks", "Subtasks that reused their live state", "reused_subtasks", 1),
    ("restored_subtasks", "Subtasks that restored their state", "restored_subtasks", 1),
    ("caught_up_subtasks", "Restored subtasks that caught a stale live copy up",
     "caught_up_subtasks", 1),
    ("rows_in", "Rows the batch's subtasks received", "rows_in", 1),
    ("rows_out", "Rows the batch's subtasks emitted", "rows_out", 1),
)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise MissingDependencyError(
            "Prometheus metrics need prometheus_client: pip install 'keyedstate[metrics]'"
        ) from exc
    return prometheus_client


class CheckpointMetricsCollector:
    """A Prometheus collector (``prometheus_client.registry.Collector``) of the job whose
    checkpoints are in ``path``: on each scrape, the latest checkpoint's statistics as gauges
    (:data:`CHECKPOINT_GAUGES`), its watermark, its age, and ``keyedstate_up`` (1: a
    checkpoint was read; 0: none yet, or unreadable: the scrape still succeeds, the reason is
    logged). Every sample is labelled ``checkpoint_dir``.

    Made for a path that exists (a job directory, possibly without a checkpoint yet), else
    :class:`~keyedstate.errors.NoCheckpointError` naming it; raises
    :class:`~keyedstate.errors.MissingDependencyError` without prometheus_client."""

    def __init__(self, path: str, storage_options: Mapping[str, Any] | None = None, *,
                 strict: bool = False) -> None:
        _prometheus()
        from prometheus_client.core import GaugeMetricFamily

        self._gauge = GaugeMetricFamily
        self.path = path
        self.storage_options = storage_options
        #: raise what reading the latest checkpoint raises (one-shot reads), instead of
        #: reporting ``keyedstate_up 0`` (a scrape)
        self.strict = strict
        storage = CheckpointStorage(path, storage_options)
        if not storage.fs.exists(storage.root):
            raise NoCheckpointError(f"{storage.url} does not exist: give the checkpoint "
                                    f"directory of a job (execution.checkpointing.dir)")
        self.url = storage.url

    def latest(self) -> tuple[CompletedCheckpointStats, int | None] | None:
        """The latest checkpoint's statistics and watermark (ms), None if there is none."""
        try:
            snapshot = resolve_snapshot(self.path, self.storage_options)
        except NoCheckpointError:
            if self.strict:
                raise
            return None
        watermark = snapshot.metadata.properties.get(WATERMARK)
        return stats_of(snapshot.metadata), int(watermark) if watermark else None

    def collect(self) -> Iterator[Any]:
        """The metric families of one scrape (prometheus_client calls it); never raises
        unless ``strict``."""
        gauge = self._gauge
        labels = ["checkpoint_dir"]
        try:
            found = self.latest()
        except (KeyedStateError, OSError) as exc:  # a scrape reports, never fails
            if self.strict:
                raise
            log.warning("metrics: reading %s failed: %s", self.url, exc)
            found = None
        up = gauge(f"{NAMESPACE}_up", "1 when the latest checkpoint was read", labels=labels)
        up.add_metric([self.url], 0 if found is None else 1)
        yield up
        if found is None:
            return
        row, watermark = found
        for name, help_text, field, factor in CHECKPOINT_GAUGES:
            value = getattr(row, field)
            if value is None:
                continue
            family = gauge(f"{NAMESPACE}_last_checkpoint_{name}", help_text, labels=labels)
            family.add_metric([self.url], float(value) * factor)
            yield family
        if row.trigger_ms is not None:
            age = gauge(f"{NAMESPACE}_last_checkpoint_age_seconds",
                        "Seconds since the latest checkpoint was triggered (output freshness)",
                        labels=labels)
            age.add_metric([self.url], max(0.0, time.time() - row.trigger_ms / 1000))
            yield age
        if watermark is not None:
            family = gauge(f"{NAMESPACE}_watermark_seconds",
                           "The event-time watermark after the latest batch (Unix time)",
                           labels=labels)
            family.add_metric([self.url], watermark / 1000)
            yield family


def metrics_text(path: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """The metrics of the latest checkpoint in ``path`` (a job's checkpoint directory, a
    checkpoint or savepoint), once, in Prometheus' text format; raises what reading it raises
    (:class:`~keyedstate.errors.NoCheckpointError` when there is none)."""
    prometheus = _prometheus()
    registry = prometheus.CollectorRegistry()
    registry.register(CheckpointMetricsCollector(path, storage_options, strict=True))
    return str(prometheus.generate_latest(registry).decode())


def serve_metrics(path: str, port: int, *, address: str = "127.0.0.1",
                  storage_options: Mapping[str, Any] | None = None) -> Any:
    """Serve the metrics of the job in ``path`` over HTTP at ``http://address:port/metrics``
    from a daemon thread of this process (a driver, a notebook); returns the server (its
    ``shutdown()`` stops it). ``address`` defaults to loopback: expose it on purpose."""
    prometheus = _prometheus()
    registry = prometheus.CollectorRegistry()
    registry.register(CheckpointMetricsCollector(path, storage_options))
    server, _thread = prometheus.start_http_server(port, addr=address, registry=registry)
    return server
