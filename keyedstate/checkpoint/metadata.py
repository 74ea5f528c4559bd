"""Snapshot metadata: versioned, frozen models and their one serializer (``_metadata``).

Layout of a snapshot root (a job's checkpoint directory, or a savepoint directory)::

    <root>/chk-<N>/_metadata      the commit point of checkpoint N (written last, atomically)
    <root>/chk-<N>/...            files private to checkpoint N (deleted when it is subsumed)
    <root>/shared/chk-<N>-...     files shared by several checkpoints (shared-state registry),
                                  named after the checkpoint that wrote them
    <root>/taskowned/...          files owned by tasks (working directories)

Every file reference (:class:`StreamHandle`) is a path *relative to the root* with a size and
an XXH64 checksum, so a reader verifies each file and refuses a path that leaves the root.

``_metadata`` is JSON: ``{"format_version": 1, "checksum": <xxh64 of body>, "body": {...}}``.
A reader rejects an unknown ``format_version`` and a body whose checksum does not match (a
truncated or altered file), each with a typed error naming the file.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

import msgspec
import xxhash

from keyedstate.errors import (
    CorruptCheckpointError,
    UnsafePathError,
    UnsupportedFormatVersionError,
)
from keyedstate.keygroups import KeyGroupRange

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = frozenset({1})

METADATA_FILE = "_metadata"
CHECKPOINT_DIR_PREFIX = "chk-"
SHARED_DIR = "shared"
TASK_OWNED_DIR = "taskowned"
#: In a snapshot claimed by a job (CLAIM restore mode): names the owner, sits beside _metadata.
CLAIM_MARKER_FILE = "_claimed"
#: Directories of a Spark job's checkpoint root besides the snapshot layout: staged outputs,
#: sink-commit markers and (by default) Spark's own offset checkpoint.
STAGING_DIR = "staging"
COMMITS_DIR = "commits"
SPARK_OFFSETS_DIR = "spark"


def checkpoint_dir_name(checkpoint_id: int) -> str:
    return f"{CHECKPOINT_DIR_PREFIX}{checkpoint_id}"


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


class SnapshotKind(StrEnum):
    CHECKPOINT = "checkpoint"
    SAVEPOINT = "savepoint"


class SnapshotFormat(StrEnum):
    NATIVE = "native"
    CANONICAL = "canonical"


class StreamHandle(msgspec.Struct, frozen=True):
    """One file in a snapshot root: its relative path, size in bytes and XXH64 (hex)."""

    path: str
    size: int
    checksum: str

    def __post_init__(self) -> None:
        check_relative_path(self.path)


class StateMetaInfo(msgspec.Struct, frozen=True):
    """What a snapshot records about one state, checked against the descriptor on restore."""

    name: str
    kind: str
    value_type: str
    user_key_type: str | None = None
    ttl_ms: int | None = None


class KeyedStateHandle(msgspec.Struct, frozen=True):
    """The snapshot of one subtask's keyed state (Flink's ``IncrementalRemoteKeyedStateHandle``).

    ``shared`` files may be referenced by later checkpoints too (the shared-state registry owns
    them); ``private`` files belong to this snapshot alone. Both map a backend-local name (an SST
    file name, a heap chain link) to the file. ``incremental_size`` counts the bytes this
    snapshot wrote; ``full_size`` all bytes it references.
    """

    backend: str
    subtask_index: int
    key_group_start: int
    key_group_end: int
    checkpoint_id: int
    states: list[StateMetaInfo]
    shared: dict[str, StreamHandle]
    private: dict[str, StreamHandle]
    full_size: int
    incremental_size: int
    properties: dict[str, str] = {}

    @property
    def key_group_range(self) -> KeyGroupRange:
        return KeyGroupRange(self.key_group_start, self.key_group_end)

    def files(self) -> list[StreamHandle]:
        return [*self.shared.values(), *self.private.values()]


class CheckpointMetadata(msgspec.Struct, frozen=True):
    """The content of ``_metadata``: everything needed to restore one snapshot."""

    checkpoint_id: int
    timestamp_ms: int
    backend: str
    parallelism: int
    max_parallelism: int
    key_types: list[str]
    handles: list[KeyedStateHandle]
    kind: SnapshotKind = SnapshotKind.CHECKPOINT
    format: SnapshotFormat = SnapshotFormat.NATIVE
    properties: dict[str, str] = {}

    def files(self) -> list[StreamHandle]:
        return [f for h in self.handles for f in h.files()]

    @property
    def full_size(self) -> int:
        return sum(h.full_size for h in self.handles)

    @property
    def incremental_size(self) -> int:
        return sum(h.incremental_size for h in self.handles)


def check_relative_path(path: str) -> str:
    """Refuse a reference that could leave its snapshot root (absolute, URL, ``..``, empty)."""
    parts = path.split("/")
    if (
        not path
        or path.startswith(("/", "\\"))
        or "://" in path
        or ":" in parts[0]
        or "\\" in path
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise UnsafePathError(
            f"file reference {path!r} points outside its snapshot directory; refusing to use it "
            f"(the _metadata file was altered or written by something else)"
        )
    return path


class _Envelope(msgspec.Struct):
    format_version: int
    checksum: str
    body: msgspec.Raw


_json_encoder = msgspec.json.Encoder()
_envelope_decoder = msgspec.json.Decoder(_Envelope)
_body_decoder = msgspec.json.Decoder(CheckpointMetadata)


def content_checksum(data: bytes) -> str:
    """The checksum keyedstate records for every file: XXH64, hex."""
    return xxhash.xxh64_hexdigest(data)


def serialize_metadata(metadata: CheckpointMetadata) -> bytes:
    body = _json_encoder.encode(metadata)
    envelope: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "checksum": content_checksum(body),
        "body": msgspec.Raw(body),
    }
    return _json_encoder.encode(envelope)


def deserialize_metadata(data: bytes, source: str = "_metadata") -> CheckpointMetadata:
    """Parse ``_metadata`` bytes; ``source`` names the file in errors."""
    try:
        envelope = _envelope_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptCheckpointError(
            f"{source} is truncated or not a keyedstate metadata file ({exc}); restore from an "
            f"older checkpoint or savepoint"
        ) from exc
    if envelope.format_version not in SUPPORTED_FORMAT_VERSIONS:
        raise UnsupportedFormatVersionError(
            f"{source} has format_version {envelope.format_version}, this keyedstate reads "
            f"{sorted(SUPPORTED_FORMAT_VERSIONS)}; upgrade keyedstate to read it"
        )
    body = bytes(envelope.body)
    if content_checksum(body) != envelope.checksum:
        raise CorruptCheckpointError(
            f"{source} fails its checksum: the file was altered or partly written; restore from "
            f"an older checkpoint or savepoint"
        )
    try:
        return _body_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        if isinstance(exc.__cause__, UnsafePathError):
            # msgspec wraps errors raised in __post_init__ in a ValidationError; unwrap it and
            # name the _metadata file, which the path check alone cannot know.
            raise UnsafePathError(f"{source}: {exc.__cause__}; restore from another checkpoint "
                                  f"or savepoint") from exc
        raise CorruptCheckpointError(f"{source} has an invalid body: {exc}") from exc
