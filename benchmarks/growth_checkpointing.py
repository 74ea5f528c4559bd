"""``bench growth --compare-checkpointing``: the asynchronous checkpoint phase judged against
checkpoints on local disk, in one run (docs/benchmarks.md, "Checkpoints at an object store's
latency"; docs/checkpoints.md, "The asynchronous phase").

Per backend, the same job over the same generated batches at ``keys`` keys, three times:

- ``local-disk``: checkpoints in a local directory, no latency model, the synchronous mode
  (the upload in the task): the baseline;
- ``latency-sync``: checkpoints on the run's store (``--store``: the local S3 server by
  default) behind the latency model (``--latency``, ``s3-standard-same-region`` by default),
  the synchronous mode;
- ``latency-async``: the same store behind the same model, the asynchronous mode
  (``keyedstate.checkpointing.async-upload: true``, ``max-concurrent-checkpoints`` 1).

**Output latency** (every batch's ``output_latency_s``): from the batch's input file being
published to its output's sink commit having finished (the benchmark's sink stamps the
wall clock when its commit returns). The files are all written before the query starts
(``trigger(availableNow=True)`` reads one per micro-batch), so the benchmark takes a file as
published at the start of the trigger that reads it (Spark's progress ``timestamp``): the
latency of an event that arrives just as its batch starts. An event that arrives earlier waits
for that trigger as well, up to one more batch, in every mode alike. In the synchronous mode
the sink commits at the end of the batch itself; in the asynchronous mode batch N's output is
committed during batch N+1, once N's checkpoint completes (the last batch's at the query's
stop).

**Goals**, per backend (:func:`compute_goals`; ``ratio`` and ``met`` as in
``bench throughput``): ``latency-async``'s median batch at most :data:`GOAL_MEDIAN_RATIO`
times ``local-disk``'s; its p90 at most :data:`GOAL_TAIL_RATIO` times its own median; its
synchronous snapshot phase (the median of the slowest subtask's ``sync_s``) at most
:data:`GOAL_SYNC_FRACTION` of its median batch; its median output latency at most
``latency-sync``'s plus one batch interval (``latency-async``'s median batch): the ratio is
the latency added over that interval, at most 1. :func:`compare` gives the table of every
mode against ``local-disk``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .common import save_figure

#: the goals: the asynchronous mode behind the model at most this times local disk's median ...
GOAL_MEDIAN_RATIO = 1.1
#: ... its p90 at most this times its own median ...
GOAL_TAIL_RATIO = 1.5
#: ... and its synchronous snapshot phase at most this fraction of its median batch
GOAL_SYNC_FRACTION = 0.10
#: the asynchronous commit adds at most this many batch intervals to the output latency
GOAL_ADDED_INTERVALS = 1.0
LOCAL_DISK, LATENCY_SYNC, LATENCY_ASYNC = "local-disk", "latency-sync", "latency-async"


@dataclass(frozen=True)
class Checkpointing:
    """How one run checkpoints: ``name`` (the JSON's ``checkpointing``), ``store`` (``"s3"``
    or ``"local"``), whether behind the run's latency model, whether in the asynchronous
    mode (``async-upload``, ``max-concurrent-checkpoints`` 1)."""

    name: str
    store: str
    behind_model: bool
    async_upload: bool

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "store": self.store, "behind_model": self.behind_model,
                "async_upload": self.async_upload,
                "max_concurrent_checkpoints": 1 if self.async_upload else None}


#: the modes ``--compare-checkpointing`` runs, in this order
MODES = (LOCAL_DISK, LATENCY_SYNC, LATENCY_ASYNC)


def modes(names: Sequence[str], store: str) -> list[Checkpointing]:
    """The modes ``names`` (of :data:`MODES`, each at most once), the latency ones on
    ``store``; ``ValueError`` naming an unknown one."""
    unknown = [n for n in names if n not in MODES]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"checkpointing modes {list(names)}: each of {list(MODES)} at most "
                         f"once")
    made = {LOCAL_DISK: Checkpointing(LOCAL_DISK, "local", False, False),
            LATENCY_SYNC: Checkpointing(LATENCY_SYNC, store, True, False),
            LATENCY_ASYNC: Checkpointing(LATENCY_ASYNC, store, True, True)}
    return [made[n] for n in names]


def output_latencies(per_batch: Sequence[dict[str, Any]]) -> list[float]:
    return [b["output_latency_s"] for b in per_batch if b["phase"] == "measured"]


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def compare(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (backend, mode): median, p90 and p90 / median of the measured batches,
    the median batch against ``local-disk``'s, the synchronous phase (median of ``sync_s``)
    and its fraction of the median batch, the upload (median ``async_s``), the output
    latency's median and p90, and the median CPU seconds a batch by process (``cpu_s``)."""
    local = {r["backend"]: r for r in results if r.get("checkpointing") == LOCAL_DISK}
    rows = []
    for r in results:
        latency = output_latencies(r["per_batch"])
        sync_s = r["phases_median_s"]["sync_s"] or 0.0
        base = local.get(r["backend"])
        rows.append({
            "backend": r["backend"], "checkpointing": r["checkpointing"], "keys": r["keys"],
            "median_s": r["median_s"], "p90_s": r["p90_s"],
            "p90_over_median": r["p90_s"] / r["median_s"],
            "median_over_local_disk": r["median_s"] / base["median_s"] if base else None,
            "sync_s": sync_s, "sync_fraction": sync_s / r["median_s"],
            "upload_s": r["phases_median_s"]["async_s"],
            "output_latency_median_s": _median(latency),
            "output_latency_p90_s": float(np.percentile(latency, 90)),
            "cpu_median_s": r.get("cpu_median_s"),
        })
    return rows


def compute_goals(results: Sequence[dict[str, Any]], model: str
                  ) -> dict[str, dict[str, Any]]:
    """The goals of the module docstring, per backend, for the modes the run has."""
    by = {(r["backend"], r["checkpointing"]): r for r in results}
    goals: dict[str, dict[str, Any]] = {}

    def goal(name: str, ratio: float, target: float) -> None:
        goals[name] = {"ratio": ratio, "target": target, "met": ratio <= target}

    for backend in dict.fromkeys(r["backend"] for r in results):
        local, sync, asyn = (by.get((backend, m)) for m in MODES)
        if asyn is None:
            continue
        at = f"{backend}, {asyn['keys']:,} keys"
        if local is not None:
            goal(f"{at}: median, async behind {model} <= {GOAL_MEDIAN_RATIO:g}x local disk's",
                 asyn["median_s"] / local["median_s"], GOAL_MEDIAN_RATIO)
        goal(f"{at}: p90, async behind {model} <= {GOAL_TAIL_RATIO:g}x its median",
             asyn["p90_s"] / asyn["median_s"], GOAL_TAIL_RATIO)
        goal(f"{at}: synchronous snapshot phase <= {GOAL_SYNC_FRACTION:.0%} of the median "
             f"batch (async)", (asyn["phases_median_s"]["sync_s"] or 0.0) / asyn["median_s"],
             GOAL_SYNC_FRACTION)
        if sync is not None:
            added = (_median(output_latencies(asyn["per_batch"]))
                     - _median(output_latencies(sync["per_batch"])))
            goal(f"{at}: output latency, async adds <= {GOAL_ADDED_INTERVALS:g} batch "
                 f"interval to sync's (median)", added / asyn["median_s"],
                 GOAL_ADDED_INTERVALS)
    return goals


# --------------------------------------------------------------------------------------------
# the figure
# --------------------------------------------------------------------------------------------

COLORS = {LOCAL_DISK: "#7f7f7f", LATENCY_SYNC: "#ff7f0e", LATENCY_ASYNC: "#1f77b4"}


def plot(result: dict[str, Any], path: str) -> str:
    """One column per backend. Above, each measured batch's seconds in each mode, their
    medians (dotted) and the goals' lines (dashed: 1.1x local disk's median, 1.5x the
    asynchronous mode's); below, each batch's output latency, with the asynchronous
    goal's line (the synchronous mode's median plus one batch interval). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    results = result["results"]
    backends = list(dict.fromkeys(r["backend"] for r in results))
    fig, axes = plt.subplots(2, len(backends), figsize=(6.5 * len(backends), 8), dpi=120,
                             sharey="row", squeeze=False)
    for column, backend in enumerate(backends):
        top, bottom = axes[0][column], axes[1][column]
        mine = {r["checkpointing"]: r for r in results if r["backend"] == backend}
        for name, r in mine.items():
            measured = [b for b in r["per_batch"] if b["phase"] == "measured"]
            xs = range(1, len(measured) + 1)
            color = COLORS.get(name, "#2ca02c")
            sync_s = r["phases_median_s"]["sync_s"] or 0.0
            top.plot(xs, [b["trigger_s"] for b in measured], marker="o", markersize=3,
                     color=color, label=f"{name}: median {r['median_s']:.2f} s, p90 "
                                        f"{r['p90_s']:.2f}, sync phase {sync_s:.2f}")
            top.axhline(r["median_s"], color=color, linestyle=":", linewidth=1)
            latency = output_latencies(r["per_batch"])
            bottom.plot(xs, latency, marker="o", markersize=3, color=color,
                        label=f"{name}: median {_median(latency):.2f} s")
        if LOCAL_DISK in mine:
            top.axhline(GOAL_MEDIAN_RATIO * mine[LOCAL_DISK]["median_s"], color="#2ca02c",
                        linestyle="--", linewidth=1,
                        label=f"goal: async median <= {GOAL_MEDIAN_RATIO:g}x local disk's")
        if LATENCY_ASYNC in mine:
            asyn = mine[LATENCY_ASYNC]
            top.axhline(GOAL_TAIL_RATIO * asyn["median_s"], color="#d62728", linestyle="--",
                        linewidth=1, label=f"goal: async p90 <= {GOAL_TAIL_RATIO:g}x its median")
            if LATENCY_SYNC in mine:
                bound = _median(output_latencies(mine[LATENCY_SYNC]["per_batch"])) \
                    + GOAL_ADDED_INTERVALS * asyn["median_s"]
                bottom.axhline(bound, color="#d62728", linestyle="--", linewidth=1,
                               label="goal: async <= sync's median + one batch")
        for ax in (top, bottom):
            ax.set_ylim(bottom=0)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=7, loc="upper left")
        top.set_title(backend, fontsize=10)
        bottom.set_xlabel("measured batch")
    axes[0][0].set_ylabel("seconds per batch (Spark's triggerExecution)")
    axes[1][0].set_ylabel("output latency, s (trigger start to sink commit)")
    for ax in axes[0]:
        ax.set_ylim(0, 1.6 * ax.get_ylim()[1])
    w, m = result["workload"], result["machine"]
    model = w.get("latency") or {}
    fig.suptitle(f"Checkpoints on local disk, behind {model.get('name', 'a latency model')} "
                 f"(sync), and behind it asynchronous: {w['keys']:,} keys, "
                 f"{w['events_per_batch']:,} events over {w['distinct_keys_per_batch']:,} keys "
                 f"per batch, {m['master']}\ncommit {m['commit']}, {m['date']}, load average "
                 f"{m['load_average']} (at the end)", fontsize=9)
    return save_figure(fig, path)
