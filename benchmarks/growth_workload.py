"""``bench growth``'s generated batches and their expected output: the Parquet files of one
run (loading batches, then batches of the measured shape) and the job's only sink, which checks
each batch's output key by key (the module docstring of :mod:`.growth`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from keyedstate.runtime.batch import StagedOutput, read_staged
from keyedstate.spark.sinks import Sink

from .throughput import INPUT_SCHEMA, ROW_GROUP_SIZE

LOAD, WARM_UP, MEASURED = "load", "warm-up", "measured"
KEY_PREFIX = "user-"


@dataclass
class Batch:
    """One generated micro-batch (one Parquet file) and the job's expected output for it."""

    phase: str
    path: str
    events: int
    #: the key indices in the batch, ascending (key ``i`` is ``user-{i:08d}``)
    keys: np.ndarray
    #: each of those keys' count after the batch: the output the job must emit
    counts: np.ndarray


def key_names(n: int) -> pa.Array:
    """``user-00000000`` ... for key indices ``0 .. n-1`` (the names of ``bench throughput``)."""
    digits = pc.utf8_lpad(pc.cast(pa.array(np.arange(n, dtype=np.int64)), pa.string()), 8, "0")
    return pc.binary_join_element_wise(KEY_PREFIX, digits, "")


def write_workload(directory: str, keys: int, load_batch_keys: int, warm_up_batches: int,
                   batches: int, events_per_batch: int, distinct_keys: int, seed: int = 14
                   ) -> list[Batch]:
    """The Parquet files of one run, with increasing modification times (the file source takes
    them in that order): loading batches that hold each of ``keys`` keys exactly once, then
    ``warm_up_batches + batches`` batches of ``events_per_batch`` events over exactly
    ``distinct_keys`` keys each (every drawn key at least once, the rest of the events drawn
    uniformly among them)."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = key_names(keys)
    counts = np.zeros(keys, dtype=np.int64)
    out: list[Batch] = []

    def write(idx: np.ndarray, phase: str) -> None:
        n = len(out)
        table = pa.table({
            "user_id": names.take(pa.array(idx)),
            "ts": pa.array(1_800_000_000_000_000 + n * 10**9 + np.arange(len(idx)),
                           pa.timestamp("us", tz="UTC")),
            "amount": rng.uniform(0, 100, len(idx)).round(2),
        }, schema=INPUT_SCHEMA)
        path = os.path.join(directory, f"events-{n:05d}.parquet")
        pq.write_table(table, path, row_group_size=ROW_GROUP_SIZE)
        os.utime(path, (1_800_000_000 + n, 1_800_000_000 + n))
        touched, in_batch = np.unique(idx, return_counts=True)
        counts[touched] += in_batch
        out.append(Batch(phase, path, len(idx), touched, counts[touched].copy()))

    for start in range(0, keys, load_batch_keys):
        write(rng.permutation(np.arange(start, min(keys, start + load_batch_keys))), LOAD)
    for n in range(warm_up_batches + batches):
        drawn = rng.choice(keys, distinct_keys, replace=False)
        idx = np.concatenate([drawn, rng.choice(drawn, events_per_batch - distinct_keys)])
        write(rng.permutation(idx), WARM_UP if n < warm_up_batches else MEASURED)
    return out


def check_output(batch_id: int, table: pa.Table, want: Batch) -> str | None:
    """None if ``table`` (``user_id``, ``count``) holds exactly one row per key of ``want``
    with the key's expected count, else what differs."""
    idx = pc.cast(pc.utf8_slice_codeunits(table.column("user_id"), len(KEY_PREFIX)),
                  pa.int64()).to_numpy()
    got = table.column("count").to_numpy()
    order = np.argsort(idx, kind="stable")
    idx, got = idx[order], got[order]
    if not np.array_equal(idx, want.keys):
        return (f"batch {batch_id}: {len(idx)} output rows for {len(np.unique(idx))} keys, "
                f"expected one row for each of its {len(want.keys)} keys")
    wrong = np.flatnonzero(got != want.counts)
    if wrong.size:
        i = wrong[0]
        return (f"batch {batch_id}: {wrong.size} keys with wrong counts, e.g. "
                f"{KEY_PREFIX}{idx[i]:08d}: {got[i]}, expected {want.counts[i]}")
    return None


class VerifiedCounts(Sink):
    """The job's only sink: each batch's output (read from its staged files in the driver, as a
    ``CallbackSink`` does, without a Spark job) against the generated data's, key by key
    (:func:`check_output`). The verdicts are kept (:attr:`verified`, :attr:`errors`) and
    judged after the run (:meth:`check`), so that the run ends with every wrong batch named.
    A replayed commit checks again; a batch that was ever wrong stays wrong. Each commit's
    seconds (:attr:`seconds`) and the wall-clock time it finished (:attr:`committed_at`,
    seconds since the epoch: when the batch's output reached the sink) are kept too."""

    def __init__(self, expected: Sequence[Batch]) -> None:
        self.expected = expected
        self.verified: dict[int, bool] = {}
        self.errors: dict[int, str] = {}
        self.seconds: dict[int, float] = {}
        self.committed_at: dict[int, float] = {}

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        started = time.perf_counter()
        error = (check_output(batch_id, read_staged(staged), self.expected[batch_id])
                 if 0 <= batch_id < len(self.expected) else
                 f"batch {batch_id} was not generated (only {len(self.expected)} were)")
        self.verified[batch_id] = self.verified.get(batch_id, True) and error is None
        if error is not None:
            self.errors[batch_id] = error
        self.seconds[batch_id] = time.perf_counter() - started
        self.committed_at[batch_id] = time.time()

    def check(self, run: str) -> None:
        """Raise ``AssertionError`` unless every generated batch was committed and right."""
        missing = [b for b in range(len(self.expected)) if b not in self.verified]
        if missing or self.errors:
            raise AssertionError(f"{run}: batches never committed: {missing}; wrong output: "
                                 f"{list(self.errors.values())[:5]}")
