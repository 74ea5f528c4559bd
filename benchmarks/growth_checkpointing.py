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

**Repeats** (``repeats`` of :func:`~.growth.run`, ``--repeats``): on 2 shared cores one run
of each mode can't tell 1.0x from 1.2x (two runs of the same code put local disk's heap
median at 1.15 s and 0.90 s, and Spark moves subtasks between workers in a different number
of batches each time), so the modes may run ``repeats`` times per backend, in order in even
repeats and reversed in odd ones (local disk, sync, async, async, sync, local disk: a load
that drifts steadily over a backend's runs weighs on every mode alike). Every figure of the
comparison and every goal then pools the measured batches of a mode's repeats
(:func:`pooled`); each row also gives every repeat's median against local disk's median of
the same repeat (``median_over_local_disk_by_repeat``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .common import save_figure
from .cpu import cpu_medians

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


def pooled(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per (backend, mode), in the order of their first run, over the measured
    batches of all its repeats: ``median_s``, ``p90_s`` (linear interpolation), ``sync_s``
    and ``upload_s`` (medians of the batches' ``sync_s`` and ``async_s``), ``output_latency_s``
    (every batch's), ``cpu_median_s``, and ``medians_s`` (each repeat's own median, in the
    order they ran). With one repeat these are that run's own figures."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        runs.setdefault((r["backend"], r["checkpointing"]), []).append(r)
    summaries = []
    for (backend, mode), repeats in runs.items():
        measured = [b for r in repeats for b in r["per_batch"] if b["phase"] == "measured"]
        seconds = [b["trigger_s"] for b in measured]
        sync = [b["sync_s"] for b in measured if b.get("sync_s") is not None]
        upload = [b["async_s"] for b in measured if b.get("async_s") is not None]
        summaries.append({
            "backend": backend, "checkpointing": mode, "keys": repeats[0]["keys"],
            "repeats": len(repeats), "batches": len(measured),
            "median_s": _median(seconds), "p90_s": float(np.percentile(seconds, 90)),
            "sync_s": _median(sync) if sync else 0.0,
            "upload_s": _median(upload) if upload else None,
            "output_latency_s": output_latencies(measured),
            "cpu_median_s": cpu_medians(measured),
            "medians_s": [r["median_s"] for r in repeats],
        })
    return summaries


def compare(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (backend, mode), over its repeats (:func:`pooled`): median, p90 and p90 /
    median of the measured batches, the median batch against ``local-disk``'s (pooled, and
    per repeat against the same repeat's), the synchronous phase (median of ``sync_s``) and
    its fraction of the median batch, the upload (median ``async_s``), the output latency's
    median and p90, and the median CPU seconds a batch by process (``cpu_s``)."""
    summaries = pooled(results)
    local = {s["backend"]: s for s in summaries if s["checkpointing"] == LOCAL_DISK}
    rows = []
    for s in summaries:
        base = local.get(s["backend"])
        latency = s["output_latency_s"]
        rows.append({
            "backend": s["backend"], "checkpointing": s["checkpointing"], "keys": s["keys"],
            "repeats": s["repeats"], "batches": s["batches"],
            "median_s": s["median_s"], "p90_s": s["p90_s"],
            "p90_over_median": s["p90_s"] / s["median_s"],
            "median_over_local_disk": s["median_s"] / base["median_s"] if base else None,
            "median_over_local_disk_by_repeat": (
                [m / b for m, b in zip(s["medians_s"], base["medians_s"])] if base else None),
            "sync_s": s["sync_s"], "sync_fraction": s["sync_s"] / s["median_s"],
            "upload_s": s["upload_s"],
            "output_latency_median_s": _median(latency),
            "output_latency_p90_s": float(np.percentile(latency, 90)),
            "cpu_median_s": s["cpu_median_s"],
        })
    return rows


def compute_goals(results: Sequence[dict[str, Any]], model: str
                  ) -> dict[str, dict[str, Any]]:
    """The goals of the module docstring, per backend, for the modes the run has, each over
    the pooled repeats of its modes (:func:`pooled`)."""
    by = {(s["backend"], s["checkpointing"]): s for s in pooled(results)}
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
             f"batch (async)", asyn["sync_s"] / asyn["median_s"], GOAL_SYNC_FRACTION)
        if sync is not None:
            added = _median(asyn["output_latency_s"]) - _median(sync["output_latency_s"])
            goal(f"{at}: output latency, async adds <= {GOAL_ADDED_INTERVALS:g} batch "
                 f"interval to sync's (median)", added / asyn["median_s"],
                 GOAL_ADDED_INTERVALS)
    return goals


# --------------------------------------------------------------------------------------------
# the figure
# --------------------------------------------------------------------------------------------

COLORS = {LOCAL_DISK: "#7f7f7f", LATENCY_SYNC: "#ff7f0e", LATENCY_ASYNC: "#1f77b4"}


def plot(result: dict[str, Any], path: str) -> str:
    """One column per backend. Above, each measured batch's seconds in each mode (a mode's
    repeats one after another), their pooled medians (dotted) and the goals' lines (dashed:
    1.1x local disk's median, 1.5x the asynchronous mode's); below, each batch's output
    latency, with the asynchronous goal's line (the synchronous mode's median plus one batch
    interval). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    results = result["results"]
    backends = list(dict.fromkeys(r["backend"] for r in results))
    fig, axes = plt.subplots(2, len(backends), figsize=(6.5 * len(backends), 8), dpi=120,
                             sharey="row", squeeze=False)
    summaries = pooled(results)
    for column, backend in enumerate(backends):
        top, bottom = axes[0][column], axes[1][column]
        mine = {s["checkpointing"]: s for s in summaries if s["backend"] == backend}
        for name, summary in mine.items():
            color = COLORS.get(name, "#2ca02c")
            runs = [r for r in results
                    if r["backend"] == backend and r["checkpointing"] == name]
            first = 1
            for repeat, r in enumerate(runs):
                # the repeats one after another along the axis, the pooled figures labelled once
                measured = [b for b in r["per_batch"] if b["phase"] == "measured"]
                xs = range(first, first + len(measured))
                first += len(measured)
                top.plot(xs, [b["trigger_s"] for b in measured], marker="o", markersize=3,
                         color=color, label=None if repeat else (
                             f"{name}: median {summary['median_s']:.2f} s, p90 "
                             f"{summary['p90_s']:.2f}, sync phase {summary['sync_s']:.2f}"))
                bottom.plot(xs, output_latencies(r["per_batch"]), marker="o", markersize=3,
                            color=color, label=None if repeat else (
                                f"{name}: median "
                                f"{_median(summary['output_latency_s']):.2f} s"))
            top.axhline(summary["median_s"], color=color, linestyle=":", linewidth=1)
        if LOCAL_DISK in mine:
            top.axhline(GOAL_MEDIAN_RATIO * mine[LOCAL_DISK]["median_s"], color="#2ca02c",
                        linestyle="--", linewidth=1,
                        label=f"goal: async median <= {GOAL_MEDIAN_RATIO:g}x local disk's")
        if LATENCY_ASYNC in mine:
            asyn = mine[LATENCY_ASYNC]
            top.axhline(GOAL_TAIL_RATIO * asyn["median_s"], color="#d62728", linestyle="--",
                        linewidth=1, label=f"goal: async p90 <= {GOAL_TAIL_RATIO:g}x its median")
            if LATENCY_SYNC in mine:
                bound = _median(mine[LATENCY_SYNC]["output_latency_s"]) \
                    + GOAL_ADDED_INTERVALS * asyn["median_s"]
                bottom.axhline(bound, color="#d62728", linestyle="--", linewidth=1,
                               label="goal: async <= sync's median + one batch")
        for ax in (top, bottom):
            ax.set_ylim(bottom=0)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=7, loc="upper left")
        top.set_title(backend, fontsize=10)
        bottom.set_xlabel("measured batch (a mode's repeats one after another)"
                          if any(s["repeats"] > 1 for s in summaries) else "measured batch")
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
