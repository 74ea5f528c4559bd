"""Keys: the canonical encoding, and key -> key group with a hash Spark computes identically.

**Key group.** ``key_group = pmod(xxhash64(k1, ..., kn, seed=42), max_parallelism)``, exactly
Spark SQL's ``pmod(xxhash64(col1, ..., coln), maxP)``: each column is hashed with XXH64, the
hash of one column being the seed of the next (Spark's ``XxHash64`` expression), nulls leave
the seed unchanged. Per column, as Spark hashes it:

============================  =================================================================
type                          bytes hashed (little-endian)
============================  =================================================================
boolean, tinyint..int, date   4-byte int (true = 1, date = days since 1970-01-01)
bigint, timestamp             8-byte long (timestamp = microseconds since the epoch, UTC)
float / double                IEEE bits as int / long (-0.0 hashed as 0.0)
string / binary               the UTF-8 bytes / the bytes
decimal(p <= 18, s)           the unscaled value as an 8-byte long
decimal(p > 18, s)            Java ``BigInteger.toByteArray()`` of the unscaled value
============================  =================================================================

So the Spark runtime routes rows with a pure JVM expression (no Python UDF), and this module
computes the same key group in any process on any machine. Python's salted ``hash()`` is never
used. ``tests/test_keys_spark.py`` proves the identity against Spark itself.

**Stored key bytes.** MessagePack of the key's plain-value form (a scalar for one column, an
array for several): deterministic, compact, and decodable back to typed values.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import struct
from typing import Any, Callable, Sequence

import msgspec
import pyarrow as pa
import xxhash

from keyedstate.errors import SerializationError
from keyedstate.serde import TypeLike, converters, parse_type

SPARK_HASH_SEED = 42
_MASK64 = (1 << 64) - 1
_xxh = xxhash.xxh64_intdigest
_pack_i = struct.Struct("<i").pack
_pack_q = struct.Struct("<q").pack
_pack_f = struct.Struct("<f").pack
_pack_d = struct.Struct("<d").pack

HashBytes = Callable[[Any], bytes]

# Hashers take the *plain* (already type-checked) form of a value: ints for dates (days),
# timestamps (microseconds) and decimals (unscaled), see keyedstate.serde.converters.


def _int_bytes(v: Any) -> bytes:
    return _pack_i(v)


def _long_bytes(v: Any) -> bytes:
    return _pack_q(v)


def _bool_bytes(v: Any) -> bytes:
    return _pack_i(1 if v else 0)


def _float_bytes(v: Any) -> bytes:
    return _pack_f(0.0 if v == 0.0 else v)


def _double_bytes(v: Any) -> bytes:
    return _pack_d(0.0 if v == 0.0 else v)


def _string_bytes(v: Any) -> bytes:
    return v.encode("utf-8")


def _binary_bytes(v: Any) -> bytes:
    return v


def _java_big_integer_bytes(n: Any) -> bytes:
    """``java.math.BigInteger.toByteArray()``: minimal big-endian two's complement."""
    n = int(n)
    length = (n + (n < 0)).bit_length() // 8 + 1
    return n.to_bytes(length, "big", signed=True)


def _hash_bytes_for(type_: pa.DataType) -> HashBytes:
    if pa.types.is_boolean(type_):
        return _bool_bytes
    if pa.types.is_integer(type_):
        if type_.bit_width == 64:
            return _long_bytes
        return _int_bytes
    if pa.types.is_float32(type_):
        return _float_bytes
    if pa.types.is_float64(type_):
        return _double_bytes
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return _string_bytes
    if pa.types.is_binary(type_) or pa.types.is_large_binary(type_):
        return _binary_bytes
    if pa.types.is_date32(type_):
        return _int_bytes
    if pa.types.is_timestamp(type_):
        return _long_bytes
    if pa.types.is_decimal(type_):
        return _long_bytes if type_.precision <= 18 else _java_big_integer_bytes
    raise SerializationError(
        f"type {type_} cannot be a key: use boolean, integer, float, string, binary, date, "
        f"timestamp or decimal columns"
    )


def spark_xxhash64(values: Sequence[Any], hashers: Sequence[HashBytes]) -> int:
    """Spark's ``xxhash64(col1, ..., coln)`` (seed 42) as a signed 64-bit int, over the
    plain forms of the column values."""
    h = SPARK_HASH_SEED
    for value, to_bytes in zip(values, hashers):
        if value is not None:
            h = _xxh(to_bytes(value), h & _MASK64)
    return h - (1 << 64) if h >= 1 << 63 else h


def _infer_type(value: Any) -> pa.DataType:
    # Without a declared schema a Python int is Spark's bigint, as pyspark infers it.
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int):
        return pa.int64()
    if isinstance(value, float):
        return pa.float64()
    if isinstance(value, str):
        return pa.string()
    if isinstance(value, (bytes, bytearray)):
        return pa.binary()
    if isinstance(value, _dt.datetime):
        return pa.timestamp("us", tz="UTC")
    if isinstance(value, _dt.date):
        return pa.date32()
    if isinstance(value, decimal.Decimal):
        raise SerializationError("a decimal key needs a declared type, e.g. 'decimal(10,2)'")
    raise SerializationError(
        f"key value {value!r} of type {type(value).__name__} cannot be a key; declare the key "
        f"types or use boolean, int, float, str, bytes, date, datetime or Decimal"
    )


class KeySerializer:
    """Encodes keys of one job and assigns them to key groups. Pickles (sent to executors).

    ``types`` declares the key columns (Spark DDL strings or pyarrow types); a single-column key
    is passed as a scalar, a composite key as a tuple. Without ``types`` the column types are
    inferred from the first key seen (Python int -> bigint) and fixed from then on.
    """

    _encoder = msgspec.msgpack.Encoder()

    def __init__(self, types: Sequence[TypeLike] | None = None) -> None:
        self.arrow_types: list[pa.DataType] | None = None
        if types is not None:
            self._set_types([parse_type(t) for t in types])

    def _set_types(self, arrow_types: list[pa.DataType]) -> None:
        if not arrow_types:
            raise SerializationError("a key needs at least one column")
        self.arrow_types = arrow_types
        self._hashers = [_hash_bytes_for(t) for t in arrow_types]
        convs = [converters(t) for t in arrow_types]
        self._encs = [c[0] for c in convs]
        self._decs = [c[1] for c in convs]
        self._single = len(arrow_types) == 1

    @property
    def type_strings(self) -> list[str]:
        """The key column types, for snapshot metadata (empty while not yet inferred)."""
        return [str(t) for t in self.arrow_types or []]

    def _columns(self, key: Any) -> Sequence[Any]:
        if self.arrow_types is None:
            cols = key if isinstance(key, tuple) else (key,)
            self._set_types([_infer_type(v) for v in cols])
        if self._single:
            if isinstance(key, tuple):
                if len(key) != 1:
                    raise SerializationError(f"key {key!r} has {len(key)} columns, expected 1")
                return key
            return (key,)
        if not isinstance(key, tuple) or len(key) != len(self._encs):
            raise SerializationError(
                f"key {key!r} must be a tuple of {len(self._encs)} columns ({self.type_strings})"
            )
        return key

    def _plain(self, key: Any) -> list[Any]:
        # The converters check each column against its type (SerializationError otherwise).
        columns = self._columns(key)  # first: it fixes inferred types
        return [e(v) for e, v in zip(self._encs, columns)]

    def key_group(self, key: Any, max_parallelism: int) -> int:
        """``pmod(xxhash64(key columns), max_parallelism)``, identical to Spark's; raises
        :class:`SerializationError` for a key that doesn't match the key types."""
        return spark_xxhash64(self._plain(key), self._hashers) % max_parallelism

    def serialize(self, key: Any) -> bytes:
        """The canonical stored form of ``key``; raises :class:`SerializationError` on a type
        mismatch."""
        if self.arrow_types is not None and self._single and not isinstance(key, tuple):
            # A scalar key of a one-column key with known types: serialize_many's bytes,
            # without the column list (a per-key ``set_current_key`` calls this).
            return self._encoder.encode(self._encs[0](key))
        return self._encode(self._plain(key))

    def serialize_with_key_group(self, key: Any, max_parallelism: int) -> tuple[bytes, int]:
        """:meth:`serialize` and :meth:`key_group` in one pass."""
        plain = self._plain(key)
        return self._encode(plain), spark_xxhash64(plain, self._hashers) % max_parallelism

    def serialize_many(self, keys: Sequence[Any]) -> list[bytes]:
        """:meth:`serialize` of each of ``keys`` (the same bytes; one loop without a method
        call per key, for the bulk state calls' keys)."""
        if not keys:
            return []
        self._columns(keys[0])  # fixes inferred types
        encode = self._encoder.encode
        if self._single and not isinstance(keys[0], tuple):
            enc = self._encs[0]
            # A tuple among scalars goes through the checked path (a 1-tuple is a scalar key).
            return [encode(enc(k)) if not isinstance(k, tuple) else self.serialize(k)
                    for k in keys]
        plain, enc_ = self._plain, self._encode
        return [enc_(plain(k)) for k in keys]

    def _encode(self, plain: list[Any]) -> bytes:
        return self._encoder.encode(plain[0] if self._single else plain)

    def deserialize(self, data: bytes) -> Any:
        """The key that :meth:`serialize` turned into ``data`` (a scalar or a tuple)."""
        if self.arrow_types is None:
            raise SerializationError("key types are unknown: nothing was serialized yet")
        try:
            plain = msgspec.msgpack.decode(data)
            if self._single:
                return self._decs[0](plain)
            if not isinstance(plain, list) or len(plain) != len(self._decs):
                raise ValueError(f"expected {len(self._decs)} columns")
            return tuple(d(v) for d, v in zip(self._decs, plain))
        except (msgspec.DecodeError, TypeError, ValueError, ArithmeticError) as exc:
            raise SerializationError(
                f"stored key bytes are not a key of types {self.type_strings}: {exc}"
            ) from exc

    def __reduce__(self) -> tuple[Any, ...]:
        return (KeySerializer, (self.arrow_types,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeySerializer) and other.arrow_types == self.arrow_types

    def __repr__(self) -> str:
        return f"KeySerializer({self.type_strings})"
