"""Every on-disk name of a snapshot root and its parser: the one place the layout is spelled.

Layout of a snapshot root (a job's checkpoint directory, or a savepoint directory)::

    <root>/chk-<N>/_metadata      the commit point of checkpoint N (written last, atomically)
    <root>/chk-<N>/...            files private to checkpoint N (deleted when it is subsumed)
    <root>/chk-<N>/_aborted       alone: checkpoint N was aborted, its id is used
    <root>/chk-<N>/_acks/subtask-<i>  while N is in flight (asynchronous phase): subtask i's
                                  files are durable (its handle), or its upload failed
    <root>/chk-<N>/_acks/flight   while N is in flight, over Spark Connect: the driver's record
                                  of it, for the client to complete it once the query stopped
    <root>/shared/chk-<N>-...     files shared by several checkpoints (shared-state registry),
                                  named after the checkpoint that wrote them
    <root>/taskowned/...          files owned by tasks (working directories)
    <root>/_completed             the job completed a checkpoint once (see recovery)

A Spark job's root also holds ``staging/batch-<B>/`` (staged outputs), ``commits/batch-<B>-chk-<N>``
(sink-commit markers) and ``spark/`` (Spark's offset log, by default).
"""

from __future__ import annotations

import re

METADATA_FILE = "_metadata"
CHECKPOINT_DIR_PREFIX = "chk-"
SHARED_DIR = "shared"
TASK_OWNED_DIR = "taskowned"
#: In a snapshot claimed by a job (CLAIM restore mode): names the owner, sits beside _metadata.
CLAIM_MARKER_FILE = "_claimed"
#: In ``chk-<N>/`` of an aborted checkpoint, alone: the id was used, so the next one is
#: above it even after a restart (ids are never reused; removed once a later checkpoint
#: completes, whose id is higher anyway).
ABORTED_MARKER_FILE = "_aborted"
#: At a job's root: written once, when the job's first checkpoint completes. From then on a
#: root without a readable ``chk-<N>/_metadata`` has lost its checkpoints (recovery refuses to
#: start it from empty state) instead of looking like a job that never completed one.
COMPLETED_MARKER_FILE = "_completed"
#: At a Spark job's root: written before the first batch of a start with
#: ``keyedstate.checkpointing.async-upload``, and never removed. Spark may then have logged
#: batches as done whose checkpoints never completed, which a later start (in either mode)
#: makes it run again; holds, as JSON, the largest ``max-concurrent-checkpoints`` a start
#: ran with (how many such batches there can be).
ASYNC_MARKER_FILE = "_async-upload"
#: Directories of a Spark job's checkpoint root besides the snapshot layout: staged outputs,
#: sink-commit markers and (by default) Spark's own offset checkpoint.
STAGING_DIR = "staging"
COMMITS_DIR = "commits"
SPARK_OFFSETS_DIR = "spark"


#: In ``chk-<N>/`` while checkpoint N is in flight (the asynchronous phase): one
#: acknowledgement per subtask, written once its files are durable; deleted once N completes.
ACKS_DIR = "_acks"


def acks_dir(checkpoint_id: int) -> str:
    """Where the subtasks of checkpoint ``checkpoint_id`` acknowledge their uploads."""
    return f"{CHECKPOINT_DIR_PREFIX}{checkpoint_id}/{ACKS_DIR}"


def ack_file(checkpoint_id: int, subtask_index: int) -> str:
    """Subtask ``subtask_index``'s acknowledgement of checkpoint ``checkpoint_id``."""
    return f"{acks_dir(checkpoint_id)}/subtask-{subtask_index}"


#: In ``chk-<N>/_acks/`` while checkpoint N is in flight, written by a driver whose loop may
#: end without completing it (the copy in a Spark Connect server): what another process needs
#: to complete it (a :class:`~keyedstate.runtime.wire.FlightRecord`); deleted with the acks.
FLIGHT_RECORD_FILE = "flight"


def flight_record_file(checkpoint_id: int) -> str:
    """The driver's record of checkpoint ``checkpoint_id`` in flight."""
    return f"{acks_dir(checkpoint_id)}/{FLIGHT_RECORD_FILE}"


def staging_dir(batch_id: int) -> str:
    """Where a batch's outputs are staged until its checkpoint and sinks commit."""
    return f"{STAGING_DIR}/batch-{batch_id}"


_STAGED_FILE_RE = re.compile(rf"^{STAGING_DIR}/batch-(\d+)/")


def batch_id_of_staged_file(relative: str) -> int | None:
    """The batch a file under :func:`staging_dir` was staged for; None for any other path."""
    m = _STAGED_FILE_RE.match(relative)
    return int(m.group(1)) if m else None


def commit_marker(batch_id: int, checkpoint_id: int) -> str:
    """Written once the sinks committed the output of ``batch_id``'s checkpoint."""
    return f"{COMMITS_DIR}/batch-{batch_id}-{CHECKPOINT_DIR_PREFIX}{checkpoint_id}"


_COMMIT_MARKER_RE = re.compile(rf"^{COMMITS_DIR}/batch-(\d+)-{CHECKPOINT_DIR_PREFIX}(\d+)$")


def checkpoint_id_of_commit_marker(relative: str) -> int | None:
    """The checkpoint id a :func:`commit_marker` path names, None for any other path."""
    m = _COMMIT_MARKER_RE.match(relative)
    return int(m.group(2)) if m else None


def checkpoint_dir_name(checkpoint_id: int) -> str:
    return f"{CHECKPOINT_DIR_PREFIX}{checkpoint_id}"


_CHECKPOINT_DIR_RE = re.compile(rf"^{CHECKPOINT_DIR_PREFIX}(\d+)$")


def checkpoint_id_of_dir(path: str) -> int | None:
    """The checkpoint id a :func:`checkpoint_dir_name` names, from a path or listing entry
    whose last component is ``chk-<N>`` (a trailing ``/`` allowed); None for anything else."""
    m = _CHECKPOINT_DIR_RE.match(str(path).rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def is_snapshot_file(relative: str) -> bool:
    """Whether a path relative to the root is a snapshot's file: shared (``shared/``) or
    private to a checkpoint (``chk-<N>/...``)."""
    return relative.startswith((f"{SHARED_DIR}/", CHECKPOINT_DIR_PREFIX))


_SHARED_FILE_RE = re.compile(rf"^{SHARED_DIR}/{CHECKPOINT_DIR_PREFIX}(\d+)-")


def shared_file_prefix(checkpoint_id: int) -> str:
    """The prefix of every shared file written for checkpoint ``checkpoint_id``:
    ``shared/chk-<N>-`` (a full name is ``shared/chk-<N>-sub-<i>-<uuid>-<name>``).

    The checkpoint id in the name is how the coordinator tells the files new in a checkpoint
    from re-referenced ones (Flink's placeholder handles), and how it finds what an aborted
    checkpoint wrote even when the writer was an executor's copy of the location."""
    return f"{SHARED_DIR}/{CHECKPOINT_DIR_PREFIX}{checkpoint_id}-"


def checkpoint_id_of_shared_file(path: str) -> int | None:
    """The checkpoint a shared file was written for, from its name; None for other paths."""
    m = _SHARED_FILE_RE.match(path)
    return int(m.group(1)) if m else None


#: The areas :func:`area_of` tells apart, in the order it tries them.
AREAS = ("metadata", "shared", "staging", "commits", "markers", "checkpoint", "taskowned",
         "spark", "other")
_MARKER_FILES = frozenset({COMPLETED_MARKER_FILE, ASYNC_MARKER_FILE, CLAIM_MARKER_FILE,
                           ABORTED_MARKER_FILE})


def area_of(path: str) -> str:
    """Which part of a snapshot root ``path`` (absolute, a URL or relative: read from its
    components, the root unknown) belongs to, one of :data:`AREAS`: ``metadata`` (a
    ``_metadata``: a checkpoint's or a savepoint's, or a temporary name of one), ``shared``, ``staging``, ``commits``,
    ``markers`` (``_completed``, ``_async-upload``, ``_claimed``, ``_aborted``),
    ``checkpoint`` (other files of a ``chk-<N>/``), ``taskowned``, ``spark`` (the offset log)
    or ``other``. The last matching
    component decides, so a root that itself lies below a folder named like one still reads
    right for the files below it; a folder's own path (a listing) is in its area."""
    parts = str(path).rstrip("/").split("/")
    name = parts[-1]
    if name.split(".", 1)[0] == METADATA_FILE:
        return "metadata"
    if name in _MARKER_FILES:
        return "markers"
    for part in reversed(parts):
        if part == SHARED_DIR:
            return "shared"
        if part == STAGING_DIR:
            return "staging"
        if part == COMMITS_DIR:
            return "commits"
        if part == TASK_OWNED_DIR:
            return "taskowned"
        if part == SPARK_OFFSETS_DIR:
            return "spark"
        if _CHECKPOINT_DIR_RE.match(part):
            return "checkpoint"
    return "other"
