"""The scale model's arithmetic: a cost per key and per byte for each phase of a rescale, fitted
on measured subtasks, its error on a held-out size, and a projection onto a large job.

Each phase of one target subtask's rescale (:data:`PHASES`) is modelled as::

    seconds = fixed + per_key * keys + per_byte * bytes + per_round_trip * round_trips

``keys`` the keys the subtask restored, ``bytes`` the state bytes it downloaded (for the
download itself, the bytes per parallel stream: its requests run on ``min(requests,
threads)`` streams of the store's per-stream bandwidth at once, so a target whose files are
merged into one object reads them on one stream, and one whose large files are separate
objects on up to 4), ``round_trips`` the store's request latencies the phase waits for one
after another: its requests over the transfer threads, rounded up (:data:`ROUND_TRIPS_OF`:
the download's and the upload's; the other phases make no request). Fitted by least squares with coefficients >= 0
(a phase cannot get faster with more state: a negative coefficient is noise fitted as physics),
over every target subtask of the training sizes; two value sizes in the training set keep
``per_key`` and ``per_byte`` apart (with one, bytes per key is a constant and the two are the
same column). Without the round trips a target that fetches one more batch of files than the
others (the first target of a 3 -> 6 rescale reads 10 files where the others read 8: a third
round trip of 100 ms on 4 threads) is mispredicted by the average.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from keyedstate.backends.rocksdb.options import RocksDBOptions
from keyedstate.storage.checkpoint_storage import COALESCE_RANGE_BYTES
from keyedstate.storage.transfer import TransferOptions

#: a target subtask's phases, in the order a rescale runs them: restore = download + open +
#: clip + the rest of the restore (meta files, plan, column families); then its first
#: checkpoint's synchronous part and its upload
PHASES = ("download_s", "open_s", "clip_s", "restore_other_s", "checkpoint_s", "upload_s")
#: the phases that wait for the store, and the subtask's field counting their round trips
ROUND_TRIPS_OF = {"download_s": "restore_round_trips", "upload_s": "upload_round_trips"}
#: the goal of the held-out check: the model's total within this of the measured one
GOAL_ERROR = 0.25
#: how the columns are scaled before fitting (seconds per million keys, per MB): well
#: conditioned, reported back per key and per byte
_KEY_UNIT, _BYTE_UNIT = 1e6, 1e6


@dataclass(frozen=True)
class PhaseFit:
    """One phase's cost: ``fixed`` seconds per subtask, ``per_key`` seconds per key,
    ``per_byte`` seconds per byte, ``per_round_trip`` seconds per round trip to the store,
    and the fit's root-mean-square residual in seconds."""

    fixed: float
    per_key: float
    per_byte: float
    rms_s: float
    per_round_trip: float = 0.0

    def seconds(self, keys: float, nbytes: float, round_trips: float = 0.0) -> float:
        return (self.fixed + self.per_key * keys + self.per_byte * nbytes
                + self.per_round_trip * round_trips)

    def as_dict(self) -> dict[str, float]:
        return {"fixed_s": self.fixed, "per_key_s": self.per_key, "per_byte_s": self.per_byte,
                "per_round_trip_s": self.per_round_trip,
                "per_million_keys_s": self.per_key * _KEY_UNIT,
                "per_mb_s": self.per_byte * _BYTE_UNIT, "rms_s": self.rms_s}

    @classmethod
    def from_dict(cls, fields: Mapping[str, float]) -> PhaseFit:
        """The fit :meth:`as_dict` wrote (a JSON of before the round trips has none: 0)."""
        return cls(fields["fixed_s"], fields["per_key_s"], fields["per_byte_s"],
                   fields["rms_s"], fields.get("per_round_trip_s", 0.0))


def fit_phase(rows: Sequence[tuple[float, float, float, float]]) -> PhaseFit:
    """The non-negative least-squares fit of ``seconds = fixed + per_key * keys + per_byte *
    bytes + per_round_trip * round_trips`` over ``rows`` of ``(keys, bytes, round_trips,
    seconds)``: every subset of the four terms is fitted by ordinary least squares, the subsets
    with a negative coefficient dropped, and the one with the smallest residual kept (exact
    for four terms)."""
    if not rows:
        raise ValueError("no measured subtask to fit")
    x = np.array([[1.0, k / _KEY_UNIT, b / _BYTE_UNIT, r] for k, b, r, _ in rows])
    y = np.array([s for *_, s in rows])
    best: tuple[float, np.ndarray] | None = None
    for mask in itertools.product((False, True), repeat=4):
        cols = [i for i in range(4) if mask[i]]
        coef = np.zeros(4)
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
                    math.sqrt(residual / len(rows)), float(coef[3]))


def round_trips(subtask: Mapping[str, Any], phase: str) -> float:
    """The round trips ``phase`` of a measured ``subtask`` waited for (0 for a phase that makes
    no request, :data:`ROUND_TRIPS_OF`)."""
    field = ROUND_TRIPS_OF.get(phase)
    return float(subtask.get(field, 0)) if field is not None else 0.0


def phase_bytes(phase: str, nbytes: float, streams: float) -> float:
    """The bytes term of ``phase`` for a subtask that restored ``nbytes`` bytes on ``streams``
    parallel streams: the download's bytes per stream, every other phase's all of them."""
    return nbytes / max(1.0, streams) if phase == "download_s" else nbytes


def fit(subtasks: Sequence[Mapping[str, Any]]) -> dict[str, PhaseFit]:
    """One :class:`PhaseFit` per phase over ``subtasks`` (each with ``keys``,
    ``downloaded_bytes``, ``restore_streams``, the round trips of :data:`ROUND_TRIPS_OF` and
    the phases' seconds; a subtask measured before the streams were recorded counts one)."""
    return {phase: fit_phase([(s["keys"],
                               phase_bytes(phase, s["downloaded_bytes"], _streams(s)),
                               round_trips(s, phase), s[phase]) for s in subtasks])
            for phase in PHASES}


def predict(model: Mapping[str, PhaseFit], keys: float, nbytes: float,
            trips: Mapping[str, float] | None = None, streams: float = 1.0
            ) -> dict[str, float]:
    """Each phase's seconds for a subtask of ``keys`` keys and ``nbytes`` restored bytes,
    downloaded on ``streams`` parallel streams, with ``trips`` round trips per phase (missing:
    0), and their sum (``total_s``)."""
    trips = trips or {}
    out = {phase: model[phase].seconds(keys, phase_bytes(phase, nbytes, streams),
                                       trips.get(phase, 0.0))
           for phase in PHASES}
    out["total_s"] = sum(out.values())
    return out


def predict_measured(model: Mapping[str, PhaseFit], subtask: Mapping[str, Any]
                     ) -> dict[str, float]:
    """:func:`predict` for a measured subtask: its keys, bytes, round trips and streams."""
    return predict(model, subtask["keys"], subtask["downloaded_bytes"],
                   {phase: round_trips(subtask, phase) for phase in ROUND_TRIPS_OF},
                   _streams(subtask))


def _streams(subtask: Mapping[str, Any]) -> float:
    return float(subtask.get("restore_streams", 1))


def held_out_error(model: Mapping[str, PhaseFit], subtasks: Sequence[Mapping[str, Any]]
                   ) -> dict[str, Any]:
    """The model against the measured subtasks of a size it was not fitted on: per phase and
    for the total, the predicted and measured seconds summed over the subtasks (the work) and
    of the slowest subtask (what a parallel rescale waits for), and ``predicted / measured -
    1``; ``within_goal`` when both totals' errors are within :data:`GOAL_ERROR`."""
    predicted = [predict_measured(model, s) for s in subtasks]
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
#: the library's defaults the projection's requests follow: RocksDB's SST file size after a
#: full compaction, and the transfer threads of a restore
_SST_BYTES = RocksDBOptions().target_file_size_base
_THREADS = TransferOptions().threads


def largest_subtask_key_groups(max_parallelism: int, parallelism: int) -> int:
    """Key groups of the largest subtask: ``ceil(maxP / p)``."""
    return -(-max_parallelism // parallelism)


def seed_download_requests(backend: str, key_groups: int, bytes_per_key_group: float,
                           handles: int = 2) -> int:
    """The GETs a target subtask of ``key_groups`` key groups of ``bytes_per_key_group`` bytes
    each makes to restore from ``handles`` old subtasks (a target of 2 key groups at 512 over
    240 -> 480 overlaps at most 2 old subtasks), by the store's own rules
    (docs/object-storage.md): files below the merge size share one object per snapshot and
    subtask, read in ranged GETs of at most ``COALESCE_RANGE_BYTES``; larger files one GET
    each. RocksDB: per old subtask one merged object (its meta file, CURRENT, MANIFEST,
    OPTIONS), and per key group one key-group shard (with 512 key groups over 240 subtasks a
    shard holds one key group) whose full compaction left ``ceil(bytes /
    target_file_size_base)`` SST files, merged when under the merge size. Heap: one full
    snapshot file per old subtask (a chain compacted to its base)."""
    if backend == "heap":
        return handles
    if bytes_per_key_group < TransferOptions.DEFAULT_MERGE_FILE_SIZE:
        # the SST files are merged too: each old subtask's share in ranged GETs
        per_handle = key_groups * bytes_per_key_group / handles
        return handles * max(1, math.ceil(per_handle / COALESCE_RANGE_BYTES))
    ssts = math.ceil(bytes_per_key_group / _SST_BYTES)
    return handles + key_groups * ssts


def project(model: Mapping[str, PhaseFit], bytes_per_key: float, *, backend: str,
            upload_round_trips: float, threads: int = _THREADS,
            keys: int = SEED_KEYS, parallelism: int = SEED_TO,
            max_parallelism: int = SEED_MAX_PARALLELISM,
            clusters: Sequence[tuple[int, int]] = CLUSTERS) -> list[dict[str, Any]]:
    """The rescale of a ``keys``-key job to ``parallelism`` subtasks projected with ``model``:
    the largest subtask holds ``ceil(maxP / p)`` key groups of ``keys / maxP`` keys each
    (keys spread evenly over key groups) and restores ``bytes_per_key`` bytes per key (with
    key-group shards of one key group each, at 512 key groups over 240 subtasks, a target
    downloads only its own key groups); its download waits for
    ``ceil(seed_download_requests / threads)`` round trips, its upload for
    ``upload_round_trips`` (the most a measured target made). Per cluster of ``(executors,
    cores)``: the subtasks run in ``executors * cores`` task slots, ``ceil(p / slots)`` after
    each other in a slot; an executor's subtasks share its network. The time is the larger of
    the slots' and the network's, and names the term that dominates."""
    key_groups = largest_subtask_key_groups(max_parallelism, parallelism)
    sub_keys = key_groups * keys / max_parallelism
    sub_bytes = sub_keys * bytes_per_key
    requests = seed_download_requests(backend, key_groups, sub_bytes / key_groups)
    trips = {"download_s": float(math.ceil(requests / threads)),
             "upload_s": float(upload_round_trips)}
    streams = float(min(requests, threads))
    phases = predict(model, sub_keys, sub_bytes, trips, streams)
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
        # which waves x the subtask's phases reach GOAL_S (the network is checked apart; the
        # round trips are held at this value's, which more bytes per key only add to).
        fixed = sum(model[p].fixed + model[p].per_key * sub_keys
                    + model[p].per_round_trip * trips.get(p, 0.0) for p in PHASES)
        per_key_byte = sum(model[p].per_byte * phase_bytes(p, sub_keys, streams)
                           for p in PHASES)
        room = GOAL_S / waves - fixed
        rows.append({
            "max_bytes_per_key_under_goal": (None if per_key_byte <= 0 or room <= 0
                                             else room / per_key_byte),
            "executors": executors, "cores_per_executor": cores, "slots": slots,
            "subtasks_per_slot": waves, "subtasks_per_executor": per_executor,
            "largest_subtask_key_groups": key_groups, "largest_subtask_keys": sub_keys,
            "largest_subtask_bytes": sub_bytes, "largest_subtask_requests": requests,
            "largest_subtask_streams": streams,
            "largest_subtask_round_trips": trips, "largest_subtask_phases_s": phases,
            "time_s": time_s, "dominant_term": max(terms, key=lambda k: terms[k]),
            "meets_goal": time_s < GOAL_S,
        })
    return rows
