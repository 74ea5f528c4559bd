"""What identifies a job, checked at start against the checkpoint directory's job.

A checkpoint directory belongs to one job. Its checkpoints record who that job is: the key
types (``_metadata``'s ``key_types``), the key columns (:data:`~keyedstate.processor.
canonical.PROP_KEY_COLUMNS`), the states (the handles' state meta infos) and, informative
only, the function's class (:data:`~keyedstate.checkpoint.properties.JOB_FUNCTION`). A job
starting on the directory is the same job when (:func:`check_same_job`):

1. its key types are the recorded ones (always: keys are stored in their types' encoding);
2. its key columns are the recorded ones (where recorded), unless the change is intended
   (``keyedstate.state-recovery.allow-job-change``);
3. it declares states and at least one of them is a recorded state not dropped
   (``drop_states``), unless the directory's job had no states left to keep, or the change is
   intended. Adding states, dropping states and evolving their types (docs/schema-evolution.md)
   keep at least one state, so they are no change of job.

The function's class is not part of the identity (renaming a class is no new job); it is
named in the error. Decisions: docs/checkpoints.md, "What identifies a job".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from keyedstate.checkpoint.properties import JOB_FUNCTION
from keyedstate.checkpoint.restore_modes import ddl_types, same_key_types
from keyedstate.errors import JobMismatchError
from keyedstate.processor.canonical import PROP_KEY_COLUMNS
from keyedstate.runtime.function import KeyedProcessFunction
from keyedstate.storage.handles import CheckpointMetadata

#: The configuration key that lets a start take over a directory despite a changed identity.
ALLOW_JOB_CHANGE = "keyedstate.state-recovery.allow-job-change"


def function_name(function: KeyedProcessFunction | None) -> str:
    """The qualified class name a checkpoint records for ``function`` ("" for none)."""
    if function is None:
        return ""
    cls = type(function)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class JobIdentity:
    """Who a job is, as its checkpoints record it (None: not recorded, e.g. checkpoints
    written before key columns or the function were recorded)."""

    key_types: list[str]
    key_columns: list[str] | None
    states: list[str]
    function: str | None

    @classmethod
    def recorded(cls, metadata: CheckpointMetadata) -> JobIdentity:
        columns = metadata.properties.get(PROP_KEY_COLUMNS)
        names = json.loads(columns) if columns else None
        return cls(key_types=list(metadata.key_types),
                   key_columns=[str(n) for n in names] if isinstance(names, list) else None,
                   states=sorted({s.name for h in metadata.handles for s in h.states}),
                   function=metadata.properties.get(JOB_FUNCTION) or None)

    def describe(self) -> str:
        parts = [f"key columns {self.key_columns}" if self.key_columns is not None
                 else "key columns not recorded",
                 f"key types {ddl_types(self.key_types)}", f"states {self.states}"]
        if self.function:
            parts.append(f"function {self.function}")
        return ", ".join(parts)


def check_key_types(recorded: Sequence[str], job: Sequence[str], where: str, ways_out: str
                    ) -> None:
    """Refuse (:class:`JobMismatchError`) a job keyed by other types than the state at
    ``where``, naming both in DDL; ``ways_out`` ends the message."""
    if recorded and job and not same_key_types(recorded, job):
        raise JobMismatchError(
            f"{where} is keyed by key types {ddl_types(recorded)}, the job by "
            f"{ddl_types(job)}; keys are stored in their types' encoding, so the job can't "
            f"read this state. {ways_out}"
        )


def check_same_job(metadata: CheckpointMetadata, where: str, *, key_types: Sequence[str],
                   key_columns: Sequence[str] | None, states: Sequence[str],
                   drop_states: Sequence[str], function: str, allow_change: bool,
                   directory: str) -> None:
    """Refuse to start a job on the checkpoint directory ``directory`` whose latest checkpoint
    (``metadata``, at ``where``) is another job's (rules in the module docstring); reads
    only. ``key_columns`` None or ``states`` empty: not known, not checked (a function that
    registers its states lazily declares none at start). Raises :class:`JobMismatchError`
    naming the recorded job, what differs and the ways out."""
    recorded = JobIdentity.recorded(metadata)
    new_directory = (f"give the job a checkpoint directory of its own (to start it from this "
                     f"state, set execution.state-recovery.path (restore_path) to {directory} "
                     f"and execution.checkpointing.dir to a new directory)")
    # Rule 1. Key types: no option changes them in place.
    check_key_types(recorded.key_types, key_types, where,
                    f"The directory's job: {recorded.describe()}. If this is another job, "
                    f"{new_directory}; to change the key types, migrate the state with the "
                    f"state processor API (SavepointReader / SavepointWriter)")
    if allow_change:
        return
    differs = []
    # Rule 2. Key columns.
    if (recorded.key_columns is not None and key_columns is not None
            and list(key_columns) != recorded.key_columns):
        differs.append(f"key columns {recorded.key_columns} -> {list(key_columns)}")
    # Rule 3. A function whose states share nothing with the directory's.
    kept = [s for s in recorded.states if s not in drop_states]
    if states and kept and not set(states) & set(kept):
        differs.append(f"states {recorded.states} -> {sorted(states)} (none in common)")
    if differs:
        job = f" ({function})" if function else ""
        raise JobMismatchError(
            f"{directory} holds the checkpoints of another job (latest: {where}; "
            f"{recorded.describe()}); the job being started{job} differs: "
            f"{'; '.join(differs)}. Nothing was written. If this is another job, "
            f"{new_directory}. If it is this job, changed on purpose (a renamed key column, "
            f"states replaced), set {ALLOW_JOB_CHANGE}: true (JobConfig(allow_job_change=True)) "
            f"for this start; dropping states on purpose is drop_states"
        )
