"""What a savepoint of a Spark job carries besides its state, so that a job restored from it
anywhere neither loses nor doubles input or output.

1. **Source positions**: a copy of Spark's offset log up to the snapshot's batch
   (:func:`keyedstate.spark.offsets.capture`), from the copy the source snapshot carries, else
   from the Spark checkpoint location it names. A restored job seeds its own location with it.
2. **Output not known to be committed**: the staged output of the snapshot's batch, when the
   source is a checkpoint whose sink-commit marker is missing (its driver stopped between the
   checkpoint commit and the sink commit) or a savepoint that carries such output. The
   restored job commits it when it starts (sink commits are idempotent by batch id). A running
   job's savepoints commit their batch first and carry none.

Both are written into the savepoint before its ``_metadata`` (see
:data:`keyedstate.checkpoint.savepoint.Attach`), under paths relative to it.
"""

from __future__ import annotations

import json
import logging
import posixpath
from typing import Any, Mapping

from keyedstate.checkpoint.properties import BATCH_ID, STAGED
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.checkpoint.savepoint import CONTEXT_DIR, Attach, duplicate_file
from keyedstate.spark.offsets import (
    OFFSETS,
    PROP_SOURCE_LOG,
    PROP_SPARK_CHECKPOINT_LOCATION,
    OffsetLog,
    capture,
)
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import SnapshotKind
from keyedstate.storage.layout import commit_marker

log = logging.getLogger("keyedstate")

#: Where a savepoint keeps output of its batch that was not known to be committed.
PENDING_OUTPUT_DIR = f"{CONTEXT_DIR}/pending-output"


def batch_of(snapshot: ResolvedSnapshot) -> int:
    """The Spark batch a snapshot's state covers, -1 if none."""
    return int(snapshot.metadata.properties.get(BATCH_ID, -1))


def source_log_of(snapshot: ResolvedSnapshot, storage_options: Mapping[str, Any] | None
                  ) -> OffsetLog | None:
    """The offset log a snapshot's batch can be resumed from: the copy it carries, else its
    Spark checkpoint location when that still has the batch's offsets; None otherwise."""
    props = snapshot.metadata.properties
    if props.get(PROP_SOURCE_LOG):
        return OffsetLog(CheckpointStorage(snapshot.storage.url_of(props[PROP_SOURCE_LOG]),
                                           storage_options))
    location = props.get(PROP_SPARK_CHECKPOINT_LOCATION)
    if not location:
        return None
    try:
        found = OffsetLog.at(location, storage_options)
        return found if batch_of(snapshot) in found.batches(OFFSETS) else None
    except (OSError, ValueError, ImportError) as exc:  # a protocol fsspec can't read
        log.warning("can't read the Spark checkpoint location %s: %s", location, exc)
        return None


def output_committed(snapshot: ResolvedSnapshot) -> bool:
    """Whether the sinks are known to have committed the snapshot's staged output (a
    checkpoint with its marker, or a snapshot that stages none)."""
    props = snapshot.metadata.properties
    if STAGED not in props or batch_of(snapshot) < 0:
        return True
    return snapshot.metadata.kind is SnapshotKind.CHECKPOINT and snapshot.storage.exists(
        commit_marker(batch_of(snapshot), snapshot.metadata.checkpoint_id))


def carry(source: ResolvedSnapshot, storage_options: Mapping[str, Any] | None = None, *,
          committed: bool | None = None) -> Attach:
    """The :data:`Attach` of a savepoint of ``source``: its source positions (logged, not
    raised, when they can't be found: a job restored from the savepoint then refuses to start
    unless reprocessing is allowed) and its output unless committed (``committed``: known by
    the caller, else looked up)."""

    def attach(target: CheckpointStorage) -> dict[str, str]:
        props: dict[str, str] = {}
        batch = batch_of(source)
        if batch >= 0:
            found = source_log_of(source, storage_options)
            if found is None:
                log.warning("the savepoint of %s carries no source positions: the Spark "
                            "checkpoint location of batch %d is gone",
                            source.storage.url_of(source.metadata_path), batch)
            else:
                props.update(capture(found, batch, target))
        if not (output_committed(source) if committed is None else committed):
            props[STAGED] = json.dumps(_copy_staged(source, target))
        return props

    return attach


def _copy_staged(source: ResolvedSnapshot, target: CheckpointStorage) -> dict[str, list[str]]:
    staged: dict[str, list[str]] = json.loads(source.metadata.properties[STAGED])
    carried: dict[str, list[str]] = {}
    for tag, paths in staged.items():
        for path in paths:
            new = f"{PENDING_OUTPUT_DIR}/{tag}/{posixpath.basename(path)}"
            size = int(source.storage.fs.size(source.storage.path(path)))
            duplicate_file(source.storage, path, target, new, size)
            carried.setdefault(tag, []).append(new)
    return carried
