"""The scale model's arithmetic: a cost per key and per byte for each phase of a rescale, fitted
on measured subtasks, its error on a held-out size, and a projection onto a large job.

Each phase of one target subtask's rescale (:data:`PHASES`) is modelled as::

    seconds = fixed + per_key * keys + per_byte * bytes

``keys`` the keys the subtask restored, ``bytes`` the state bytes it downloaded. Fitted by
least squares with coefficients >= 0 (a phase cannot get faster with more state: a negative
coefficient is noise fitted as physics), over every target subtask of the training sizes; two
value sizes in the training set keep ``per_key`` and ``per_byte`` apart (with one, bytes per
key is a constant and the two are the same column).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

#: a target subtask's phases, in the order a rescale runs them: restore = download + open +
#: clip + the rest of the restore (meta files, plan, column families); then its first
#: checkpoint's synchronous part and its upload
PHASES = ("download_s", "open_s", "clip_s", "restore_other_s", "checkpoint_s", "upload_s")
#: the goal of the held-out check: the model's total within this of the measured one
GOAL_ERROR = 0.25
#: how the columns are scaled before fitting (seconds per million keys, per MB): well
#: conditioned, reported back per key and per byte
_KEY_UNIT, _BYTE_UNIT = 1e6, 1e6


@dataclass(frozen=True)
class PhaseFit:
    """One phase's cost: ``fixed`` seconds per subtask, ``per_key`` seconds per key,
    ``per_byte`` seconds per byte, and the fit's root-mean-square residual in seconds."""

    fixed: float
    per_key: float
    per_byte: float
    rms_s: float

    def seconds(self, keys: float, nbytes: float) -> float:
        return self.fixed + self.per_key * keys + self.per_byte * nbytes

    def as_dict(self) -> dict[str, float]:
        return {"fixed_s": self.fixed, "per_key_s": self.per_key, "per_byte_s": self.per_byte,
                "per_million_keys_s": self.per_key * _KEY_UNIT,
                "per_mb_s": self.per_byte * _BYTE_UNIT, "rms_s": self.rms_s}


def fit_phase(rows: Sequence[tuple[float, float, float]]) -> PhaseFit:
    """The non-negative least-squares fit of ``seconds = fixed + per_key * keys + per_byte *
    bytes`` over ``rows`` of ``(keys, bytes, seconds)``: every subset of the three terms is
    fitted by ordinary least squares, the subsets with a negative coefficient dropped, and the
    one with the smallest residual kept (exact for three terms)."""
    if not rows:
        raise ValueError("no measured subtask to fit")
    x = np.array([[1.0, k / _KEY_UNIT, b / _BYTE_UNIT] for k, b, _ in rows])
    y = np.array([s for _, _, s in rows])
    best: tuple[float, np.ndarray] | None = None
    for mask in itertools.product((False, True), repeat=3):
        cols = [i for i in range(3) if mask[i]]
        coef = np.zeros(3)
        if cols:
            solved, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (solved < 0).any():
                continue
            coef[cols] = solved
        residual = float(((x @ coef - y) ** 2).sum())
        if best is None or residual < best[0] - 1e-15:
            best = (residual, coef)
    assert best is not None  # the empty subset always qualifies
    residual, coef = best
    return PhaseFit(float(coef[0]), float(coef[1]) / _KEY_UNIT, float(coef[2]) / _BYTE_UNIT,
                    math.sqrt(residual / len(rows)))


def fit(subtasks: Sequence[Mapping[str, Any]]) -> dict[str, PhaseFit]:
    """One :class:`PhaseFit` per phase over ``subtasks`` (each with ``keys``,
    ``downloaded_bytes`` and the phases' seconds)."""
    return {phase: fit_phase([(s["keys"], s["downloaded_bytes"], s[phase]) for s in subtasks])
            for phase in PHASES}


def predict(model: Mapping[str, PhaseFit], keys: float, nbytes: float) -> dict[str, float]:
    """Each phase's seconds for a subtask of ``keys`` keys and ``nbytes`` restored bytes, and
    their sum (``total_s``)."""
    out = {phase: model[phase].seconds(keys, nbytes) for phase in PHASES}
    out["total_s"] = sum(out.values())
    return out


def held_out_error(model: Mapping[str, PhaseFit], subtasks: Sequence[Mapping[str, Any]]
                   ) -> dict[str, Any]:
    """The model against the measured subtasks of a size it was not fitted on: per phase and
    for the total, the predicted and measured seconds summed over the subtasks (the work) and
    of the slowest subtask (what a parallel rescale waits for), and ``predicted / measured -
    1``; ``within_goal`` when both totals' errors are within :data:`GOAL_ERROR`."""
    predicted = [predict(model, s["keys"], s["downloaded_bytes"]) for s in subtasks]
    out: dict[str, Any] = {}
    for phase in (*PHASES, "total_s"):
        measured = [sum(s[p] for p in PHASES) if phase == "total_s" else s[phase]
                    for s in subtasks]
        mine = [p[phase] for p in predicted]
        out[phase] = {"measured_sum_s": sum(measured), "predicted_sum_s": sum(mine),
                      "error": _error(sum(mine), sum(measured))}
    measured_total = [sum(s[p] for p in PHASES) for s in subtasks]
    slowest = max(range(len(subtasks)), key=lambda i: measured_total[i])
    out["slowest_subtask"] = {"measured_s": measured_total[slowest],
                              "predicted_s": predicted[slowest]["total_s"],
                              "error": _error(predicted[slowest]["total_s"],
                                              measured_total[slowest])}
    errors = (out["total_s"]["error"], out["slowest_subtask"]["error"])
    out["within_goal"] = all(e is not None and abs(e) <= GOAL_ERROR for e in errors)
    return out


def _error(predicted: float, measured: float) -> float | None:
    """``predicted / measured - 1``; None for a phase measured at 0 (the heap's clip)."""
    return predicted / measured - 1 if measured > 0 else None


# --------------------------------------------------------------------------------------------
# the projection onto a large job
# --------------------------------------------------------------------------------------------

#: the job of seed 001 (/work/shared/seeds/001_*.txt): a Flink 1.14 job with close to a billion
#: keys in RocksDB, rescaled from 240 to 480 subtasks, "20+ minutes" to restore with ample
#: TaskManagers and HDFS bandwidth
SEED_KEYS, SEED_FROM, SEED_TO = 1_000_000_000, 240, 480
SEED_JOB: dict[str, Any] = {"keys": SEED_KEYS, "from_parallelism": SEED_FROM,
                            "to_parallelism": SEED_TO, "flink_restore_minutes": 20,
                            "source": "seed 001 (RocksDB DeleteRange article)"}
#: Flink's default max parallelism of an operator first run at 240 subtasks:
#: min(max(roundUpToPowerOfTwo(240 + 240 / 2), 128), 32768) = 512, fixed for the state's life
SEED_MAX_PARALLELISM = 512
#: the projection's cluster: executors x cores (Spark task slots), each executor's network
#: (10 Gb/s, a common instance class) shared by its subtasks' transfers
CLUSTERS = ((60, 8), (30, 8), (15, 8))
EXECUTOR_NETWORK_BYTES_PER_S = 10e9 / 8
GOAL_S = 120.0


def largest_subtask_key_groups(max_parallelism: int, parallelism: int) -> int:
    """Key groups of the largest subtask: ``ceil(maxP / p)``."""
    return -(-max_parallelism // parallelism)


def project(model: Mapping[str, PhaseFit], bytes_per_key: float, *,
            keys: int = SEED_KEYS, parallelism: int = SEED_TO,
            max_parallelism: int = SEED_MAX_PARALLELISM,
            clusters: Sequence[tuple[int, int]] = CLUSTERS) -> list[dict[str, Any]]:
    """The rescale of a ``keys``-key job to ``parallelism`` subtasks projected with ``model``:
    the largest subtask holds ``ceil(maxP / p)`` key groups of ``keys / maxP`` keys each
    (keys spread evenly over key groups) and restores ``bytes_per_key`` bytes per key (with
    key-group shards of one key group each, at 512 key groups over 240 subtasks, a target
    downloads only its own key groups). Per cluster of ``(executors, cores)``: the subtasks
    run in ``executors * cores`` task slots, ``ceil(p / slots)`` after each other in a slot;
    an executor's subtasks share its network. The time is the larger of the slots' and the
    network's, and names the term that dominates."""
    key_groups = largest_subtask_key_groups(max_parallelism, parallelism)
    sub_keys = key_groups * keys / max_parallelism
    sub_bytes = sub_keys * bytes_per_key
    phases = predict(model, sub_keys, sub_bytes)
    rows = []
    for executors, cores in clusters:
        slots = executors * cores
        waves = -(-parallelism // slots)
        compute_s = waves * phases["total_s"]
        per_executor = -(-parallelism // executors)
        # download and upload both cross the executor's network; the upload is what the
        # checkpoint sent (modelled by the upload phase's bytes term: its share of bytes)
        network_s = per_executor * sub_bytes / EXECUTOR_NETWORK_BYTES_PER_S
        time_s = max(compute_s, network_s)
        terms = {p: waves * phases[p] for p in PHASES}
        terms["executor_network_s"] = network_s
        # The largest value that still meets the goal on this cluster: the bytes per key at
        # which waves x the subtask's phases reach GOAL_S (the network is checked apart).
        fixed = sum(model[p].fixed + model[p].per_key * sub_keys for p in PHASES)
        per_key_byte = sum(model[p].per_byte for p in PHASES) * sub_keys
        room = GOAL_S / waves - fixed
        rows.append({
            "max_bytes_per_key_under_goal": (None if per_key_byte <= 0 or room <= 0
                                             else room / per_key_byte),
            "executors": executors, "cores_per_executor": cores, "slots": slots,
            "subtasks_per_slot": waves, "subtasks_per_executor": per_executor,
            "largest_subtask_key_groups": key_groups, "largest_subtask_keys": sub_keys,
            "largest_subtask_bytes": sub_bytes, "largest_subtask_phases_s": phases,
            "time_s": time_s, "dominant_term": max(terms, key=lambda k: terms[k]),
            "meets_goal": time_s < GOAL_S,
        })
    return rows
