"""Job configuration: dotted-kebab keys, Flink's names where Flink has one, defaults once.

``JobConfig`` is the typed form; ``JobConfig.from_mapping({"state.backend.type": "heap", ...})``
reads the dotted keys (unknown keys are refused, with the known ones listed).

Each setting is declared once, as a field: its annotation is its type, its default the
default, and ``metadata=_key("dotted.key")`` its key (with ``minimum=`` for a lower bound),
like Flink's ``ConfigOptions.key(...).intType().defaultValue(...)``. A value is the field's
Python type or its string form (``"false"``, ``"5 min"``, ``"32 mb"``, ``"side_output"``),
parsed as :mod:`keyedstate.config_values` says, at construction: what doesn't parse is a
:class:`ConfigurationError` naming the key, the value and what it takes (docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Mapping

from keyedstate.config_values import (
    Bytes,
    Invalid,
    ValueType,
    enum_parser,
    parse_setting,
    value_type,
)
from keyedstate.errors import ConfigurationError
from keyedstate.keygroups import check_parallelism, compute_default_max_parallelism

if TYPE_CHECKING:
    from keyedstate.storage.transfer import TransferOptions


class RestoreMode(StrEnum):
    """Who owns the snapshot a job is started from (Flink's ``RecoveryClaimMode``)."""

    NO_CLAIM = "NO_CLAIM"
    CLAIM = "CLAIM"
    LEGACY = "LEGACY"


_parse_restore_mode = enum_parser(RestoreMode)


def parse_restore_mode(value: RestoreMode | str) -> RestoreMode:
    """``value`` as a :class:`RestoreMode`, spelled as the configuration takes it (any case,
    ``-`` or ``_``: ``NO_CLAIM``, ``no-claim``); :class:`ConfigurationError` naming the modes
    otherwise."""
    try:
        return typing.cast(RestoreMode, _parse_restore_mode(value))
    except Invalid:
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


class LocalAggregationPlan(StrEnum):
    """How Spark runs a function's local aggregation (``keyedstate.local-aggregation.plan``;
    docs/spark.md, "Two-phase aggregation"): ``shuffle-then-aggregate`` (the default, the
    faster plan measured here) shuffles the raw rows once into their Spark tasks and aggregates
    after the shuffle; ``partial-aggregate`` aggregates in every map task before the shuffle,
    as Spark's own aggregation, then routes one row per key with a second shuffle (fewer bytes
    over a network when keys repeat often within a map task)."""

    SHUFFLE_THEN_AGGREGATE = "shuffle-then-aggregate"
    PARTIAL_AGGREGATE = "partial-aggregate"


#: The side output late events go to with ``keyedstate.late-events: side-output``.
LATE_EVENTS_TAG = "late-events"


def _key(name: str, *, minimum: int | None = None, secret: bool = False) -> dict[str, Any]:
    """A field's metadata: its dotted key; for a number, the least value it takes; ``secret``:
    the value may hold credentials (never shown in an error, never recorded)."""
    return {"key": name, "minimum": minimum, "secret": secret}


@dataclass(frozen=True)
class ConfigOption:
    """One setting (Flink's ``ConfigOption``): its dotted key, field, type and default."""

    key: str
    field_name: str
    type: ValueType
    default: Any
    minimum: int | None = None
    secret: bool = False

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    def parse(self, value: Any) -> Any:
        """``value`` (Python or string form) as this setting takes it, or
        :class:`ConfigurationError` naming the key, the value and what it takes."""
        return parse_setting(self.key, self.field_name, self.type, value, self.minimum,
                             secret=self.secret)


@dataclass(frozen=True)
class JobConfig:
    """Configuration of one keyed job. Every field is one setting with a dotted key
    (``JobConfig.options()``, ``JobConfig.keys()``), checked and parsed at construction."""

    checkpoint_dir: str = field(metadata=_key("execution.checkpointing.dir"))
    backend: str = field(default="rocksdb", metadata=_key("state.backend.type"))
    parallelism: int = field(default=2, metadata=_key("parallelism.default", minimum=1))
    max_parallelism: int | None = field(default=None,
                                        metadata=_key("pipeline.max-parallelism", minimum=1))
    #: Spark tasks a batch's subtasks run in (each runs a contiguous group of subtasks, one
    #: after another); None: the cluster's task slots (``defaultParallelism``), at most
    #: ``parallelism`` (docs/spark.md, "Subtasks and Spark tasks")
    spark_tasks: int | None = field(default=None, metadata=_key("keyedstate.spark.tasks",
                                                                        minimum=1))
    num_retained: int = field(default=1,
                              metadata=_key("execution.checkpointing.num-retained", minimum=1))
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
    #: Take over the checkpoint directory's state although the job's key columns changed or
    #: none of its states is one the directory's job had (an intended change, e.g. a renamed
    #: key column; Flink's ``allowNonRestoredState`` in spirit). Key types must match anyway.
    #: docs/checkpoints.md, "What identifies a job"
    allow_job_change: bool = field(
        default=False, metadata=_key("keyedstate.state-recovery.allow-job-change"))
    watermark_column: str | None = field(default=None, metadata=_key("keyedstate.watermark.column"))
    watermark_delay: dt.timedelta = field(default=dt.timedelta(0),
                                          metadata=_key("keyedstate.watermark.delay"))
    late_events: LateEvents = field(default=LateEvents.DROP, metadata=_key("keyedstate.late-events"))
    #: Spark: how a function's local aggregation runs (:class:`LocalAggregationPlan`); the
    #: local runtime aggregates with pyarrow either way
    local_aggregation_plan: LocalAggregationPlan = field(
        default=LocalAggregationPlan.SHUFFLE_THEN_AGGREGATE,
        metadata=_key("keyedstate.local-aggregation.plan"))
    local_dir: str | None = field(default=None, metadata=_key("state.backend.local-dir"))
    storage_options: dict[str, Any] = field(default_factory=dict,
                                            metadata=_key("keyedstate.checkpointing.storage-options",
                                                          secret=True))
    backend_options: dict[str, Any] = field(default_factory=dict,
                                            metadata=_key("keyedstate.backend.options"))
    #: RocksDB backend: the bound of each subtask's value cache (estimated bytes; 0: off;
    #: None: the backend's default, 0: off). Set, it goes into ``backend_options`` as
    #: ``value_cache_size`` (overriding one there); the heap backend ignores it.
    #: docs/rocksdb-backend.md, "The value cache"
    rocksdb_value_cache_size: Bytes | None = field(
        default=None,
        metadata=_key("keyedstate.backend.rocksdb.value-cache-size", minimum=0))
    #: RocksDB backend: the key-group shards (RocksDB instances) a fresh subtask's state is
    #: split into (None: the backend's default, 8). Set, it goes into ``backend_options``'
    #: ``options`` as ``key_group_shards``; the heap backend ignores it. Fewer suit a small
    #: state: each shard costs a DB to open on every restore and a flush at every snapshot;
    #: more bound a checkpoint's upload as the state grows. docs/rocksdb-backend.md,
    #: "What a shard costs"
    rocksdb_key_group_shards: int | None = field(
        default=None,
        metadata=_key("keyedstate.backend.rocksdb.key-group-shards", minimum=1))
    # -- object storage (docs/object-storage.md) -----------------------------------------------
    transfer_threads: int = field(
        default=4,
        metadata=_key("state.backend.rocksdb.checkpoint.transfer.thread.num", minimum=1))
    transfer_attempts: int = field(
        default=5, metadata=_key("keyedstate.checkpointing.transfer.attempts", minimum=1))
    #: bytes; -1: 20 KiB on object stores, off on a local disk
    memory_threshold: Bytes = field(default=-1,
                                    metadata=_key("state.storage.fs.memory-threshold", minimum=-1))
    #: None: on for object stores, off on a local disk
    file_merging: bool | None = field(
        default=None, metadata=_key("execution.checkpointing.file-merging.enabled"))
    file_merging_max_file_size: Bytes = field(
        default=32 << 20,
        metadata=_key("execution.checkpointing.file-merging.max-file-size", minimum=1))
    file_cache_size: Bytes = field(
        default=1 << 30, metadata=_key("state.backend.forst.cache.size-based-limit", minimum=0))
    file_cache_dir: str | None = field(default=None, metadata=_key("state.backend.forst.cache.dir"))
    #: Spark runtime: once a task's subtasks are done, its Python worker brings its live copies
    #: of the job's other subtasks to the checkpoint just written, in the background, once it is
    #: committed or, with ``async_upload``, once every subtask acknowledged it in flight (a
    #: later task of one of them there then reuses its copy instead of catching up on the
    #: batch's path). None (the default): on in the synchronous mode, where it costs the
    #: worker's idle CPU between batches, off with ``async_upload``, where the next batch's
    #: tasks start at once and it would take its CPU from them (measured: docs/spark.md,
    #: "State locality"); see :attr:`catches_up_in_background`
    background_catch_up: bool | None = field(
        default=None, metadata=_key("keyedstate.live-copies.background-catch-up"))
    #: with ``async_upload``: once a task's subtasks are done, its Python worker fetches into
    #: its file cache the files of the checkpoint in flight that its stale copies of the other
    #: subtasks lack, once every subtask acknowledged it, without touching the copies (a later
    #: task of one of them there restores or catches up from the cache). None (the default):
    #: on when the worker does not catch those copies up in the background itself (see
    #: ``background_catch_up``); a GET per new file. docs/spark.md, "State locality"
    background_prefetch: bool | None = field(
        default=None, metadata=_key("keyedstate.live-copies.background-prefetch"))
    #: with ``background_catch_up``: a live copy that can't catch up (RocksDB) is restored
    #: from the new checkpoint (or its acknowledgement) in the background instead (off by default: a restore costs the
    #: worker more CPU than a catch-up; docs/spark.md, "State locality")
    background_restore: bool = field(
        default=False, metadata=_key("keyedstate.live-copies.background-restore"))
    #: where a snapshot's files are uploaded: false (the synchronous mode) in the subtask's
    #: task, on the batch's path; true in the background of the process, the checkpoint
    #: completing and the sinks committing during a later batch.
    #: docs/checkpoints.md, "The asynchronous phase"
    async_upload: bool = field(
        default=False, metadata=_key("keyedstate.checkpointing.async-upload"))
    #: with ``async_upload``: the checkpoints left in flight when a batch returns (Flink's
    #: ``execution.checkpointing.max-concurrent-checkpoints``)
    max_concurrent_checkpoints: int = field(
        default=1, metadata=_key("keyedstate.checkpointing.max-concurrent-checkpoints",
                                 minimum=1))
    #: with ``async_upload``: how long the driver waits for a checkpoint's acknowledgements,
    #: and a subtask for the one it restores from, before the checkpoint fails (Flink's
    #: ``execution.checkpointing.timeout``)
    checkpoint_timeout: dt.timedelta = field(
        default=dt.timedelta(minutes=10), metadata=_key("execution.checkpointing.timeout"))
    #: consecutive failed checkpoints (transient storage errors) a batch is retried after
    tolerable_failed_checkpoints: int = field(
        default=3,
        metadata=_key("execution.checkpointing.tolerable-failed-checkpoints", minimum=0))

    def __post_init__(self) -> None:
        # Every setting through its type's parser: a wrong value fails here, naming its key,
        # not in the first batch.
        if not self.checkpoint_dir:
            raise ConfigurationError(_REQUIRED)
        for option in self.options():
            object.__setattr__(self, option.field_name,
                               option.parse(getattr(self, option.field_name)))
        check_parallelism(self.parallelism, self.effective_max_parallelism)
        if self.backend == "rocksdb":
            # The backend is built from backend_options alone (load_backend).
            object.__setattr__(self, "backend_options", self._rocksdb_options())
        self.transfer_options()  # checks the transfer settings together

    def _rocksdb_options(self) -> dict[str, Any]:
        """``backend_options`` with the RocksDB settings that have keys of their own put in,
        overriding what is there."""
        options = dict(self.backend_options)
        if self.rocksdb_value_cache_size is not None:
            options["value_cache_size"] = self.rocksdb_value_cache_size
        if self.rocksdb_key_group_shards is not None:
            given: Any = options.get("options")
            # RocksDBOptions itself is not imported here (the vocabulary imports no floor).
            options["options"] = (
                dataclasses.replace(given, key_group_shards=self.rocksdb_key_group_shards)
                if dataclasses.is_dataclass(given) and not isinstance(given, type)
                else {**(given or {}), "key_group_shards": self.rocksdb_key_group_shards})
        return options

    @classmethod
    def options(cls) -> tuple[ConfigOption, ...]:
        """Every setting, in field order (one per dotted key)."""
        return _options(cls)

    @property
    def catches_up_in_background(self) -> bool:
        """Whether workers catch their live copies up in the background: the setting, or when
        unset, the synchronous mode (see ``background_catch_up``)."""
        if self.background_catch_up is None:
            return not self.async_upload
        return self.background_catch_up

    @property
    def prefetches_in_background(self) -> bool:
        """Whether workers prefetch their stale copies' new files in the asynchronous mode: the
        setting, or when unset, whenever they don't catch the copies up themselves (see
        ``background_prefetch``); never in the synchronous mode."""
        if not self.async_upload:
            return False
        if self.background_prefetch is None:
            return not self.catches_up_in_background
        return self.background_prefetch

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
        """The configured max parallelism, else Flink's default for ``parallelism`` (a job
        restored from a snapshot without one adopts the snapshot's at start)."""
        return self.max_parallelism or compute_default_max_parallelism(self.parallelism)

    @property
    def watermark_delay_ms(self) -> int:
        """``watermark_delay`` in milliseconds."""
        return int(self.watermark_delay / dt.timedelta(milliseconds=1))

    @classmethod
    def keys(cls) -> dict[str, str]:
        """Dotted key -> field name."""
        return {f.metadata["key"]: f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> JobConfig:
        """The configuration of dotted keys to values, each a Python value or its string form
        (Flink's: ``"false"``, ``"5 min"``, ``"32 mb"``; docs/configuration.md). An unknown
        key, a missing required one or a value that doesn't parse is a
        :class:`ConfigurationError` naming it."""
        known = cls.keys()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigurationError(
                f"unknown configuration keys {unknown}; known keys: {sorted(known)}"
            )
        missing = [o.key for o in cls.options() if o.required and o.key not in options]
        if missing:
            raise ConfigurationError(_REQUIRED)
        return cls(**{known[k]: v for k, v in options.items()})

    def recorded(self) -> dict[str, Any]:
        """The configuration as a checkpoint records it (``job_config``, shown by
        ``keyedstate checkpoints report``): dotted key -> value, enums as their names,
        durations in ms. A secret setting (``keyedstate.checkpointing.storage-options``)
        is left out: it may hold credentials, and ``_metadata`` is read by whoever may list
        the checkpoints."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("secret"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, dt.timedelta):
                value = int(value.total_seconds() * 1000)
            elif isinstance(value, StrEnum):
                value = str(value)
            out[f.metadata["key"]] = value
        return out

    def replace(self, **changes: Any) -> JobConfig:
        """A copy with ``changes`` (field names) applied and checked as at construction."""
        return dataclasses.replace(self, **changes)


_REQUIRED = ("execution.checkpointing.dir (JobConfig.checkpoint_dir) is required: the "
             "directory checkpoints go to, a path or any fsspec URL")


_OPTIONS: dict[type, tuple[ConfigOption, ...]] = {}


def _options(cls: type[JobConfig]) -> tuple[ConfigOption, ...]:
    if cls not in _OPTIONS:
        _OPTIONS[cls] = _declared_options(cls)
    return _OPTIONS[cls]


def _declared_options(cls: type[JobConfig]) -> tuple[ConfigOption, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple(
        ConfigOption(key=f.metadata["key"], field_name=f.name, type=value_type(hints[f.name]),
                     default=(f.default_factory() if f.default_factory is not dataclasses.MISSING
                              else f.default),
                     minimum=f.metadata.get("minimum"), secret=f.metadata.get("secret", False))
        for f in dataclasses.fields(cls))


# Every field's type has a string form: a setting declared with another type fails at import.
JobConfig.options()
