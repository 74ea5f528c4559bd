"""Snapshot metadata: versioned, frozen models and their one serializer (``_metadata``).

The layout of a snapshot root is in :mod:`keyedstate.storage.layout`.

Every file reference (:class:`StreamHandle`) is a path *relative to the root* with a size and
an XXH64 checksum, so a reader verifies each file and refuses a path that leaves the root.
Format version 2 adds two kinds of reference (``docs/object-storage.md``): *inline* (the bytes
are in ``_metadata`` itself, no object) and *segment* (a byte range of a merged object holding
several small files of one snapshot).

``_metadata`` is JSON: ``{"format_version": 3, "checksum": <xxh64 of body>, "body": {...}}``.
A reader rejects an unknown ``format_version`` and a body whose checksum does not match (a
truncated or altered file), each with a typed error naming the file. Version 1 (no inline or
segment references) is read as before. Version 3 records each state's schema
(:attr:`StateMetaInfo.value_schema`, docs/schema-evolution.md); versions 1 and 2 are read with the type strings
alone. Every writer writes version 3: a keyedstate that reads only up to 2 refuses it, as it
would misread a state whose type evolved.
"""

from __future__ import annotations

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
from keyedstate.storage.layout import SHARED_DIR

FORMAT_VERSION = 3
SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2, 3})

class SnapshotKind(StrEnum):
    CHECKPOINT = "checkpoint"
    SAVEPOINT = "savepoint"


class SnapshotFormat(StrEnum):
    NATIVE = "native"
    CANONICAL = "canonical"


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """A byte range of a merged object: the content of one small file (format version 2)."""

    offset: int
    length: int
    checksum: str


class StreamHandle(msgspec.Struct, frozen=True, omit_defaults=True):
    """One file of a snapshot.

    ``path``, ``size`` and ``checksum`` (XXH64, hex) identify the *object* in the snapshot root
    that holds it (what the registry, gc and savepoints count and copy). Version 2 adds:

    - ``segment``: the file is this byte range of the object (a merged object of small files);
      its own length and checksum are the segment's;
    - ``data``: the file is inline, its bytes stored in ``_metadata`` (``path`` is empty, no
      object exists; ``size`` and ``checksum`` are the bytes').
    """

    path: str
    size: int
    checksum: str
    segment: Segment | None = None
    data: bytes | None = None

    def __post_init__(self) -> None:
        if self.data is not None:
            if self.path or self.segment is not None or self.size != len(self.data):
                raise CorruptCheckpointError(
                    f"an inline file reference has a path, a segment or a wrong size "
                    f"({self.path!r}, {self.size} bytes for {len(self.data)}); the _metadata "
                    f"file was altered"
                )
            return
        check_relative_path(self.path)
        if self.segment is not None and not (
                0 <= self.segment.offset and 0 <= self.segment.length
                and self.segment.offset + self.segment.length <= self.size):
            raise CorruptCheckpointError(
                f"segment {self.segment.offset}+{self.segment.length} lies outside "
                f"{self.path} ({self.size} bytes); the _metadata file was altered"
            )

    @property
    def length(self) -> int:
        """Bytes of the file itself (the segment's for a segment, else the object's)."""
        return self.segment.length if self.segment is not None else self.size

    @property
    def digest(self) -> str:
        """XXH64 of the file itself (the segment's for a segment, else the object's)."""
        return self.segment.checksum if self.segment is not None else self.checksum

    def object_handle(self) -> StreamHandle:
        """The whole object holding this file (itself unless a segment)."""
        return self if self.segment is None else StreamHandle(self.path, self.size,
                                                              self.checksum)


def inline_handle(data: bytes) -> StreamHandle:
    """A reference holding ``data`` itself (stored in ``_metadata``)."""
    return StreamHandle("", len(data), content_checksum(data), data=bytes(data))


class StateMetaInfo(msgspec.Struct, frozen=True):
    """What a snapshot records about one state, checked against the descriptor on restore.

    ``value_type`` / ``user_key_type`` name the types (``str`` of the pyarrow type, or
    ``pickle``); ``value_schema`` (format version 3, None for an untyped state) is the exact
    schema any Arrow reader can load: base64 of the Arrow IPC schema message of a schema with
    the field ``value`` (and ``map_key`` for a map state).
    """

    name: str
    kind: str
    value_type: str
    user_key_type: str | None = None
    ttl_ms: int | None = None
    value_schema: str | None = None


class KeyedStateHandle(msgspec.Struct, frozen=True):
    """The snapshot of one subtask's keyed state (Flink's ``IncrementalRemoteKeyedStateHandle``).

    ``shared`` files may be referenced by later checkpoints too (the shared-state registry owns
    them); ``private`` files belong to this snapshot alone. Both map a backend-local name (an SST
    file name, a heap chain link) to the file. ``incremental_size`` counts the bytes of the
    files this snapshot wrote (uploaded, duplicated or inlined); ``full_size`` the bytes of all
    files it references (file lengths: a merged object counts its segments, not its size).
    ``properties`` carry backend facts and the transfer counts (``transfer.*`` for the
    snapshot, ``restore.*`` for the restore before it, :mod:`keyedstate.storage.transfer`).
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

    def streams(self) -> list[StreamHandle]:
        """Every file reference, inline ones included."""
        return [*self.shared.values(), *self.private.values()]

    def files(self) -> list[StreamHandle]:
        """The stored objects this handle references (inline files have none; a merged
        object appears once per segment, always with the same size and checksum)."""
        return [s.object_handle() for s in self.streams() if s.data is None]

    def registered_files(self) -> list[StreamHandle]:
        """Objects the shared-state registry tracks: every stored shared file, and merged
        objects in ``shared/`` that only private segments use (private files otherwise live
        in ``chk-<N>/`` and go with it)."""
        return [*(s.object_handle() for s in self.shared.values() if s.data is None),
                *(s.object_handle() for s in self.private.values()
                  if s.data is None and s.path.startswith(SHARED_DIR + "/"))]


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
