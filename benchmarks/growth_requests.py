"""What ``bench growth`` reads from a latency model's request log (``kslatency://``,
:mod:`keyedstate.testing.latency`): a batch's requests and the phases the checkpoint
statistics do not record; and the checks and words of a run behind a model."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Sequence

from keyedstate.testing.latency import LatencyModel, RequestRecord, counts_of

#: The phases of a batch that only a latency model's request log times (:mod:`.growth`).
LOGGED_PHASES = ("staging_s", "metadata_commit_s", "commit_requests_s", "output_commit_s")


def request_phases(records: Sequence[RequestRecord], start: float, end: float,
                   driver_pid: int, sink_s: float) -> dict[str, Any]:
    """What the requests logged from ``start`` to ``end`` tell of one batch: ``staging_s``
    (the slowest worker process's wall seconds writing staged output), ``metadata_commit_s``
    (the driver's ``_metadata`` PUTs), ``commit_requests_s`` (the driver's requests after
    the sink: the commit marker, deleting the staged files, listing old markers),
    ``output_commit_s`` (those plus ``sink_s``, the sink's own commit: the sink-commit step
    but for its Python between requests), the requests of the driver and of the workers
    with their modeled seconds, ``requests`` (every process's, by kind and area) and
    ``driver_requests_detail`` (the driver's, by kind and area: it makes them one after
    another, on the batch's path)."""
    inside = [r for r in records if start <= r.t < end]
    driver = counts_of([r for r in inside if r.pid == driver_pid])
    workers = {pid: counts_of([r for r in inside if r.pid == pid])
               for pid in {r.pid for r in inside if r.pid != driver_pid}}
    commit_requests_s = (driver.wall_s(area="commits") + driver.wall_s("delete", "staging")
                         + driver.wall_s("list", "staging"))
    return {
        "staging_s": max((w.wall_s("write", "staging") for w in workers.values()), default=0.0),
        "metadata_commit_s": driver.wall_s("write", "metadata"),
        "commit_requests_s": commit_requests_s,
        "output_commit_s": sink_s + commit_requests_s,
        "driver_requests": driver.requests(), "driver_modeled_s": driver.modeled_s(),
        "worker_requests": sum(w.requests() for w in workers.values()),
        "worker_modeled_s": sum(w.modeled_s() for w in workers.values()),
        "requests": counts_of(inside).as_dict(),
        "driver_requests_detail": driver.as_dict(),
    }


def check_protocol_installed() -> None:
    """Spark's Python workers open ``kslatency://`` through fsspec's entry points, without
    importing the wrapper first: refuse to start (``MissingDependencyError``) where a fresh
    Python does not find the protocol (an editable install made before its entry point)."""
    from keyedstate.errors import MissingDependencyError

    probe = subprocess.run([sys.executable, "-c", "import fsspec; "
                            "fsspec.get_filesystem_class('kslatency')"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise MissingDependencyError(
            "kslatency:// is not registered in this Python's installed metadata, so Spark's "
            "Python workers can't open the checkpoints; reinstall keyedstate (pip install -e "
            f"'.[bench]', or make install) to register its fsspec entry point. "
            f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'no error'})")


def describe_store(store: str, model: LatencyModel | None) -> str:
    """Where a run's checkpoints went, in words (the JSON's and the figure's)."""
    where = "moto S3 server on loopback, via s3fs" if store == "s3" else "a local directory"
    if model is None:
        return where
    bandwidth = f", {model.mb_per_s:g} MB/s per stream" if model.mb_per_s else ""
    return f"{where}, behind {model.name} ({model.first_byte_ms:g} ms per request{bandwidth})"

