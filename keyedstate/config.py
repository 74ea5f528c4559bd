"""Job configuration: dotted-kebab keys, Flink's names where Flink has one, defaults once.

``JobConfig`` is the typed form; ``JobConfig.from_mapping({"state.backend.type": "heap", ...})``
reads the dotted keys (unknown keys are refused, with the known ones listed).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Mapping

from keyedstate.errors import ConfigurationError
from keyedstate.keygroups import check_parallelism, compute_default_max_parallelism

if TYPE_CHECKING:
    from keyedstate.storage.transfer import TransferOptions


class RestoreMode(StrEnum):
    """Who owns the snapshot a job is started from (Flink's ``RecoveryClaimMode``)."""

    NO_CLAIM = "NO_CLAIM"
    CLAIM = "CLAIM"
    LEGACY = "LEGACY"


def parse_restore_mode(value: RestoreMode | str) -> RestoreMode:
    """``value`` as a :class:`RestoreMode` (any case); :class:`ConfigurationError` naming the
    modes otherwise."""
    try:
        return RestoreMode(str(value).upper())
    except ValueError:
        raise ConfigurationError(
            f"execution.state-recovery.claim-mode {value!r} is not a restore mode; choose one of "
            f"{[m.value for m in RestoreMode]} (docs/restore-modes.md)"
        ) from None


class SourcePositions(StrEnum):
    """Whether a job started from a snapshot resumes its source after the snapshot's batch."""

    RESTORE = "restore"
    IGNORE = "ignore"


class OnRollback(StrEnum):
    """What a job restored into a new Spark checkpoint location does when a sink already holds
    batches of the snapshot's lineage after the snapshot's batch (docs/sinks.md, "Restarts,
    restores and rollbacks")."""

    REFUSE = "refuse"
    BRANCH = "branch"


class LateEvents(StrEnum):
    DROP = "drop"
    SIDE_OUTPUT = "side-output"


#: The side output late events go to with ``keyedstate.late-events: side-output``.
LATE_EVENTS_TAG = "late-events"


def _key(name: str) -> dict[str, str]:
    return {"key": name}


@dataclass(frozen=True)
class JobConfig:
    """Configuration of one keyed job. Every field has a dotted key (``JobConfig.KEYS``)."""

    checkpoint_dir: str = field(metadata=_key("execution.checkpointing.dir"))
    backend: str = field(default="rocksdb", metadata=_key("state.backend.type"))
    parallelism: int = field(default=2, metadata=_key("parallelism.default"))
    max_parallelism: int | None = field(default=None, metadata=_key("pipeline.max-parallelism"))
    #: Spark tasks a batch's subtasks run in (each runs a contiguous group of subtasks, one
    #: after another); None: the cluster's task slots (``defaultParallelism``), at most
    #: ``parallelism`` (docs/spark.md, "Subtasks and Spark tasks")
    spark_tasks: int | None = field(default=None, metadata=_key("keyedstate.spark.tasks"))
    num_retained: int = field(default=1, metadata=_key("execution.checkpointing.num-retained"))
    restore_path: str | None = field(default=None, metadata=_key("execution.state-recovery.path"))
    restore_mode: RestoreMode = field(default=RestoreMode.NO_CLAIM,
                                      metadata=_key("execution.state-recovery.claim-mode"))
    #: Where the source of a job started from a snapshot resumes: ``restore`` (the default)
    #: exactly after the snapshot's batch, refusing to start where that is impossible;
    #: ``ignore``: afresh, from wherever the job's Spark checkpoint location starts (a new
    #: source, or reprocessing intended). docs/savepoints.md, "Source positions"
    source_positions: SourcePositions = field(
        default=SourcePositions.RESTORE,
        metadata=_key("keyedstate.state-recovery.source-positions"))
    #: A restore into a new Spark checkpoint location over sinks that already hold batches of
    #: the snapshot's lineage after its batch (a rollback): ``refuse`` (the default) fails the
    #: start with SinkRollbackError; ``branch`` writes the restored job's batches beside them,
    #: under its own lineage. docs/sinks.md, "Restarts, restores and rollbacks"
    on_rollback: OnRollback = field(default=OnRollback.REFUSE,
                                    metadata=_key("keyedstate.sinks.on-rollback"))
    #: States of the restored snapshot to drop (no descriptor asks for them any more); a state
    #: no descriptor asks for is otherwise kept, never deleted silently. A list of names, or
    #: one string of comma-separated names. docs/schema-evolution.md, "Added and removed states"
    drop_states: tuple[str, ...] = field(
        default=(), metadata=_key("keyedstate.state-recovery.drop-states"))
    watermark_column: str | None = field(default=None, metadata=_key("keyedstate.watermark.column"))
    watermark_delay: dt.timedelta = field(default=dt.timedelta(0),
                                          metadata=_key("keyedstate.watermark.delay"))
    late_events: LateEvents = field(default=LateEvents.DROP, metadata=_key("keyedstate.late-events"))
    local_dir: str | None = field(default=None, metadata=_key("state.backend.local-dir"))
    storage_options: dict[str, Any] = field(default_factory=dict,
                                            metadata=_key("keyedstate.checkpointing.storage-options"))
    backend_options: dict[str, Any] = field(default_factory=dict,
                                            metadata=_key("keyedstate.backend.options"))
    # -- object storage (docs/object-storage.md) -----------------------------------------------
    transfer_threads: int = field(
        default=4, metadata=_key("state.backend.rocksdb.checkpoint.transfer.thread.num"))
    transfer_attempts: int = field(
        default=5, metadata=_key("keyedstate.checkpointing.transfer.attempts"))
    #: bytes; -1: 20 KiB on object stores, off on a local disk
    memory_threshold: int = field(default=-1, metadata=_key("state.storage.fs.memory-threshold"))
    #: None: on for object stores, off on a local disk
    file_merging: bool | None = field(
        default=None, metadata=_key("execution.checkpointing.file-merging.enabled"))
    file_merging_max_file_size: int = field(
        default=32 << 20, metadata=_key("execution.checkpointing.file-merging.max-file-size"))
    file_cache_size: int = field(
        default=1 << 30, metadata=_key("state.backend.forst.cache.size-based-limit"))
    file_cache_dir: str | None = field(default=None, metadata=_key("state.backend.forst.cache.dir"))
    #: Spark runtime: once a task's subtasks are done, its Python worker brings its live copies
    #: of the job's other subtasks to the checkpoint just written, in the background (a later
    #: task of one of them there then reuses its copy instead of catching up on the batch's
    #: path). Costs the worker's idle CPU; docs/spark.md, "State locality"
    background_catch_up: bool = field(
        default=True, metadata=_key("keyedstate.live-copies.background-catch-up"))
    #: with ``background_catch_up``: a live copy that can't catch up (RocksDB) is restored
    #: from the new checkpoint in the background instead (off by default: a restore costs the
    #: worker more CPU than a catch-up; docs/spark.md, "State locality")
    background_restore: bool = field(
        default=False, metadata=_key("keyedstate.live-copies.background-restore"))
    #: consecutive failed checkpoints (transient storage errors) a batch is retried after
    tolerable_failed_checkpoints: int = field(
        default=3, metadata=_key("execution.checkpointing.tolerable-failed-checkpoints"))

    def __post_init__(self) -> None:
        if not self.checkpoint_dir:
            raise ConfigurationError("execution.checkpointing.dir is required")
        object.__setattr__(self, "restore_mode", parse_restore_mode(self.restore_mode))
        object.__setattr__(self, "late_events", LateEvents(str(self.late_events)))
        try:
            object.__setattr__(self, "source_positions",
                               SourcePositions(str(self.source_positions).lower()))
        except ValueError:
            raise ConfigurationError(
                f"keyedstate.state-recovery.source-positions {self.source_positions!r} is not "
                f"one of {[p.value for p in SourcePositions]}"
            ) from None
        try:
            object.__setattr__(self, "on_rollback", OnRollback(str(self.on_rollback).lower()))
        except ValueError:
            raise ConfigurationError(
                f"keyedstate.sinks.on-rollback {self.on_rollback!r} is not one of "
                f"{[r.value for r in OnRollback]}"
            ) from None
        drop = self.drop_states
        if isinstance(drop, str):
            drop = [n.strip() for n in drop.split(",") if n.strip()]
        if not isinstance(drop, (list, tuple)) or not all(isinstance(n, str) and n
                                                          for n in drop):
            raise ConfigurationError(
                f"keyedstate.state-recovery.drop-states must be a list of state names, got "
                f"{self.drop_states!r}")
        object.__setattr__(self, "drop_states", tuple(drop))
        if isinstance(self.watermark_delay, (int, float)):
            object.__setattr__(self, "watermark_delay",
                               dt.timedelta(milliseconds=self.watermark_delay))
        check_parallelism(self.parallelism, self.effective_max_parallelism)
        if self.spark_tasks is not None and (
                not isinstance(self.spark_tasks, int) or isinstance(self.spark_tasks, bool)
                or self.spark_tasks < 1):
            raise ConfigurationError(
                f"keyedstate.spark.tasks must be an int >= 1 (or unset: the cluster's task "
                f"slots), got {self.spark_tasks!r}"
            )
        if self.num_retained < 1:
            raise ConfigurationError(
                f"execution.checkpointing.num-retained must be >= 1, got {self.num_retained}"
            )
        if self.tolerable_failed_checkpoints < 0:
            raise ConfigurationError(
                f"execution.checkpointing.tolerable-failed-checkpoints must be >= 0, got "
                f"{self.tolerable_failed_checkpoints}"
            )
        for key, value in (("background-catch-up", self.background_catch_up),
                           ("background-restore", self.background_restore)):
            if not isinstance(value, bool):
                raise ConfigurationError(
                    f"keyedstate.live-copies.{key} must be true or false, got {value!r}")
        self.transfer_options()  # checks the transfer settings

    def transfer_options(self) -> TransferOptions:
        """The object-storage settings as :class:`TransferOptions`."""
        from keyedstate.storage.transfer import AUTO, TransferOptions

        merge = AUTO if self.file_merging is None else (
            TransferOptions.DEFAULT_MERGE_FILE_SIZE if self.file_merging else 0)
        return TransferOptions(threads=self.transfer_threads, attempts=self.transfer_attempts,
                               inline_threshold=self.memory_threshold, merge_file_size=merge,
                               merge_max_size=self.file_merging_max_file_size,
                               cache_bytes=self.file_cache_size, cache_dir=self.file_cache_dir)

    @property
    def effective_max_parallelism(self) -> int:
        return self.max_parallelism or compute_default_max_parallelism(self.parallelism)

    @property
    def watermark_delay_ms(self) -> int:
        return int(self.watermark_delay / dt.timedelta(milliseconds=1))

    @classmethod
    def keys(cls) -> dict[str, str]:
        """Dotted key -> field name."""
        return {f.metadata["key"]: f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> JobConfig:
        known = cls.keys()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigurationError(
                f"unknown configuration keys {unknown}; known keys: {sorted(known)}"
            )
        return cls(**{known[k]: v for k, v in options.items()})

    def recorded(self) -> dict[str, Any]:
        """The configuration as a checkpoint records it (``job_config``, shown by
        ``keyedstate checkpoints report``): dotted key -> value, enums as their names, the
        watermark delay in ms. ``keyedstate.checkpointing.storage-options`` is left out: it
        may hold credentials, and ``_metadata`` is read by whoever may list the checkpoints."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "storage_options":
                continue
            value = getattr(self, f.name)
            if isinstance(value, dt.timedelta):
                value = self.watermark_delay_ms
            elif isinstance(value, StrEnum):
                value = str(value)
            out[f.metadata["key"]] = value
        return out

    def replace(self, **changes: Any) -> JobConfig:
        return dataclasses.replace(self, **changes)
