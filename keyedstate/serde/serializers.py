"""Serializers: :class:`TypeSerializer`, checked MessagePack of a declared type
(:class:`ArrowTypeSerializer`) and the untyped fallback (:class:`PickleSerializer`)."""

from __future__ import annotations

import datetime as _dt
import decimal
import pickle
from abc import ABC, abstractmethod
from typing import Any, Callable

import msgspec
import pyarrow as pa

from keyedstate.errors import SerializationError
from keyedstate.serde.converters import _INT_BOUNDS, _identity, converters
from keyedstate.serde.ddl import TypeLike, parse_type

_ENCODER = msgspec.msgpack.Encoder()
_decode = msgspec.msgpack.decode


# The serializers keep the package as their module: the RocksDB meta file pickles them, and
# its bytes (and what an older keyedstate can read back) stay those of before the split.
_MODULE = "keyedstate.serde"


class TypeSerializer(ABC):
    """Turns values of one declared type into bytes and back. Must pickle (sent to executors)."""

    __module__ = _MODULE

    #: identifies the type in snapshots: restoring checks it against the descriptor's.
    type_string: str

    @abstractmethod
    def serialize(self, value: Any) -> bytes:
        """Bytes for ``value``; raises :class:`SerializationError` if it doesn't fit the type."""

    @abstractmethod
    def deserialize(self, data: bytes) -> Any:
        """The value that :meth:`serialize` turned into ``data``."""

    @abstractmethod
    def to_plain(self, value: Any) -> Any:
        """The checked plain-value form (what MessagePack stores); for Arrow, the Python value."""

    @abstractmethod
    def copy(self, value: Any) -> Any:
        """A checked private copy of ``value``, for backends that keep objects (heap): later
        changes to the caller's object must not reach the state. Immutable values are
        returned as they are."""


class ArrowTypeSerializer(TypeSerializer):
    """Serializer for a declared Arrow / Spark type: checked MessagePack of the plain form."""

    __module__ = _MODULE

    def __init__(self, type_: TypeLike) -> None:
        self.arrow_type = parse_type(type_)
        self.type_string = str(self.arrow_type)
        self._enc, self._dec = converters(self.arrow_type)
        t = self.arrow_type
        self._immutable = not (pa.types.is_list(t) or pa.types.is_large_list(t)
                               or pa.types.is_map(t) or pa.types.is_struct(t))

    def serialize(self, value: Any) -> bytes:
        return _ENCODER.encode(self._enc(value))

    def deserialize(self, data: bytes) -> Any:
        try:
            return self._dec(_decode(data))
        except (msgspec.DecodeError, TypeError, ValueError, ArithmeticError) as exc:
            raise SerializationError(f"stored bytes are not a {self.type_string}: {exc}") from exc

    def to_plain(self, value: Any) -> Any:
        self._enc(value)
        return value

    def copy(self, value: Any) -> Any:
        plain = self._enc(value)
        return value if self._immutable else self._dec(plain)

    def __reduce__(self) -> tuple[Any, ...]:
        # Closures don't pickle; the type rebuilds them.
        return (ArrowTypeSerializer, (self.arrow_type,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArrowTypeSerializer) and other.arrow_type == self.arrow_type

    def __hash__(self) -> int:
        return hash(self.type_string)

    def __repr__(self) -> str:
        return f"ArrowTypeSerializer({self.type_string})"


_IMMUTABLE_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes,
                              decimal.Decimal, _dt.date, _dt.datetime, _dt.timedelta})


class PickleSerializer(TypeSerializer):
    """The untyped fallback. Only for bytes the job itself wrote: unpickling runs code."""

    __module__ = _MODULE

    type_string = "pickle"

    def serialize(self, value: Any) -> bytes:
        try:
            return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # pickle raises many kinds
            raise SerializationError(f"value {value!r} cannot be pickled: {exc}") from exc

    def deserialize(self, data: bytes) -> Any:
        try:
            return pickle.loads(data)
        except Exception as exc:
            raise SerializationError(f"stored bytes cannot be unpickled: {exc}") from exc

    def to_plain(self, value: Any) -> Any:
        return value

    def copy(self, value: Any) -> Any:
        if type(value) in _IMMUTABLE_ATOMS:
            return value
        return self.deserialize(self.serialize(value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PickleSerializer)

    def __hash__(self) -> int:
        return hash(self.type_string)

    def __repr__(self) -> str:
        return "PickleSerializer()"


#: the scalar types whose encoder passes a value of exactly one Python type as it is, by
#: predicate (integers also need their bounds)
_PASSED_AS_IS: tuple[tuple[Callable[[pa.DataType], bool], type], ...] = (
    (pa.types.is_floating, float), (pa.types.is_string, str), (pa.types.is_large_string, str),
    (pa.types.is_binary, bytes), (pa.types.is_large_binary, bytes), (pa.types.is_boolean, bool))


def one_call_codec(serializer: TypeSerializer
                   ) -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]]:
    """``serializer``'s ``serialize`` and ``deserialize`` as functions of one Python call each
    on the common path, for a per-key state access: the same bytes, the same values, the same
    errors (a value off the common path goes through ``serializer.serialize`` itself).

    For an :class:`ArrowTypeSerializer` of an integer, floating, string, binary or boolean
    type, a value of exactly its plain Python type (an int within the type's bounds) is
    MessagePack-encoded directly (its encoder would return it as it is), and stored bytes are
    decoded without the identity decoder's call; any other serializer's own methods."""
    if type(serializer) is not ArrowTypeSerializer or serializer._dec is not _identity:
        return serializer.serialize, serializer.deserialize
    t, slow, encode = serializer.arrow_type, serializer.serialize, _ENCODER.encode
    type_string = serializer.type_string
    ser: Callable[[Any], bytes] = slow
    if pa.types.is_integer(t):
        bound = _INT_BOUNDS[t.bit_width]
        lo, hi = (-bound, bound) if pa.types.is_signed_integer(t) else (0, 2 * bound)

        def ser_int(value: Any) -> bytes:
            if type(value) is int and lo <= value < hi:
                return encode(value)
            return slow(value)

        ser = ser_int
    else:
        exact = next((py for is_type, py in _PASSED_AS_IS if is_type(t)), None)
        if exact is not None:
            def ser_exact(value: Any) -> bytes:
                return encode(value) if type(value) is exact else slow(value)

            ser = ser_exact

    def deser(data: bytes) -> Any:
        try:
            return _decode(data)
        except (msgspec.DecodeError, TypeError, ValueError, ArithmeticError) as exc:
            raise SerializationError(f"stored bytes are not a {type_string}: {exc}") from exc

    return ser, deser


def serializer_for(type_: TypeLike | None) -> TypeSerializer:
    """An :class:`ArrowTypeSerializer` for a declared type, a :class:`PickleSerializer` for None."""
    return PickleSerializer() if type_ is None else ArrowTypeSerializer(type_)

