"""A job's checkpoint history, read from its stored checkpoints alone (what
``keyedstate checkpoints report`` draws; Flink's web UI checkpoint tab reads the same from
its ``CheckpointStatsTracker``).

Reads only ``_metadata`` files: the retained checkpoints of a job's checkpoint directory (or
one snapshot: a savepoint, a ``chk-N``, a ``_metadata`` file), the history the newest
readable one records (:mod:`keyedstate.checkpoint.stats`: the job's last checkpoints, one row
each), and per retained checkpoint its subtasks' sizes, transfers and recorded statistics.
What a snapshot did not record stays None (shown blank).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from keyedstate.checkpoint.properties import JOB_CONFIG
from keyedstate.checkpoint.resolve import ResolvedSnapshot, resolve_snapshot
from keyedstate.checkpoint.stats import (
    CompletedCheckpointStats,
    SubtaskStateStats,
    history_of,
    stats_of,
    subtask_stats_of,
)
from keyedstate.errors import (
    CorruptCheckpointError,
    NoCheckpointError,
    UnsafePathError,
    UnsupportedFormatVersionError,
)
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata
from keyedstate.storage.layout import METADATA_FILE, checkpoint_id_of_dir
from keyedstate.storage.transfer import RESTORE_PREFIX, TransferStats

#: What a ``_metadata`` that can't be read raises (listed in the report, not raised).
_UNREADABLE = (CorruptCheckpointError, UnsafePathError, UnsupportedFormatVersionError)


@dataclass(frozen=True)
class SubtaskReport:
    """One subtask of one retained snapshot: its key groups, sizes, transfers and recorded
    statistics (None: not recorded)."""

    index: int
    key_group_start: int
    key_group_end: int
    full_bytes: int
    incremental_bytes: int
    files: int
    uploaded_bytes: int
    duplicated_bytes: int
    inlined_bytes: int
    downloaded_bytes: int
    cache_hit_bytes: int
    stats: SubtaskStateStats | None


@dataclass(frozen=True)
class SnapshotReport:
    """One retained checkpoint (or the savepoint reported): its history row and subtasks."""

    checkpoint_id: int
    kind: str
    format: str
    metadata_url: str
    stats: CompletedCheckpointStats
    subtasks: list[SubtaskReport]


@dataclass(frozen=True)
class UnreadableSnapshot:
    """A retained checkpoint whose ``_metadata`` can't be read (the error, as text)."""

    checkpoint_id: int
    metadata_url: str
    error: str


@dataclass(frozen=True)
class CheckpointReport:
    """What a report shows: ``latest`` (the newest readable snapshot: the job's facts and
    configuration), ``history`` (one row per checkpoint, ascending by id: the rows ``latest``
    records, and a row for every retained checkpoint), ``retained`` (ascending) and the
    ``unreadable`` retained checkpoints."""

    directory: str
    latest: CheckpointMetadata
    latest_url: str
    history: list[CompletedCheckpointStats]
    retained: list[SnapshotReport]
    unreadable: list[UnreadableSnapshot]

    @property
    def configuration(self) -> dict[str, Any]:
        """The job's configuration as ``latest`` recorded it ({}: not recorded)."""
        try:
            recorded = json.loads(self.latest.properties.get(JOB_CONFIG, "{}"))
        except ValueError:
            return {}
        return recorded if isinstance(recorded, dict) else {}


def _subtasks(metadata: CheckpointMetadata) -> list[SubtaskReport]:
    recorded = subtask_stats_of(metadata)
    out = []
    for n, handle in enumerate(metadata.handles):
        snapshot = TransferStats.from_properties(handle.properties)
        restore = TransferStats.from_properties(handle.properties, RESTORE_PREFIX)
        out.append(SubtaskReport(
            index=handle.subtask_index, key_group_start=handle.key_group_start,
            key_group_end=handle.key_group_end, full_bytes=handle.full_size,
            incremental_bytes=handle.incremental_size, files=len(handle.streams()),
            uploaded_bytes=snapshot.uploaded_bytes, duplicated_bytes=snapshot.duplicated_bytes,
            inlined_bytes=snapshot.inlined_bytes, downloaded_bytes=restore.downloaded_bytes,
            cache_hit_bytes=restore.cache_hit_bytes,
            stats=None if recorded is None else recorded[n]))
    return out


def _snapshot_report(snapshot: ResolvedSnapshot) -> SnapshotReport:
    metadata = snapshot.metadata
    return SnapshotReport(
        checkpoint_id=metadata.checkpoint_id, kind=str(metadata.kind),
        format=str(metadata.format), metadata_url=snapshot.storage.url_of(snapshot.metadata_path),
        stats=stats_of(metadata), subtasks=_subtasks(metadata))


def _names_one_snapshot(url: str) -> bool:
    """Whether ``url`` names a ``_metadata`` file or a ``chk-N`` folder (else a directory)."""
    if url.endswith("/" + METADATA_FILE) or url == METADATA_FILE:
        return True
    return checkpoint_id_of_dir(url.rpartition("/")[2]) is not None


def read_report(path: str, storage_options: Mapping[str, Any] | None = None
                ) -> CheckpointReport:
    """The :class:`CheckpointReport` of ``path``: a job's checkpoint directory (its retained
    checkpoints and the history its latest readable one records), or one snapshot (a
    savepoint folder, a ``chk-N`` folder, a ``_metadata`` file). Reads only.

    Raises :class:`NoCheckpointError` for a path that does not exist or holds no checkpoint
    or savepoint, and :class:`CorruptCheckpointError` when no retained ``_metadata`` can be
    read (some unreadable ones are listed in the report instead)."""
    url = str(path).rstrip("/")
    storage = CheckpointStorage(url, storage_options)
    if _names_one_snapshot(url) or storage.exists(METADATA_FILE):
        snapshot = resolve_snapshot(url, storage_options)
        return _report(url, [snapshot], [])
    if not storage.call(f"checking {storage.url}", lambda: storage.fs.exists(storage.root)):
        raise NoCheckpointError(f"{path} does not exist: no checkpoints to report")
    ids = storage.checkpoint_ids()
    if not ids:
        raise NoCheckpointError(
            f"{path} holds no checkpoint or savepoint (no _metadata, no chk-N/_metadata): "
            f"nothing to report; point at a job's execution.checkpointing.dir")
    readable: list[ResolvedSnapshot] = []
    unreadable: list[UnreadableSnapshot] = []
    for checkpoint_id in ids:
        relative = storage.metadata_path(checkpoint_id)
        try:
            readable.append(ResolvedSnapshot(storage, relative, storage.read_metadata(relative)))
        except NoCheckpointError:
            continue  # subsumed by a running job since the listing: no longer retained
        except _UNREADABLE as exc:
            unreadable.append(UnreadableSnapshot(checkpoint_id, storage.url_of(relative),
                                                 f"{type(exc).__name__}: {exc}"))
    if not readable:
        detail = "; ".join(u.error for u in unreadable) or "they were deleted while reading"
        raise CorruptCheckpointError(
            f"no retained checkpoint of {path} can be read ({detail}); inspect them with "
            f"keyedstate checkpoints list")
    return _report(url, readable, unreadable)


def _report(directory: str, snapshots: list[ResolvedSnapshot],
            unreadable: list[UnreadableSnapshot]) -> CheckpointReport:
    latest = snapshots[-1]
    retained = [_snapshot_report(s) for s in snapshots]
    rows = {r.checkpoint_id: r for r in history_of(latest.metadata)}
    for snapshot in retained:
        rows.setdefault(snapshot.checkpoint_id, snapshot.stats)
    return CheckpointReport(
        directory=directory, latest=latest.metadata,
        latest_url=latest.storage.url_of(latest.metadata_path),
        history=[rows[i] for i in sorted(rows)], retained=retained, unreadable=unreadable)


__all__ = ["CheckpointReport", "SnapshotReport", "SubtaskReport", "UnreadableSnapshot",
           "read_report"]
