"""One job start-up, shared by every runtime (the local runtime and the Spark driver).

:func:`start_job` decides what a job starts from, in order (Flink's
``CheckpointCoordinator.restoreLatestCheckpointedState`` and ``RecoveryClaimMode``):

0. The checkpoint storage accepts the job's credentials and exists, so that a wrong key or a
   missing bucket fails the start, not the first checkpoint.
0b. A directory holding checkpoints holds those of one job: the job starting must be that job
   (:func:`~keyedstate.runtime.identity.check_same_job`: key types, key columns, states;
   :class:`~keyedstate.errors.JobMismatchError` before anything is read further or written).
   Its own checkpoints win over a restore path (a different one is logged as ignored).
1. A new job (no completed checkpoint of its own) with a restore path: the snapshot is checked,
   reading only (:func:`~keyedstate.checkpoint.restore_modes.open_restore_snapshot`), and so
   are its states against the function's descriptors (:func:`~keyedstate.backends.base.
   migration.check_restored_states`: an evolved type must be compatible), the runtime's own
   steps run on it (``on_restore``: Spark resumes its source positions and
   commits the output the snapshot carries), then CLAIM imports it as the job's first
   checkpoint and NO_CLAIM / LEGACY keep it as the restore source.
2. Key groups: the configured max parallelism, else the snapshot's, else that of the job's own
   checkpoints, else Flink's default; the parallelism must fit.
3. The coordinator: recovered from the job's own checkpoints when it completed any (a claimed
   snapshot is one now), else a new one; a recovered checkpoint's states are checked against
   the descriptors as in step 1.

What a runtime does after that (restore its subtasks, check the recovered checkpoint against
its source) stays with the runtime.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from keyedstate.backends.base.migration import check_restored_states
from keyedstate.checkpoint.coordinator import CheckpointCoordinator, has_completed_checkpoints
from keyedstate.checkpoint.properties import JOB_FUNCTION, RESTORED_FROM
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.checkpoint.restore_modes import (
    claim_snapshot,
    latest_readable_checkpoint,
    max_parallelism_of_job,
    open_restore_snapshot,
)
from keyedstate.config import JobConfig, RestoreMode
from keyedstate.keygroups import check_parallelism, compute_default_max_parallelism
from keyedstate.processor.canonical import PROP_KEY_COLUMNS
from keyedstate.runtime.declared import declared_states
from keyedstate.runtime.function import KeyedProcessFunction
from keyedstate.runtime.identity import check_same_job, function_name
from keyedstate.state.descriptors import StateDescriptor
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata

logger = logging.getLogger(__name__)

#: Called with the checked snapshot a new job starts from, before it is claimed; returns the
#: properties of the checkpoint a claimed snapshot becomes (used in CLAIM mode only).
OnRestore = Callable[[ResolvedSnapshot], Mapping[str, str]]


@dataclass(frozen=True)
class JobStart:
    """What :func:`start_job` decided a job starts from."""

    coordinator: CheckpointCoordinator
    max_parallelism: int
    #: True: the coordinator recovered the job's own checkpoints (its ``latest_completed`` is
    #: the state to restore); False: a new job, starting from ``restored`` or empty state
    recovered: bool
    #: the snapshot a new job restores from where it lies (NO_CLAIM / LEGACY) until its first
    #: checkpoint; None when it recovered or claimed, or starts from empty state
    restored: ResolvedSnapshot | None
    #: this start's identity, new at every start: a Python worker's live copy of a subtask
    #: (:mod:`keyedstate.runtime.live_copies`) is reused or caught up only by the start that
    #: made it. A later start (a restart in the same Spark session, possibly with a changed
    #: definition: evolved types, TTL, dropped states, other backend options or function)
    #: restores its subtasks from the snapshot instead, as a new session would.
    start_id: str = field(default_factory=lambda: uuid.uuid4().hex)


def start_job(storage: CheckpointStorage, *, backend: str, key_types: Sequence[str],
              parallelism: int, max_parallelism: int | None, num_retained: int,
              restore_path: str | None, restore_mode: RestoreMode,
              storage_options: Mapping[str, Any] | None, on_restore: OnRestore,
              descriptors: Sequence[StateDescriptor] = (),
              drop_states: Sequence[str] = (), key_columns: Sequence[str] | None = None,
              function: str = "", allow_job_change: bool = False) -> JobStart:
    """Start a job whose checkpoints live in ``storage`` (steps in the module docstring).

    ``max_parallelism``: the configured one (None: adopted, step 2). ``restore_path`` is used
    only by a job that has completed no checkpoint of its own: a job's own checkpoints always
    win. Raises what the steps raise, before the job writes anything, except a CLAIM, which
    is the job's first write: :class:`~keyedstate.errors.StorageAccessError` /
    :class:`~keyedstate.errors.StorageLocationError` (step 0), the snapshot's errors (step 1,
    see :func:`~keyedstate.checkpoint.restore_modes.open_restore_snapshot`), a parallelism
    beyond the max parallelism (step 2), and a job that completed checkpoints but has none
    left (:class:`~keyedstate.errors.MissingCheckpointFileError`, step 3: never an empty
    start). ``descriptors`` (the function's states) and ``drop_states`` are checked against
    the snapshot the job restores, before it is claimed
    (:class:`~keyedstate.errors.StateTypeMismatchError`, :class:`~keyedstate.errors.
    ConfigurationError`). ``key_columns`` (None: not known) and ``function`` (the class name
    its checkpoints record) identify the job: a directory holding another job's checkpoints
    is refused (:class:`~keyedstate.errors.JobMismatchError`, step 0b) unless
    ``allow_job_change``, and a claimed snapshot becomes a checkpoint naming them.
    """
    def check_states(metadata: CheckpointMetadata, where: str) -> None:
        kept = check_restored_states(metadata, descriptors, drop_states, where)
        if kept and descriptors:
            logger.info("%s: states %s are kept though no descriptor asks for them (drop them "
                        "with drop_states)", where, kept)

    # Step 0. Credentials and location, before anything is read or written.
    storage.check_access()
    # Step 0b. A directory's checkpoints are one job's: refuse another job before recovery
    # (which deletes incomplete and subsumed checkpoints) touches anything.
    own = has_completed_checkpoints(storage)
    latest_own = latest_readable_checkpoint(storage) if own else None
    if latest_own is not None:
        path, metadata = latest_own
        check_same_job(metadata, storage.url_of(path), key_types=key_types,
                       key_columns=key_columns, states=[d.name for d in descriptors],
                       drop_states=drop_states, function=function,
                       allow_change=allow_job_change, directory=storage.url)
        _log_ignored_restore_path(storage, metadata, restore_path)
    # Step 1. A new job started from a snapshot: check it (reads only), let the runtime act
    # on it, then claim it or keep it as the restore source.
    snapshot: ResolvedSnapshot | None = None
    restored: ResolvedSnapshot | None = None
    if restore_path and not own:
        snapshot = open_restore_snapshot(storage, restore_path, restore_mode,
                                         max_parallelism=max_parallelism, backend=backend,
                                         key_types=key_types, storage_options=storage_options)
        check_states(snapshot.metadata, snapshot.storage.url_of(snapshot.metadata_path))
        properties = on_restore(snapshot)
        if restore_mode is RestoreMode.CLAIM:
            # The claimed checkpoint is this job's: it names this job, not the snapshot's.
            identity = {**({PROP_KEY_COLUMNS: json.dumps(list(key_columns))}
                           if key_columns is not None else {}),
                        **({JOB_FUNCTION: function} if function else {})}
            claim_snapshot(snapshot, storage, {**properties, **identity})
        else:
            # The backends restore it with share_restored_files=False: the job's first
            # snapshot references none of its files (it duplicates them).
            restored = snapshot
    # Step 2. The key groups: configured, else the snapshot's, else those of the job's own
    # state, else Flink's default.
    max_parallelism = (max_parallelism
                       or (snapshot.metadata.max_parallelism if snapshot else None)
                       or max_parallelism_of_job(storage)
                       or compute_default_max_parallelism(parallelism))
    check_parallelism(parallelism, max_parallelism)
    # Step 3. The coordinator.
    recovered = has_completed_checkpoints(storage)
    coordinator = open_coordinator(storage, backend=backend, parallelism=parallelism,
                                   max_parallelism=max_parallelism, key_types=key_types,
                                   num_retained=num_retained)
    latest = coordinator.latest_completed if recovered else None
    if latest is not None:
        check_states(latest.metadata, storage.url_of(latest.metadata_path))
    return JobStart(coordinator, max_parallelism, recovered, restored)


def _log_ignored_restore_path(storage: CheckpointStorage, latest: CheckpointMetadata,
                              restore_path: str | None) -> None:
    """A restart resumes the job's own checkpoints (Flink does too); a restore path other
    than the one the job started from is ignored, which the log says, with the way to start
    from it (docs/restore-modes.md, "Restarting a job started from a snapshot")."""
    if not restore_path:
        return
    started_from = latest.properties.get(RESTORED_FROM, "")
    if started_from.rstrip("/") == restore_path.rstrip("/"):
        logger.info("%s holds the job's own checkpoints: resuming from them (the job started "
                    "from %s)", storage.url, started_from)
        return
    logger.warning("restore path %s ignored: %s holds the job's own checkpoints (the job "
                   "started from %s), and a job's own checkpoints win. To start from %s, "
                   "give the job a new checkpoint directory", restore_path, storage.url,
                   started_from or "empty state", restore_path)


def start_configured_job(storage: CheckpointStorage, config: JobConfig, *, backend: str,
                         key_types: Sequence[str], on_restore: OnRestore,
                         function: KeyedProcessFunction | None = None,
                         key_columns: Sequence[str] | None = None) -> JobStart:
    """:func:`start_job` for a job configured by ``config`` (parallelism, max parallelism,
    retained checkpoints, restore path and mode, storage options, states to drop, whether a
    change of job is intended) running ``function`` (its declared states:
    :func:`~keyedstate.runtime.declared.declared_states`) keyed by ``key_columns``."""
    descriptors = () if function is None else declared_states(function, key_types,
                                                              config.parallelism)
    return start_job(storage, backend=backend, key_types=key_types,
                     descriptors=descriptors, drop_states=config.drop_states,
                     parallelism=config.parallelism, max_parallelism=config.max_parallelism,
                     num_retained=config.num_retained, restore_path=config.restore_path,
                     restore_mode=config.restore_mode, storage_options=config.storage_options,
                     on_restore=on_restore, key_columns=key_columns,
                     function=function_name(function),
                     allow_job_change=config.allow_job_change)


def open_coordinator(storage: CheckpointStorage, *, backend: str, parallelism: int,
                     max_parallelism: int, key_types: Sequence[str],
                     num_retained: int) -> CheckpointCoordinator:
    """The coordinator of the job in ``storage`` (step 3): recovered when the job completed
    checkpoints (a claimed snapshot is one), also when every ``_metadata`` was lost:
    :meth:`~keyedstate.checkpoint.coordinator.CheckpointCoordinator.recover` then raises
    instead of the job starting from empty state or its initial snapshot. Else a new one."""
    args: dict[str, Any] = dict(backend=backend, parallelism=parallelism,
                                max_parallelism=max_parallelism, key_types=key_types,
                                num_retained=num_retained)
    if has_completed_checkpoints(storage):
        return CheckpointCoordinator.recover(storage, **args)
    return CheckpointCoordinator(storage, **args)
