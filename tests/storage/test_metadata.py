"""``_metadata``: the one serializer, its envelope checks, and the path checks of references."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyedstate.errors import (
    CorruptCheckpointError,
    UnsafePathError,
    UnsupportedFormatVersionError,
)
from keyedstate.storage.handles import (
    CheckpointMetadata,
    KeyedStateHandle,
    SnapshotFormat,
    SnapshotKind,
    StateMetaInfo,
    StreamHandle,
    check_relative_path,
    content_checksum,
    deserialize_metadata,
    serialize_metadata,
)
from keyedstate.storage.layout import checkpoint_id_of_shared_file, shared_file_prefix
from tests.property_budget import budget


def sample_metadata(path: str = "shared/chk-3-sub-0-abc-000012.sst") -> CheckpointMetadata:
    handle = KeyedStateHandle(
        backend="rocksdb", subtask_index=0, key_group_start=0, key_group_end=63, checkpoint_id=3,
        states=[StateMetaInfo("counts", "value", "bigint", None, 60_000),
                StateMetaInfo("seen", "map", "string", "bigint")],
        shared={"000012.sst": StreamHandle(path, 120, "0123456789abcdef")},
        private={"MANIFEST": StreamHandle("chk-3/sub-0/MANIFEST", 7, "fedcba9876543210")},
        full_size=127, incremental_size=7, properties={"db": "rocks"},
    )
    return CheckpointMetadata(
        checkpoint_id=3, timestamp_ms=1_700_000_000_000, backend="rocksdb", parallelism=2,
        max_parallelism=128, key_types=["bigint", "string"], handles=[handle],
        kind=SnapshotKind.SAVEPOINT, format=SnapshotFormat.CANONICAL,
        properties={"batch_id": "41"},
    )


def envelope(body: bytes, version: int = 1, checksum: str | None = None) -> bytes:
    """A ``_metadata`` file around ``body``, with a valid checksum unless one is given."""
    head = json.dumps({"format_version": version,
                       "checksum": checksum or content_checksum(body)}).encode()
    return head[:-1] + b', "body": ' + body + b"}"


def body_of(metadata: CheckpointMetadata) -> bytes:
    return msgspec.json.encode(metadata)


def test_roundtrip() -> None:
    metadata = sample_metadata()
    assert deserialize_metadata(serialize_metadata(metadata)) == metadata


@settings(max_examples=budget(50), deadline=None)
@given(
    checkpoint_id=st.integers(1, 2**40),
    names=st.lists(st.text("abc.-_0123456789", min_size=1, max_size=8), max_size=4),
    properties=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
)
def test_roundtrip_any(checkpoint_id: int, names: list[str],
                       properties: dict[str, str]) -> None:
    shared = {n: StreamHandle(f"shared/{n}x", len(n), content_checksum(n.encode()))
              for n in names}
    handle = KeyedStateHandle("heap", 0, 0, 127, checkpoint_id, [], shared, {}, 1, 1)
    metadata = CheckpointMetadata(checkpoint_id, 0, "heap", 1, 128, [], [handle],
                                  properties=properties)
    assert deserialize_metadata(serialize_metadata(metadata)) == metadata


@pytest.mark.parametrize("cut", [0, 1, 10, 40, -40, -2, -1])
def test_truncated_is_corrupt(cut: int) -> None:
    data = serialize_metadata(sample_metadata())
    with pytest.raises(CorruptCheckpointError, match="chk-3/_metadata"):
        deserialize_metadata(data[:cut], source="chk-3/_metadata")


def test_empty_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        deserialize_metadata(b"", source="chk-3/_metadata")


def test_every_flipped_body_byte_is_detected() -> None:
    data = serialize_metadata(sample_metadata())
    start = data.index(b'"body":') + len(b'"body":')
    for position in range(start, len(data) - 1):
        flipped = bytearray(data)
        flipped[position] ^= 0x01
        with pytest.raises(CorruptCheckpointError):
            deserialize_metadata(bytes(flipped), source="chk-3/_metadata")


def test_flipped_checksum_is_detected() -> None:
    data = serialize_metadata(sample_metadata())
    position = data.index(b'"checksum":"') + len(b'"checksum":"')
    flipped = bytearray(data)
    flipped[position] = ord("0") if flipped[position] != ord("0") else ord("1")
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        deserialize_metadata(bytes(flipped))


@pytest.mark.parametrize("version", [0, 4, 99])
def test_unknown_format_version(version: int) -> None:
    data = envelope(body_of(sample_metadata()), version=version)
    with pytest.raises(UnsupportedFormatVersionError, match=f"format_version {version}.*upgrade"):
        deserialize_metadata(data, source="chk-3/_metadata")


def test_valid_checksum_invalid_body_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError, match="invalid body"):
        deserialize_metadata(envelope(b'{"checkpoint_id": "three"}'))


@pytest.mark.parametrize("path", ["../x", "shared/../../x", "/etc/passwd", "\\\\server\\x",
                                  "s3://bucket/x", "c:/x", "shared/./x", "shared//x", ""])
def test_crafted_unsafe_path_is_refused(path: str) -> None:
    # The checksum is valid: only the path check stands between this file and the restore.
    body = body_of(sample_metadata()).replace(b"shared/chk-3-sub-0-abc-000012.sst",
                                              json.dumps(path).encode()[1:-1])
    with pytest.raises(UnsafePathError, match="chk-3/_metadata") as info:
        deserialize_metadata(envelope(body), source="chk-3/_metadata")
    assert "outside its snapshot directory" in str(info.value)


@pytest.mark.parametrize("path", ["../x", "/abs", "a/../b", "a\\b", "http://x/y"])
def test_stream_handle_refuses_unsafe_path(path: str) -> None:
    with pytest.raises(UnsafePathError):
        StreamHandle(path, 1, "00")
    with pytest.raises(UnsafePathError):
        check_relative_path(path)


def test_shared_file_names_carry_their_checkpoint() -> None:
    assert shared_file_prefix(7) == "shared/chk-7-"
    assert checkpoint_id_of_shared_file("shared/chk-7-sub-0-abc-1.sst") == 7
    assert checkpoint_id_of_shared_file("shared/chk-70-sub-0-abc-1.sst") == 70
    assert checkpoint_id_of_shared_file("shared/abc-1.sst") is None
    assert checkpoint_id_of_shared_file("chk-7/sub-0/meta") is None
