"""Every error keyedstate raises: one root, typed leaves.

Each leaf also subclasses the matching built-in so that callers who catch ``ValueError`` or
``FileNotFoundError`` keep working. Messages name the file, state or key involved and say what
to do about it.
"""

from __future__ import annotations


class KeyedStateError(Exception):
    """Root of every error raised by keyedstate."""


class ConfigurationError(KeyedStateError, ValueError):
    """A setting is missing, out of range or inconsistent with another one."""


class KeyGroupRangeError(KeyedStateError, ValueError):
    """A key group or a state handle does not fit the key-group range it is used with."""


class MaxParallelismMismatchError(KeyedStateError, ValueError):
    """A snapshot was taken with another max parallelism than the job restoring it."""


class StateNotFoundError(KeyedStateError, KeyError):
    """A state name is not registered (or not present in the snapshot being read)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class StateTypeMismatchError(KeyedStateError, TypeError):
    """A descriptor does not match the state of the same name (kind or type) on restore."""


class SerializationError(KeyedStateError, ValueError):
    """A key or value does not match its declared type, or stored bytes cannot be decoded."""


class UserFunctionError(KeyedStateError, RuntimeError):
    """A user-supplied function (reduce, aggregate, process) raised."""


class BackendError(KeyedStateError, RuntimeError):
    """The state backend's native store (RocksDB) failed."""


class CheckpointError(KeyedStateError):
    """Root of errors about checkpoints and savepoints."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No completed checkpoint (or no snapshot at the given path) exists."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint file is truncated, altered or unreadable (size or checksum mismatch)."""


class MissingCheckpointFileError(CheckpointError, FileNotFoundError):
    """A file referenced by a checkpoint is missing from storage."""


class UnsupportedFormatVersionError(CheckpointError, ValueError):
    """A ``_metadata`` file has a ``format_version`` this version of keyedstate cannot read."""


class UnsafePathError(CheckpointError, ValueError):
    """A file reference points outside its checkpoint or savepoint directory."""


class CheckpointProtocolError(CheckpointError, ValueError):
    """The checkpoint protocol was misused: a duplicate or foreign acknowledgement, a missing
    subtask, a checkpoint id out of order, a pending checkpoint of another coordinator."""


class CheckpointAbortedError(CheckpointError, RuntimeError):
    """A pending checkpoint was aborted and can no longer be completed."""


class SourcePositionsError(ConfigurationError):
    """A job's state and its source's positions don't match: started from a snapshot whose
    source positions can't be restored, or with a Spark checkpoint location that holds another
    query than the one the checkpoints cover. Starting would skip or double input."""


class JobMismatchError(ConfigurationError):
    """The job being started is not the one whose state it would take over: the checkpoint
    directory's job had other key columns, key types or states (or a snapshot restored is
    keyed by other types). Raised at start, before anything is written; the message names
    the recorded job, what differs and the ways out (docs/checkpoints.md, "What identifies a
    job")."""


class SinkRollbackError(ConfigurationError):
    """A job restored from a snapshot into a new Spark checkpoint location would roll a sink
    back: the sink already holds batches of the snapshot's lineage after the snapshot's batch
    (the old job went on after it). Raised at start, before anything is restored or written;
    the message names the sink, those batches and the ways out (another path or table, or
    ``keyedstate.sinks.on-rollback: branch``)."""


class OutputSchemaError(KeyedStateError, TypeError):
    """Rows a function emitted do not match the declared output schema."""


class SinkSchemaError(ConfigurationError):
    """A sink's destination (an existing Delta or Iceberg table) can't take rows of the job's
    output schema, or is partitioned otherwise; raised by ``start()`` before the first batch."""


class MissingDependencyError(KeyedStateError, ImportError):
    """An optional dependency a feature needs is not installed; the message names the extra
    to install (``pip install 'keyedstate[delta]'``, ``pip install 'keyedstate[iceberg]'``)."""


class BatchFailedError(KeyedStateError, RuntimeError):
    """Processing one micro-batch failed. The message names the batch, the subtask and the key
    where known, the error, and ends with the traceback of the user's code that raised (the
    function's frames, not the runtime's); the same are attributes, None where unknown:
    ``batch_id``, ``subtask``, ``key`` (the key's ``repr``) and ``user_traceback``."""

    def __init__(self, message: str, *, batch_id: int | None = None, subtask: int | None = None,
                 key: str | None = None, user_traceback: str | None = None) -> None:
        super().__init__(message)
        self.batch_id = batch_id
        self.subtask = subtask
        self.key = key
        self.user_traceback = user_traceback


class CheckpointDiscardedError(CheckpointError, RuntimeError):
    """A checkpoint in flight failed in its asynchronous phase (its upload, its
    acknowledgement or its completion): it and every later batch were discarded, and the job
    is back at its last completed checkpoint. ``discarded_batches``: the batch ids whose state
    and output are gone (send them again); ``last_batch_id``: the batch the job's state covers
    now (docs/checkpoints.md, "The asynchronous phase")."""

    def __init__(self, message: str, *, discarded_batches: list[int],
                 last_batch_id: int) -> None:
        super().__init__(message)
        self.discarded_batches = discarded_batches
        self.last_batch_id = last_batch_id


class StopTimeoutError(KeyedStateError, TimeoutError):
    """A stop waited longer than its timeout for the batch in flight; the job keeps running."""


class SnapshotExistsError(CheckpointError, FileExistsError):
    """The target directory already holds a savepoint; keyedstate never overwrites one."""


class OutputPathError(KeyedStateError, FileExistsError):
    """A command's output path (``--out``) holds something the command did not write (a
    directory where a file goes, a file that is not its own, a non-empty directory); keyedstate
    never replaces what it does not own. Choose a new path, or delete it yourself."""


class TargetNotEmptyError(KeyedStateError, FileExistsError):
    """A command that writes a directory of its own (a savepoint, the demo's) was given one
    that holds something it did not write there, or a file; nothing was written or deleted."""


class JobDrainedError(CheckpointError, RuntimeError):
    """The job was stopped with drain (every timer fired); it takes no more input."""


class SnapshotClaimedError(CheckpointError, RuntimeError):
    """A snapshot is owned by a job that restored it in CLAIM mode; no other job may start from
    it (the owner deletes it once subsumed)."""


class TransientStorageError(CheckpointError, ConnectionError):
    """A storage call kept failing with transient errors (timeouts, 5xx, throttling) after every
    retry; retrying the batch or the restore later may succeed."""


class StorageAccessError(CheckpointError, PermissionError):
    """The checkpoint storage refused the job's credentials or permissions."""


class StorageLocationError(CheckpointError, FileNotFoundError):
    """The checkpoint storage location does not exist (e.g. a missing bucket)."""


class SparkConnectUnsupportedError(KeyedStateError, NotImplementedError):
    """A keyed job over a Spark Connect session needs something Spark Connect does not give
    (the message names it and the way out; docs/spark.md, "Spark Connect")."""


class SparkConnectServerError(ConfigurationError):
    """The Spark Connect server's Python could not load a keyed job (keyedstate, or the module
    of its function or a sink, is not importable there); the message has the server's error."""


class LatencyModelError(ConfigurationError):
    """A storage latency model (``kslatency://``, ``--latency`` of a benchmark) was given a
    parameter it does not know or a value out of range; the message names the parameter, the
    value and what is accepted (docs/object-storage.md, "A latency model for benchmarks")."""
