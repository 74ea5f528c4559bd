"""The ``_metadata`` properties: every key a writer sets, spelled once, and which of them a
snapshot written from another one carries.

Keys keep the spellings already on disk (snapshots written so far must read back): snake
case for the job's and the protocol's keys, dotted prefixes for a writer's own family
(``transfer.*`` in :mod:`keyedstate.storage.transfer`, ``canonical.*`` in
:mod:`keyedstate.processor.canonical.layout`, ``rocksdb.*`` on the RocksDB backend's handles).
A runtime that needs keys of its own defines them in its package (Spark's:
:mod:`keyedstate.spark.offsets`), and they travel with the rest (:func:`portable_properties`).
"""

from __future__ import annotations

import json
from typing import Mapping

from keyedstate.storage.transfer import strip_transfer_properties

# -- a job's batches (written by both runtimes, one checkpoint per batch) -----------------------

#: The batch a checkpoint covers (-1: none, e.g. a claimed snapshot of a bootstrapped state).
BATCH_ID = "batch_id"
#: The event-time watermark after the batch (ms).
WATERMARK = "watermark"
#: The watermark before any event (a new job's) and after a drain (every timer due).
MIN_WATERMARK = -(1 << 63)
MAX_WATERMARK = (1 << 63) - 1
#: The snapshot token of each subtask's live copy (JSON list): a worker reuses only that copy.
TOKENS = "tokens"
#: The batch's staged outputs (JSON: output tag -> files), committed to the sinks after it.
STAGED = "staged"
#: "true" when the job ended with a drain: it is not restarted, a new job starts from it.
DRAINED = "drained"
#: The snapshot the job's lineage started from ("" for empty state).
RESTORED_FROM = "restored_from"
#: The class of the job's function (``module.QualName``): named when another job is refused on
#: the directory (:mod:`keyedstate.runtime.identity`); absent in older checkpoints.
JOB_FUNCTION = "function"
#: The job's configuration (JSON: dotted key -> value, storage options left out: they may hold
#: credentials; :meth:`keyedstate.config.JobConfig.recorded`).
JOB_CONFIG = "job_config"

def tokens_of(properties: Mapping[str, str]) -> list[str] | None:
    """The subtasks' snapshot tokens a checkpoint records (:data:`TOKENS`), None if none."""
    return json.loads(properties[TOKENS]) if TOKENS in properties else None


# -- statistics (:mod:`keyedstate.checkpoint.stats`, written by both runtimes) -----------------

#: This job's last checkpoints' statistics, one row each, this checkpoint's last (JSON).
CHECKPOINT_HISTORY = "checkpoint_history"
#: This checkpoint's statistics per subtask (JSON).
SUBTASK_STATS = "subtask_stats"

# -- the protocol ------------------------------------------------------------------------------

#: A checkpoint imported by CLAIM: the claimed snapshot's ``_metadata``.
CLAIMED_FROM = "claimed_from"
#: The restore mode the job's lineage started with.
RESTORE_MODE = "restore_mode"
#: A savepoint: the snapshot it was written from.
SAVEPOINT_OF = "savepoint_of"
#: The properties a savepoint's attached job context returned (JSON list): they name files of
#: that savepoint's ``context/``, so they are never carried into another snapshot root.
CONTEXT = "context_properties"

#: Properties that only mean something inside the job that wrote them (live-copy tokens, the
#: staged outputs of the batch) or describe it and its checkpoints (its configuration and
#: statistics, as transfer counts do): never carried into another snapshot root.
JOB_LOCAL = (TOKENS, STAGED, JOB_CONFIG, CHECKPOINT_HISTORY, SUBTASK_STATS)


def portable_properties(properties: Mapping[str, str]) -> dict[str, str]:
    """The properties of a snapshot that another snapshot root may carry (a native or canonical
    savepoint, a state processor rewrite): all but transfer counts, :data:`JOB_LOCAL` (the
    job's configuration and checkpoint statistics among them) and the context properties (:data:`CONTEXT` and the keys it lists)."""
    local = {*JOB_LOCAL, CONTEXT, *json.loads(properties.get(CONTEXT, "[]"))}
    return {k: v for k, v in strip_transfer_properties(properties).items() if k not in local}
