"""What the benchmarks make of the latency wrapper's request log (no Spark, nothing timed):
``bench growth`` gives each batch the requests logged in its window and times the phases the
checkpoint statistics do not record from them; ``--latency`` is read before anything runs."""

from __future__ import annotations

import pytest

from benchmarks import growth, growth_requests
from benchmarks.common import behind, latency_model
from keyedstate.errors import LatencyModelError
from keyedstate.testing.latency import RequestRecord


def record(t: float, pid: int, kind: str, area: str, wall_s: float,
           nbytes: int = 0) -> RequestRecord:
    return RequestRecord(t=t, pid=pid, kind=kind, area=area, requests=1, bytes=nbytes,
                         modeled_s=0.1, wall_s=wall_s)


def test_a_batch_gets_the_requests_of_its_window_and_the_phases_they_time():
    driver, worker_a, worker_b = 10, 20, 30
    records = [
        record(99.0, worker_a, "write", "staging", 5.0),       # the batch before
        record(100.1, worker_a, "write", "staging", 0.2),
        record(100.2, worker_a, "write", "staging", 0.3),
        record(100.2, worker_b, "write", "staging", 0.4),
        record(100.3, worker_b, "write", "shared", 1.0, nbytes=900),
        record(100.5, driver, "write", "metadata", 0.15),
        record(100.6, driver, "read", "staging", 0.1),          # the sink reads its output
        record(100.7, driver, "write", "commits", 0.12),
        record(100.8, driver, "list", "staging", 0.11),
        record(100.9, driver, "delete", "staging", 0.13),
        record(101.0, driver, "write", "metadata", 9.0),       # the next batch
    ]
    phases = growth_requests.request_phases(records, 100.0, 101.0, driver, sink_s=0.25)
    assert phases["staging_s"] == pytest.approx(0.5)          # the slowest worker: a
    assert phases["metadata_commit_s"] == pytest.approx(0.15)
    assert phases["commit_requests_s"] == pytest.approx(0.12 + 0.11 + 0.13)
    assert phases["output_commit_s"] == pytest.approx(0.25 + 0.36)
    assert (phases["driver_requests"], phases["worker_requests"]) == (5, 4)
    assert phases["driver_modeled_s"] == pytest.approx(0.5)
    assert phases["requests"]["by_area"]["shared"]["bytes"] == 900
    assert phases["driver_requests_detail"]["by_kind"]["delete"]["requests"] == 1


def test_latency_is_read_before_anything_runs(tmp_path):
    assert latency_model("none") is None and latency_model(None) is None
    with pytest.raises(LatencyModelError, match="mbps"):
        growth.run(keys=1000, small_keys=100, distinct_keys=10, latency="mbps=90")
    with pytest.raises(ValueError, match="unknown store 'ssd'"):
        growth.run(keys=1000, small_keys=100, distinct_keys=10, store="ssd")
    plain = behind(str(tmp_path), {}, None, str(tmp_path / "log"))
    assert plain.url("ckpt") == f"{tmp_path}/ckpt" and plain.log_dir is None
    shaped = behind(str(tmp_path), {}, latency_model("ms=30,mb_per_s=90"), str(tmp_path / "log"))
    assert shaped.url("ckpt") == f"kslatency://{tmp_path}/ckpt"
    assert shaped.options["log_dir"] == str(tmp_path / "log")
    assert growth_requests.describe_store("local", shaped.model).endswith(
        "behind custom (30 ms per request, 90 MB/s per stream)")
