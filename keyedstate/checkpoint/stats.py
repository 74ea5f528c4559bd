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
from typing import Any, Mapping, Sequence

import msgspec

from keyedstate.checkpoint.properties import BATCH_ID, CHECKPOINT_HISTORY, SUBTASK_STATS
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
    #: the asynchronous part: writing the files to checkpoint storage
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


def subtask_stats(stats: Mapping[str, Any]) -> SubtaskStateStats:
    """The statistics of one subtask from what it reported to the driver (the ``stats`` of
    its result row, :func:`~keyedstate.runtime.subtask.process_subtask`)."""
    reused, restored = stats.get("reused_local_state"), stats.get("restored")
    caught_up = stats.get("caught_up")
    return SubtaskStateStats(
        sync_ms=_ms(stats.get("sync_s")), async_ms=_ms(stats.get("async_s")),
        restore_ms=_ms(stats.get("restore_s")),
        reused=None if reused is None else bool(reused),
        restored=None if restored is None else bool(restored),
        rows_in=stats.get("rows_in"), rows_out=stats.get("rows_out"),
        caught_up=None if caught_up is None else bool(caught_up),
        background_catch_up_ms=_ms(stats.get("background_catch_up_s")))


def _max(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


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
    reused = [s.reused for s in known if s.reused is not None]
    restored = [s.restored for s in known if s.restored is not None]
    caught_up = [s.caught_up for s in known if s.caught_up is not None]
    background = [s.background_catch_up_ms for s in known
                  if s.background_catch_up_ms is not None]
    rows_in = [s.rows_in for s in known if s.rows_in is not None]
    rows_out = [s.rows_out for s in known if s.rows_out is not None]
    return CompletedCheckpointStats(
        checkpoint_id=checkpoint_id, batch_id=batch_id, trigger_ms=trigger_ms,
        end_to_end_ms=None if end_to_end_ms is None else round(end_to_end_ms, 1),
        sync_ms=_max([s.sync_ms for s in known]), async_ms=_max([s.async_ms for s in known]),
        restore_ms=_max([s.restore_ms for s in known]),
        parallelism=len(handles),
        reused_subtasks=sum(reused) if reused else None,
        restored_subtasks=sum(restored) if restored else None,
        incremental_bytes=sum(h.incremental_size for h in handles), full_bytes=sum(sizes),
        min_subtask_bytes=min(sizes) if sizes else None,
        max_subtask_bytes=max(sizes) if sizes else None,
        uploaded_bytes=snapshot.uploaded_bytes, duplicated_bytes=snapshot.duplicated_bytes,
        inlined_bytes=snapshot.inlined_bytes, downloaded_bytes=restore.downloaded_bytes,
        cache_hit_bytes=restore.cache_hit_bytes,
        rows_in=sum(rows_in) if rows_in else None,
        rows_out=sum(rows_out) if rows_out else None,
        caught_up_subtasks=sum(caught_up) if caught_up else None,
        background_caught_up_subtasks=sum(1 for ms in background if ms > 0)
        if background else None)


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


__all__ = ["CompletedCheckpointStats", "HISTORY_SIZE", "SubtaskStateStats", "completed_stats",
           "history_of", "stats_of", "stats_properties", "subtask_stats", "subtask_stats_of"]
