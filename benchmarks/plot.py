"""Plots for docs/benchmarks.md, drawn from the saved JSON results (never from a new run).

    .venv/bin/python -m keyedstate_benchmarks.plot [--results docs/bench-results] [--out docs/img]

Reads ``checkpoint.json``, ``checkpoint-long.json``, ``backend-rescale.json``, ``access.json``,
``growth-checkpointing.json``, ``throughput-sweep.json`` and ``scale-model.json`` (whichever
exist) and writes one PNG per benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from .common import save_figure  # noqa: E402
from .growth_checkpointing import plot as plot_growth_checkpointing  # noqa: E402

MiB = 2**20
INCREMENTAL, FULL, GOAL = "#1f77b4", "#b0b0b0", "#d62728"
BACKEND_COLORS = {"heap": "#9467bd", "rocksdb": "#1f77b4", "rocksdb-level": "#ff7f0e"}


def _load(results_dir: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(results_dir, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    data["_path"] = path
    return data


def _subtitle(data: dict[str, Any]) -> str:
    m = data["machine"]
    return f"{m['date']}, {m['cpus']} CPUs, {m['memory_gib']} GiB, Python {m['python']}"


def _label_bars(ax: Axes, bars: Any, fmt: str) -> None:
    for bar in bars:
        ax.annotate(fmt.format(bar.get_height()), (bar.get_x() + bar.get_width() / 2,
                                                   bar.get_height()),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                    textcoords="offset points")


def plot_checkpoint(data: dict[str, Any], out: str) -> str:
    results = data["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.4))
    # Left: mean bytes written per checkpoint, incremental vs full.
    labels = [f"{r['backend']}\n{r['changed_fraction']:.0%}" for r in results]
    xs = range(len(results))
    width = 0.38
    full = left.bar([x - width / 2 for x in xs], [r["mean_full_bytes"] / MiB for r in results],
                    width, label="full", color=FULL)
    inc = left.bar([x + width / 2 for x in xs],
                   [r["mean_incremental_bytes"] / MiB for r in results], width,
                   label="incremental", color=INCREMENTAL)
    _label_bars(left, full, "{:.1f}")
    _label_bars(left, inc, "{:.1f}")
    left.set_xticks(list(xs), labels, fontsize=8)
    left.set_xlabel("backend, keys changed per checkpoint")
    left.set_ylabel("MiB written per checkpoint (mean of the sequence)")
    keys = results[0]["keys"]
    rounds = max(r["rounds"] for r in results)
    left.set_title(f"Bytes per checkpoint, {keys:,} keys, up to {rounds} checkpoints")
    left.legend()
    # Right: incremental / full bytes, checkpoint by checkpoint.
    for r in results:
        ratios = [100 * x for x in r["per_round_incremental_over_full_bytes"]]
        one_percent = r["changed_fraction"] <= 0.01
        right.plot(range(1, len(ratios) + 1), ratios, "-" if one_percent else "--",
                   marker="o" if one_percent else "s", color=BACKEND_COLORS[r["backend"]],
                   label=f"{r['backend']}, {r['changed_fraction']:.0%} changed")
    right.axhline(5, color=GOAL, linestyle=":", label="goal at 1% changed: 5%")
    right.set_yscale("log")
    right.set_ylim(0.5, 200)
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%"))
    right.set_xlabel("checkpoint after the full base")
    right.set_ylabel("incremental bytes / full bytes")
    right.set_title("Each incremental checkpoint against a full one")
    right.set_xticks(range(1, rounds + 1, 1 if rounds <= 10 else 5))
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.suptitle(f"Checkpoint: incremental vs full ({_subtitle(data)})", fontsize=10)
    return save_figure(fig, os.path.join(out, "checkpoint.png"), dpi=110)


def plot_rescale(data: dict[str, Any], out: str) -> str:
    results = data["results"]
    series = [
        ("rocksdb_clip_ingest", "RocksDB clip + ingest", INCREMENTAL),
        ("rocksdb_key_by_key_copy", "RocksDB key-by-key copy", "#ff7f0e"),
        ("rocksdb_same_parallelism", "RocksDB, no rescale (p -> p)", "#2ca02c"),
        ("heap_rescaled", "heap, rescaled", "#9467bd"),
        ("heap_same_parallelism", "heap, no rescale (p -> p)", "#c5b0d5"),
    ]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.16
    for i, (key, label, color) in enumerate(series):
        xs = [g + (i - 2) * width for g in range(len(results))]
        bars = ax.bar(xs, [r[key]["total_s"] for r in results], width, label=label, color=color)
        _label_bars(ax, bars, "{:.2f}")
    ax.set_xticks(range(len(results)),
                  [f"{r['from']} -> {r['to']} subtasks\ncopy / ingest = "
                   f"{r['copy_over_ingest']:.1f}x (goal: at least 3x)" for r in results])
    ax.set_ylabel("restore time, s (sum over target subtasks, median)")
    keys = results[0]["keys"]
    ax.set_title(f"Restore with rescaling, {keys:,} keys ({_subtitle(data)})", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, os.path.join(out, "backend-rescale.png"), dpi=110)


def plot_access(data: dict[str, Any], out: str) -> str:
    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    labels = ["raw rocksdict", "keyedstate\nRocksDB", "keyedstate\nheap"]
    values = [data["raw_rocksdict_us_per_op"], data["keyedstate_rocksdb_us_per_op"],
              data["keyedstate_heap_us_per_op"]]
    colors = [FULL, INCREMENTAL, BACKEND_COLORS["heap"]]
    bulk = data.get("us_per_key_and_pass")  # runs since the bulk calls were measured
    if bulk:
        labels += ["raw\nmulti-get", "raw\ngets", "RocksDB\nbulk", "heap\nbulk"]
        values += [bulk["raw_rocksdict_multi_get"], bulk["raw_rocksdict_gets"],
                   bulk["keyedstate_rocksdb_bulk"], bulk["keyedstate_heap_bulk"]]
        colors += [FULL, FULL, INCREMENTAL, BACKEND_COLORS["heap"]]
    bars = ax.bar(labels, values, color=colors)
    for bar in bars[3:]:
        bar.set_hatch("//")
    raw = data["raw_rocksdict_us_per_op"]
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.2f} µs ({value / raw:.2f}x raw)",
                    (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.axhline(2 * raw, color=GOAL, linestyle=":", label="goal: 2x raw rocksdict")
    ax.set_ylim(0, 1.2 * max(*values, 2 * raw))
    ax.set_ylabel("µs per key: get + update (median)\nhatched: bulk calls, one pass")
    ax.set_title(f"State access, {data['keys']:,} keys x {data['rounds']} rounds\n"
                 f"({_subtitle(data)})", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, os.path.join(out, "access.png"), dpi=110)


def plot_checkpoint_long(data: dict[str, Any], out: str) -> str:
    """``checkpoint-long.json`` (and ``checkpoint-long-level.json`` beside it, if saved): each
    checkpoint's bytes against the state's full size, over the long sequence, and the running
    mean (what the goal judges)."""
    runs = [data]
    level = os.path.join(os.path.dirname(data["_path"]), "checkpoint-long-level.json")
    if os.path.exists(level):
        with open(level) as f:
            runs.append(json.load(f))
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for run in runs:
        ratios = [100 * x for x in run["per_round_incremental_over_full_size"]]
        color = BACKEND_COLORS[run["backend"]]
        ax.plot(range(1, len(ratios) + 1), ratios, ".", color=color, alpha=0.55, markersize=4,
                label=f"{run['backend']}: each checkpoint")
        mean = [sum(ratios[:i + 1]) / (i + 1) for i in range(len(ratios))]
        ax.plot(range(1, len(mean) + 1), mean, "-", color=color, linewidth=2,
                label=f"{run['backend']}: mean so far ({mean[-1]:.1f}% after {len(mean)})")
    ax.axhline(5, color=GOAL, linestyle=":", label="goal: 5%")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%"))
    ax.set_xlabel("checkpoint after the full base")
    ax.set_ylabel("bytes written / full size of the state")
    ax.set_title(f"RocksDB incremental checkpoints, {data['keys']:,} keys, "
                 f"{data['changed_fraction']:.0%} changed per checkpoint ({_subtitle(data)})",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    return save_figure(fig, os.path.join(out, "checkpoint-long.png"), dpi=110)


def plot_checkpointing(data: dict[str, Any], out: str) -> str:
    """``growth-checkpointing.json``: ``bench growth --compare-checkpointing``'s figure."""
    return plot_growth_checkpointing(data, os.path.join(out, "growth-checkpointing.png"))


SWEEP_STYLES = {"spark-builtin-agg": ("#7f7f7f", "-", "o"),
                "spark-arrow-handoff": ("#bcbd22", "--", "v"),
                "spark-two-phase-handoff": ("#8c6d31", "--", "^"),
                "keyedstate-rocksdb-two-phase": (BACKEND_COLORS["rocksdb"], "-", "s"),
                "keyedstate-heap-two-phase": (BACKEND_COLORS["heap"], "-", "D")}


def plot_throughput_sweep(data: dict[str, Any], out: str) -> str:
    """``keyedstate bench throughput --sweep``: events/s (median batch after the first)
    against events per batch at a fixed key count, and against distinct keys at a fixed
    event count; floors dashed."""
    from .throughput_sweep import series

    systems = data["workload"]["systems"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, by, label in ((axes[0], "events", "events per batch"),
                          (axes[1], "keys", "distinct keys (state size)")):
        for system in systems:
            line = series(data, system, by=by)
            if not line:
                continue
            color, style, marker = SWEEP_STYLES.get(system, ("#d62728", "-", "x"))
            ax.plot([x for x, _ in line], [y for _, y in line], style, color=color,
                    marker=marker, label=system)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"{label} (log)")
        ax.grid(True, which="both", alpha=0.3)
    points = data["points"]
    keys = statistics.mode(p["keys"] for p in points)
    events = statistics.mode(p["events_per_batch"] for p in points)
    axes[0].set_title(f"more rows: {keys:,} keys", fontsize=10)
    axes[1].set_title(f"more keys: {events:,} events per batch", fontsize=10)
    axes[0].set_ylabel("events per second, median batch after the first (log)")
    axes[0].legend(fontsize=8)
    m = data["machine"]
    fig.suptitle(f"Keyed count as the batch grows, {m['master']}, commit {m['commit']} "
                 f"({_subtitle(data)}, load {m['load_average'][0]})", fontsize=10)
    return save_figure(fig, os.path.join(out, "throughput-sweep.png"), dpi=110)


PHASE_COLORS = {"download_s": "#1f77b4", "open_s": "#ff7f0e", "clip_s": "#d62728",
                "restore_other_s": "#b0b0b0", "checkpoint_s": "#2ca02c", "upload_s": "#9467bd"}


def plot_scale_model(data: dict[str, Any], out: str) -> str:
    """``keyedstate bench scale-model``: per backend, the rescale's seconds summed over the
    target subtasks against the state's keys, measured (markers; the held-out size hollow) and
    the fitted model's (lines), and the phases of each measured size (stacked bars)."""
    from .scale_fit import PHASES, PhaseFit, predict_measured

    backends = list(data["results"])
    fig, axes = plt.subplots(2, len(backends), figsize=(6.2 * len(backends), 8.4),
                             squeeze=False)
    held_out = data["workload"]["held_out_keys"]
    for col, backend in enumerate(backends):
        result = data["results"][backend]
        model = {p: PhaseFit.from_dict(f) for p, f in result["fit"].items()}
        top, bottom = axes[0][col], axes[1][col]
        values = list(dict.fromkeys(s["value"] for s in result["sizes"]))
        for value, marker in zip(values, "os^"):
            sizes = [s for s in result["sizes"] if s["value"] == value]
            keys = [s["keys"] for s in sizes]
            measured = [sum(s["sum_s"].values()) for s in sizes]
            fitted = [sum(predict_measured(model, t)["total_s"] for t in s["subtasks"])
                      for s in sizes]
            line = top.plot(keys, fitted, "-", label=f"{value}: model")[0]
            for k, m in zip(keys, measured):
                top.plot([k], [m], marker, color=line.get_color(),
                         markerfacecolor="none" if k == held_out else line.get_color())
            top.plot([], [], marker, color=line.get_color(), label=f"{value}: measured "
                     f"(hollow: held out, {result['held_out'][value]['total_s']['error']:+.0%})")
        top.set_xscale("log")
        top.set_xlabel("keys in the state")
        top.set_ylabel("seconds, summed over the target subtasks")
        top.set_title(f"{backend}: rescale {data['workload']['rescale']}", fontsize=10)
        top.legend(fontsize=7)
        labels = [f"{size['keys'] / 1000:,.4g}K\n{size['value']}" for size in result["sizes"]]
        xs = list(range(len(labels)))
        bottoms = [0.0] * len(labels)
        for phase in PHASES:
            heights = [size["sum_s"][phase] for size in result["sizes"]]
            bottom.bar(xs, heights, bottom=bottoms, color=PHASE_COLORS[phase],
                       label=phase.removesuffix("_s"))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        bottom.set_xticks(xs, labels, fontsize=7)
        bottom.set_ylabel("seconds, summed over the target subtasks")
        bottom.legend(fontsize=7)
    lat = data.get("latency") or {}
    fig.suptitle(f"Scale model of a rescale, {lat.get('name', 'no latency model')} "
                 f"(commit {data['machine']['commit']}, {_subtitle(data)}, load "
                 f"{data['machine']['load_average'][0]})", fontsize=10)
    return save_figure(fig, os.path.join(out, "scale-model.png"), dpi=110)


PLOTS = {"checkpoint": plot_checkpoint, "checkpoint-long": plot_checkpoint_long,
         "backend-rescale": plot_rescale, "access": plot_access,
         "growth-checkpointing": plot_checkpointing,
         "throughput-sweep": plot_throughput_sweep, "scale-model": plot_scale_model}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="docs/bench-results",
                        help="folder of the saved JSON results")
    parser.add_argument("--out", default="docs/img", help="folder for the PNG files")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, plot in PLOTS.items():
        data = _load(args.results, name)
        if data is None:
            print(f"{name}: no {name}.json in {args.results}, skipped")
            continue
        print(f"{name}: {plot(data, args.out)}")


if __name__ == "__main__":
    main()
