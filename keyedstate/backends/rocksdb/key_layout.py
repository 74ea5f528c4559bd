"""The RocksDB key and value layout: the one home of the bytes every state and timer entry is
made of; the keyed backend, the states and the timers build and parse them here.

Key layout (Flink's ``CompositeKeySerializationUtils``, with varint lengths)::

    [key group: 1 byte if max parallelism <= 128, else 2, big-endian]
    [varint len][key bytes]            the canonical key (KeySerializer)
    [varint len][namespace bytes]      serialize_namespace (None -> VOID_NAMESPACE)
    [user key bytes]                   map states: the map key (user_key_serializer)
    [8-byte big-endian sequence]       list states: one entry per element

The key group comes first, so a key-group range is one contiguous key range of every column
family (clip and ingest on rescale, timers' order). The lengths make the prefix of one key and
namespace unambiguous, so a list or a map is one prefix scan.

Values are the descriptor's ``value_serializer`` bytes; under TTL they are prefixed with the
8-byte big-endian last-access timestamp (ms), per value, map entry and list element.

A list element's sequence number comes from one counter per keyed backend that only grows, and
is recorded in every snapshot and restored as the maximum over the restored handles, so
insertion order survives restore and rescaling and ``add`` is a single put.

Timer keys (value empty), in ``_timers_event`` and ``_timers_proc``::

    [key group][timestamp: 8 bytes big-endian, sign bit flipped][varint len][key][namespace]

Flipping the sign bit makes the unsigned byte order of the timestamp its numeric order, negative
timestamps included; the key group comes first, as for state.
"""

from __future__ import annotations

import struct

from keyedstate.state.timers import Timer

#: a TTL value's 8-byte big-endian last-access timestamp (ms)
TIMESTAMP = struct.Struct(">q")
#: a list element's 8-byte big-endian sequence number
SEQUENCE = struct.Struct(">Q")
_pack_ts = TIMESTAMP.pack
_unpack_ts = TIMESTAMP.unpack_from
TS_BYTES = 8
SEQ_BYTES = 8

# --------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------


def unpack_timestamp(raw: bytes) -> int:
    """The last-access timestamp (ms) a TTL value starts with."""
    return int(_unpack_ts(raw)[0])


def pack_timestamp(timestamp_ms: int) -> bytes:
    """The 8-byte prefix of a TTL value (its last-access timestamp, ms)."""
    return _pack_ts(timestamp_ms)


# --------------------------------------------------------------------------------------------
# state keys
# --------------------------------------------------------------------------------------------


#: ``varint(n)`` for every ``n`` below 128, built once: most keys and namespaces are that short,
#: and a tuple lookup costs less than building the byte (the key prefix is built per key).
SHORT_VARINTS = tuple(bytes((n,)) for n in range(0x80))


def varint(n: int) -> bytes:
    """Unsigned LEB128: one byte below 128, as most keys and namespaces are."""
    if n < 0x80:
        return SHORT_VARINTS[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """``(value, position after it)``."""
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def length_prefixed(data: bytes) -> bytes:
    """``[varint len][data]``: how a key and a namespace are written."""
    n = len(data)
    return (SHORT_VARINTS[n] if n < 0x80 else varint(n)) + data


def read_length_prefixed(raw: bytes, pos: int) -> tuple[bytes, int]:
    """``(data, position after it)`` of a :func:`length_prefixed` part starting at ``pos``."""
    n, pos = read_varint(raw, pos)
    return raw[pos:pos + n], pos + n


def key_group_of(raw: bytes, key_group_prefix_bytes: int) -> int:
    """The key group a stored state or timer key starts with."""
    return int.from_bytes(raw[:key_group_prefix_bytes], "big")


def key_prefix(key_group_bytes: bytes, key_bytes: bytes) -> bytes:
    """``[key group][varint len][key]``: the part every state shares for one key, built on every
    key change (:func:`length_prefixed`, inlined: this is the per-key path)."""
    n = len(key_bytes)
    return key_group_bytes + (SHORT_VARINTS[n] if n < 0x80 else varint(n)) + key_bytes


def namespace_part(namespace_bytes: bytes) -> bytes:
    """``[varint len][namespace]``, what follows the key prefix."""
    return length_prefixed(namespace_bytes)


def state_key(key_group_bytes: bytes, key_bytes: bytes, namespace_bytes: bytes) -> bytes:
    """``[key group][varint len][key][varint len][namespace]``: a value, reducing or
    aggregating state's whole key, and the prefix of a list element's or a map entry's."""
    return key_prefix(key_group_bytes, key_bytes) + length_prefixed(namespace_bytes)


def split_state_key(raw: bytes, key_group_prefix_bytes: int) -> tuple[int, bytes, bytes, bytes]:
    """``(key group, key bytes, namespace bytes, rest)`` of a stored state key."""
    key, pos = read_length_prefixed(raw, key_group_prefix_bytes)
    namespace, pos = read_length_prefixed(raw, pos)
    return key_group_of(raw, key_group_prefix_bytes), key, namespace, raw[pos:]


# --------------------------------------------------------------------------------------------
# timer keys
# --------------------------------------------------------------------------------------------

_U64 = struct.Struct(">Q")
_SIGN = 1 << 63


def timestamp_bytes(timestamp: int) -> bytes:
    """The timestamp, sign bit flipped, big-endian: byte order equals numeric order."""
    return _U64.pack(timestamp + _SIGN)


def timer_key(key_group_bytes: bytes, timestamp: int, key_bytes: bytes,
              namespace_bytes: bytes) -> bytes:
    """``[key group][timestamp, sign bit flipped][varint len][key][namespace]``."""
    return key_group_bytes + timestamp_bytes(timestamp) + length_prefixed(key_bytes) \
        + namespace_bytes


def parse_timer_key(raw: bytes, key_group_prefix_bytes: int) -> Timer:
    n = key_group_prefix_bytes
    timestamp = _U64.unpack_from(raw, n)[0] - _SIGN
    key, pos = read_length_prefixed(raw, n + 8)
    return Timer(timestamp, key_group_of(raw, n), key, raw[pos:])
