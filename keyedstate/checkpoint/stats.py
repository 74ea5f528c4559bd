"""Checkpoint statistics kept in ``_metadata`` (Flink's ``CompletedCheckpointStats``,
``SubtaskStateStats`` and ``CheckpointStatsHistory``): what each checkpoint took and moved,
so that ``keyedstate checkpoints report`` draws a job's history from stored checkpoints alone,
without the job running.

Both runtimes record them when a batch's checkpoint completes
(:func:`~keyedstate.runtime.batch.complete_batch`), as two properties:

- :data:`~keyedstate.checkpoint.properties.SUBTASK_STATS`: one :class:`SubtaskStateStats` per
  subtask of this checkpoint (sync and async snapshot durations, restore time, whether the
  subtask reused its live state or restored it, rows in and out), in subtask order. Sizes and
  transfer counts per subtask are on the handles already.
- :data:`~keyedstate.checkpoint.properties.CHECKPOINT_HISTORY`: one
  :class:`CompletedCheckpointStats` row for each of the job's last :data:`HISTORY_SIZE`
  checkpoints, oldest first, this one last: the previous checkpoint's history plus this
  checkpoint's row. A job retains only its last few checkpoints; the history of its latest
  one reaches further back.

**Bounded.** A history row is about 100 bytes of JSON (at most ~220, with every figure in
the terabytes), so the history adds 10 KB to a ``_metadata``, never more than 25 KB; the
subtask statistics ~40 bytes per subtask (the handles take more). Rows carry per-subtask
state size as minimum and maximum only (Flink's summary), never a list.

**Compatible both ways.** Both are JSON arrays of arrays (``array_like`` structs: no field
names repeated per row). Fields are only ever appended, never reordered or removed, and all
but the checkpoint id are optional: a reader fills fields an older writer did not know with
None (shown blank) and ignores trailing fields a newer writer added. ``_metadata`` without
these properties (written before them, by a claim, by :class:`LocalKeyedOperator`, or a
savepoint) reads as before; :func:`stats_of` derives what its handles record. No format
version change: properties are optional by nature. An undecodable value is treated as absent
(a warning): statistics never fail a checkpoint or a report.

Both properties describe the checkpoint and job that recorded them, as transfer counts do,
so no savepoint or other snapshot root carries them
(:func:`~keyedstate.checkpoint.properties.portable_properties`): a job started from a
savepoint starts its own history.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping, Sequence

import msgspec

from keyedstate.checkpoint.properties import (
    BATCH_ID,
    CHECKPOINT_HISTORY,
    MIN_WATERMARK,
    SUBTASK_STATS,
)
from keyedstate.storage.handles import CheckpointMetadata, KeyedStateHandle
from keyedstate.storage.transfer import RESTORE_PREFIX, TransferStats

log = logging.getLogger("keyedstate")

#: Checkpoints a history keeps (each ``_metadata`` carries the rows of the job's last ones).
HISTORY_SIZE = 100


class SubtaskStateStats(msgspec.Struct, frozen=True, array_like=True):
    """What one subtask's part of one checkpoint took (Flink's ``SubtaskStateStats``).
    Durations in milliseconds. Append new fields at the end, optional (module docstring)."""

    #: the synchronous part of the snapshot (the batch waits for it)
    sync_ms: float | None = None
    #: the asynchronous part (Flink's name): writing the files to checkpoint storage, in the
    #: subtask's task (on the batch's path) by default, in the worker's uploader with
    #: ``keyedstate.checkpointing.async-upload`` (docs/checkpoints.md)
    async_ms: float | None = None
    #: getting the state before the batch: restoring it, or opening empty state (0 when the
    #: live state was reused)
    restore_ms: float | None = None
    #: whether the subtask reused its live state from the previous batch
    reused: bool | None = None
    #: whether it restored its state from a snapshot (neither: a new job's empty state)
    restored: bool | None = None
    rows_in: int | None = None
    rows_out: int | None = None
    #: whether it restored by catching up a stale live copy (``KeyedStateBackend.catch_up``)
    caught_up: bool | None = None
    #: reused a copy its worker caught up in the background since the last batch: how long
    #: that took, off the batch's path (``keyedstate.live-copies.background-catch-up``)
    background_catch_up_ms: float | None = None

    @classmethod
    def of_seconds(cls, *, sync_s: float, async_s: float, restore_s: float, reused: bool,
                   restored: bool, rows_in: int, rows_out: int, caught_up: bool,
                   background_catch_up_s: float) -> SubtaskStateStats:
        """The statistics of one subtask from the figures it reported to the driver
        (:class:`~keyedstate.runtime.wire.SubtaskFigures`, in seconds)."""
        return cls(sync_ms=_ms(sync_s), async_ms=_ms(async_s), restore_ms=_ms(restore_s),
                   reused=bool(reused), restored=bool(restored), rows_in=rows_in,
                   rows_out=rows_out, caught_up=bool(caught_up),
                   background_catch_up_ms=_ms(background_catch_up_s))


class CompletedCheckpointStats(msgspec.Struct, frozen=True, array_like=True):
    """One row of a job's checkpoint history (Flink's ``CompletedCheckpointStats``): a
    checkpoint's durations, sizes and transfers. Durations in milliseconds, the slowest
    subtask's (what the batch waited for). Append new fields at the end, optional."""

    checkpoint_id: int
    batch_id: int | None = None
    #: when the checkpoint was triggered (ms since the epoch, ``_metadata``'s timestamp)
    trigger_ms: int | None = None
    #: trigger to the last subtask's acknowledgement (Flink's end-to-end duration); a batch's
    #: checkpoint is triggered as the batch starts, so this includes processing its rows
    end_to_end_ms: float | None = None
    sync_ms: float | None = None
    async_ms: float | None = None
    restore_ms: float | None = None
    parallelism: int | None = None
    reused_subtasks: int | None = None
    restored_subtasks: int | None = None
    #: bytes this checkpoint wrote (uploaded, duplicated or inlined) and all it references
    incremental_bytes: int | None = None
    full_bytes: int | None = None
    #: the smallest and largest subtask's full state size
    min_subtask_bytes: int | None = None
    max_subtask_bytes: int | None = None
    uploaded_bytes: int | None = None
    duplicated_bytes: int | None = None
    inlined_bytes: int | None = None
    #: what the restores before the batch downloaded, and took from executors' file caches
    downloaded_bytes: int | None = None
    cache_hit_bytes: int | None = None
    rows_in: int | None = None
    rows_out: int | None = None
    #: of the restored subtasks, those that caught a stale live copy up
    caught_up_subtasks: int | None = None
    #: of the reused subtasks, those whose copy their worker caught up in the background
    background_caught_up_subtasks: int | None = None


_subtasks_decoder = msgspec.json.Decoder(list[SubtaskStateStats])
_history_decoder = msgspec.json.Decoder(list[CompletedCheckpointStats])
_encoder = msgspec.json.Encoder()


def _ms(seconds: Any) -> float | None:
    return None if seconds is None else round(float(seconds) * 1000, 1)


def _max(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _total(values: Iterable[int | None]) -> int | None:
    """The sum of the known ``values`` (a bool counts 1), None when none is known."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def completed_stats(checkpoint_id: int, *, batch_id: int | None, trigger_ms: int | None,
                    handles: Sequence[KeyedStateHandle],
                    properties: Mapping[str, str] | None = None,
                    subtasks: Sequence[SubtaskStateStats] | None = None,
                    end_to_end_ms: float | None = None) -> CompletedCheckpointStats:
    """A checkpoint's history row: sizes and transfer counts from its ``handles`` (plus the
    counts ``properties`` record for the whole snapshot, e.g. a savepoint's duplication),
    durations and subtask counts from ``subtasks`` (blank without them)."""
    snapshot = TransferStats.from_properties(properties or {})
    restore = TransferStats.from_properties(properties or {}, RESTORE_PREFIX)
    for handle in handles:
        snapshot.merge(TransferStats.from_properties(handle.properties))
        restore.merge(TransferStats.from_properties(handle.properties, RESTORE_PREFIX))
    sizes = [h.full_size for h in handles]
    known = list(subtasks or [])
    return CompletedCheckpointStats(
        checkpoint_id=checkpoint_id, batch_id=batch_id, trigger_ms=trigger_ms,
        end_to_end_ms=None if end_to_end_ms is None else round(end_to_end_ms, 1),
        sync_ms=_max(s.sync_ms for s in known), async_ms=_max(s.async_ms for s in known),
        restore_ms=_max(s.restore_ms for s in known),
        parallelism=len(handles),
        reused_subtasks=_total(s.reused for s in known),
        restored_subtasks=_total(s.restored for s in known),
        incremental_bytes=sum(h.incremental_size for h in handles), full_bytes=sum(sizes),
        min_subtask_bytes=min(sizes) if sizes else None,
        max_subtask_bytes=max(sizes) if sizes else None,
        uploaded_bytes=snapshot.uploaded_bytes, duplicated_bytes=snapshot.duplicated_bytes,
        inlined_bytes=snapshot.inlined_bytes, downloaded_bytes=restore.downloaded_bytes,
        cache_hit_bytes=restore.cache_hit_bytes,
        rows_in=_total(s.rows_in for s in known),
        rows_out=_total(s.rows_out for s in known),
        caught_up_subtasks=_total(s.caught_up for s in known),
        background_caught_up_subtasks=_total(
            None if s.background_catch_up_ms is None else s.background_catch_up_ms > 0
            for s in known))


def _decode(decoder: msgspec.json.Decoder, properties: Mapping[str, str], key: str,
            where: str) -> Any:
    value = properties.get(key)
    if value is None:
        return None
    try:
        return decoder.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("%s: the %s property can't be read (%s); left out", where, key, exc)
        return None


def subtask_stats_of(metadata: CheckpointMetadata) -> list[SubtaskStateStats] | None:
    """The recorded statistics of ``metadata``'s subtasks, in subtask order (None: not
    recorded, or not one per subtask)."""
    found = _decode(_subtasks_decoder, metadata.properties, SUBTASK_STATS,
                    f"checkpoint {metadata.checkpoint_id}")
    return found if found is not None and len(found) == len(metadata.handles) else None


def history_of(metadata: CheckpointMetadata) -> list[CompletedCheckpointStats]:
    """The history ``metadata`` records, oldest first ([] if none)."""
    return _decode(_history_decoder, metadata.properties, CHECKPOINT_HISTORY,
                   f"checkpoint {metadata.checkpoint_id}") or []


def _batch_id(properties: Mapping[str, str]) -> int | None:
    try:
        return int(properties[BATCH_ID])
    except (KeyError, ValueError):
        return None


def stats_of(metadata: CheckpointMetadata) -> CompletedCheckpointStats:
    """The history row of a stored snapshot: the one it recorded for itself, else what its
    handles and subtask statistics tell (durations blank when they were not recorded)."""
    history = history_of(metadata)
    if history and history[-1].checkpoint_id == metadata.checkpoint_id:
        return history[-1]
    return completed_stats(metadata.checkpoint_id, batch_id=_batch_id(metadata.properties),
                           trigger_ms=metadata.timestamp_ms, handles=metadata.handles,
                           properties=metadata.properties, subtasks=subtask_stats_of(metadata))


def stats_properties(row: CompletedCheckpointStats, subtasks: Sequence[SubtaskStateStats],
                     previous: CheckpointMetadata | None) -> dict[str, str]:
    """The properties recording checkpoint ``row`` and its ``subtasks``: the history of the
    job's ``previous`` checkpoint (or that checkpoint's own row, when it recorded none: one
    written before histories, or a claimed snapshot) with ``row`` appended, the last
    :data:`HISTORY_SIZE` kept."""
    history: list[CompletedCheckpointStats] = []
    if previous is not None:
        history = history_of(previous) or [stats_of(previous)]
    history = [r for r in history if r.checkpoint_id < row.checkpoint_id] + [row]
    return {CHECKPOINT_HISTORY: _encoder.encode(history[-HISTORY_SIZE:]).decode(),
            SUBTASK_STATS: _encoder.encode(list(subtasks)).decode()}


@dataclass
class BatchStats:
    """What one micro-batch and its checkpoint cost: the figures of its checkpoint's history
    row (:class:`CompletedCheckpointStats`, here in seconds and at full precision) and what
    only the running driver knows (the watermark, attempts, Spark tasks, ...). A Spark job's
    ``query.stats`` and listeners get one per batch (built from its subtasks' reports,
    :func:`~keyedstate.runtime.batch.batch_stats`); a Spark Connect client reads them back from
    the checkpoints (:meth:`from_checkpoint`)."""

    batch_id: int
    checkpoint_id: int
    #: events into the function (on time: late rows are not counted here)
    rows_in: int = 0
    #: rows the function received: ``rows_in``, or with a local aggregation one per key
    function_rows: int = 0
    rows_out: int = 0
    late_events: int = 0
    timers_fired: int = 0
    watermark: int = MIN_WATERMARK
    duration_s: float = 0.0
    sync_duration_s: float = 0.0
    async_duration_s: float = 0.0
    incremental_bytes: int = 0
    full_bytes: int = 0
    state_bytes_per_subtask: list[int] = field(default_factory=list)
    restore_s: float = 0.0
    reused_subtasks: int = 0
    restored_subtasks: int = 0
    #: of the restored subtasks, those that caught a stale live copy up (a cheap restore)
    caught_up_subtasks: int = 0
    skipped_replay: bool = False
    #: bytes the executors sent to checkpoint storage for this checkpoint
    uploaded_bytes: int = 0
    #: bytes the store duplicated itself for this checkpoint (no byte through the executors)
    duplicated_bytes: int = 0
    #: bytes stored inside ``_metadata`` (small files)
    inlined_bytes: int = 0
    #: objects this checkpoint created in the store
    objects_written: int = 0
    #: bytes restores downloaded before the batch, and took from the executors' file caches
    restore_downloaded_bytes: int = 0
    restore_cache_hit_bytes: int = 0
    #: runs of the batch (> 1: its checkpoint failed on transient storage errors and it was
    #: retried, ``execution.checkpointing.tolerable-failed-checkpoints``)
    attempts: int = 1
    #: Spark tasks the subtasks ran in (``keyedstate.spark.tasks``)
    spark_tasks: int = 0
    #: of the reused subtasks, those whose copy their worker had caught up in the background
    #: (``keyedstate.live-copies.background-catch-up``), and the longest such catch-up (off
    #: the batch's path)
    background_caught_up_subtasks: int = 0
    background_catch_up_s: float = 0.0

    @classmethod
    def from_checkpoint(cls, row: CompletedCheckpointStats) -> BatchStats:
        """A batch's statistics as its checkpoint recorded them: every field the history row
        has under the same name (or the name :data:`_ROW_NAMES` gives; milliseconds for
        those of :data:`_ROW_MILLISECONDS`), figures it left blank at their defaults (the
        batch id at -1). Not recorded there, so left at their defaults: ``function_rows``,
        ``late_events``, ``timers_fired``, ``watermark``, ``state_bytes_per_subtask``,
        ``objects_written``, ``attempts``, ``spark_tasks``, ``background_catch_up_s``."""
        values: dict[str, Any] = {"batch_id": -1}
        for name in (f.name for f in fields(cls)):
            if name in _ROW_MILLISECONDS:
                ms = getattr(row, _ROW_MILLISECONDS[name])
                values[name] = 0.0 if ms is None else ms / 1000
            elif (recorded := _ROW_NAMES.get(name, name)) in _ROW_FIELDS:
                value = getattr(row, recorded)
                if value is not None:
                    values[name] = value
        return cls(**values)


#: :class:`BatchStats` fields a history row records under another name ...
_ROW_NAMES = {"restore_downloaded_bytes": "downloaded_bytes",
              "restore_cache_hit_bytes": "cache_hit_bytes"}
#: ... and those it records in milliseconds
_ROW_MILLISECONDS = {"duration_s": "end_to_end_ms", "sync_duration_s": "sync_ms",
                     "async_duration_s": "async_ms", "restore_s": "restore_ms"}
_ROW_FIELDS = frozenset(CompletedCheckpointStats.__struct_fields__)


__all__ = ["BatchStats", "CompletedCheckpointStats", "HISTORY_SIZE", "SubtaskStateStats",
           "completed_stats", "history_of", "stats_of", "stats_properties",
           "subtask_stats_of"]
