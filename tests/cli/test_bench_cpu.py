"""The benchmarks' CPU accounting (``benchmarks/cpu.py``): a window's CPU seconds by process,
this process and its descendants only (Linux's ``/proc``)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

from benchmarks.cpu import PARTS, CpuSampler, cpu_medians

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# found by the sampler's scan of /proc, once a second: the child lives longer than that
BURN = ("import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"
        "time.sleep(1.2)\n")


def _burn_here(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_window_counts_this_process_its_children_and_the_store_apart() -> None:
    store = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with CpuSampler(store_pid=store.pid) as cpu:
            time.sleep(0.3)
            start = time.time()
            child = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.6)])
            _burn_here(0.4)
            child.wait()
            end = time.time()
            time.sleep(0.3)
            window = cpu.window(start, end)
            outside = cpu.window(start - 3600, end)
    finally:
        store.kill()
        store.wait()
    assert window is not None and set(window) == {*PARTS, "total"}
    # the child ended inside the window: it counts up to its last sample (0.1 s apart)
    assert 0.4 <= window["other"] <= 0.9, window
    assert 0.3 <= window["driver"] <= 0.8, window
    # Inside the whole suite this process may have a Spark JVM (and its Python workers) from an
    # earlier test: idle, they still tick a little.
    assert window["store"] < 0.1 and window["jvm"] < 0.1 and window["workers"] < 0.1, window
    assert window["total"] == pytest.approx(sum(window[p] for p in PARTS), abs=0.01)
    assert outside is None  # before the first sample: not measured, not zero


def test_the_median_of_each_part_over_the_batches_that_have_one() -> None:
    zero = dict.fromkeys((*PARTS, "total"), 0.0)
    batches: list[dict[str, Any]] = [
        {"cpu_s": {**zero, "jvm": 1.0, "total": 1.0}}, {"cpu_s": None},
        {"cpu_s": {**zero, "jvm": 3.0, "store": 0.2, "total": 3.2}},
        {"cpu_s": {**zero, "jvm": 2.0, "store": 0.1, "total": 2.1}}]
    medians = cpu_medians(batches)
    assert medians is not None
    assert (medians["jvm"], medians["store"], medians["total"]) == (2.0, 0.1, 2.1)
    assert cpu_medians([{"cpu_s": None}]) is None
