"""Value types and serializers: Spark DDL strings or pyarrow types, with pickle as the fallback.

A typed state stores its values as MessagePack of a plain-value form of the declared type
(dates as days, timestamps as microseconds, decimals as unscaled integers, structs as lists in
field order). That form is compact, identical across processes and Python versions, checked
against the type on every write, and maps one-to-one to an Arrow column for canonical savepoints
and the state processor API. The untyped fallback pickles values; pickled bytes are only ever
read back from storage the job itself wrote (pickle executes code when it loads).
"""

from __future__ import annotations

import datetime as _dt
import decimal
import pickle
import re
from abc import ABC, abstractmethod
from typing import Any, Callable, TypeAlias

import msgspec
import pyarrow as pa

from keyedstate.errors import OutputSchemaError, SerializationError

EPOCH_DATE = _dt.date(1970, 1, 1)
EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
_ONE_US = _dt.timedelta(microseconds=1)

TypeLike: TypeAlias = str | pa.DataType

# --------------------------------------------------------------------------------------------
# Spark DDL -> pyarrow
# --------------------------------------------------------------------------------------------

_SIMPLE_DDL: dict[str, pa.DataType] = {
    "boolean": pa.bool_(), "bool": pa.bool_(),
    "tinyint": pa.int8(), "byte": pa.int8(),
    "smallint": pa.int16(), "short": pa.int16(),
    "int": pa.int32(), "integer": pa.int32(),
    "bigint": pa.int64(), "long": pa.int64(),
    "float": pa.float32(), "real": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(), "varchar": pa.string(), "char": pa.string(),
    "binary": pa.binary(),
    "date": pa.date32(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "timestamp_ltz": pa.timestamp("us", tz="UTC"),
    "timestamp_ntz": pa.timestamp("us"),
}

_TOKEN = re.compile(r"\s*(<|>|\(|\)|,|:|`[^`]*`|[A-Za-z_][A-Za-z0-9_]*|\d+)")


class _DDLParser:
    """A small recursive-descent parser for the Spark SQL type grammar keyedstate needs."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[str] = []
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            m = _TOKEN.match(text, pos)
            if not m:
                raise SerializationError(f"cannot parse type {text!r} at position {pos}")
            self.tokens.append(m.group(1))
            pos = m.end()
        self.i = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok.lower() != expected):
            raise SerializationError(
                f"cannot parse type {self.text!r}: expected {expected or 'a token'}, got {tok!r}"
            )
        self.i += 1
        return tok

    def name(self) -> str:
        tok = self.take()
        return tok[1:-1] if tok.startswith("`") else tok

    def type_(self) -> pa.DataType:
        word = self.take().lower()
        if word == "array":
            self.take("<")
            item = self.type_()
            self.take(">")
            return pa.list_(item)
        if word == "map":
            self.take("<")
            key = self.type_()
            self.take(",")
            value = self.type_()
            self.take(">")
            return pa.map_(key, value)
        if word == "struct":
            self.take("<")
            fields = []
            while self.peek() != ">":
                fname = self.name()
                if self.peek() == ":":
                    self.take(":")
                fields.append(pa.field(fname, self.type_()))
                if self.peek() == ",":
                    self.take(",")
            self.take(">")
            return pa.struct(fields)
        if word in ("decimal", "dec", "numeric"):
            precision, scale = 10, 0
            if self.peek() == "(":
                self.take("(")
                precision = int(self.take())
                if self.peek() == ",":
                    self.take(",")
                    scale = int(self.take())
                self.take(")")
            return pa.decimal128(precision, scale)
        if word in ("varchar", "char") and self.peek() == "(":
            self.take("(")
            self.take()
            self.take(")")
        if word in _SIMPLE_DDL:
            return _SIMPLE_DDL[word]
        raise SerializationError(f"unknown type {word!r} in {self.text!r}")

    def parse(self) -> pa.DataType:
        # "a BIGINT, b STRING" (a schema) becomes a struct; a lone type stays itself.
        start = self.i
        if len(self.tokens) >= 2 and self.tokens[1] not in ("<", "(") and (
            self.tokens[0].lower() not in _SIMPLE_DDL or self.tokens[1].lower() in _ALL_WORDS
        ):
            fields = []
            while self.peek() is not None:
                fname = self.name()
                if self.peek() == ":":
                    self.take(":")
                fields.append(pa.field(fname, self.type_()))
                if self.peek() == ",":
                    self.take(",")
            return pa.struct(fields)
        self.i = start
        result = self.type_()
        if self.peek() is not None:
            raise SerializationError(f"unexpected {self.peek()!r} after the type in {self.text!r}")
        return result


_ALL_WORDS = set(_SIMPLE_DDL) | {"array", "map", "struct", "decimal", "dec", "numeric"}


def parse_type(spec: TypeLike) -> pa.DataType:
    """A pyarrow type from a Spark DDL string (``"bigint"``, ``"a INT, b STRING"``) or itself."""
    if isinstance(spec, pa.DataType):
        return spec
    if isinstance(spec, str):
        return _DDLParser(spec).parse()
    raise SerializationError(f"a type must be a Spark DDL string or a pyarrow type, got {spec!r}")


# --------------------------------------------------------------------------------------------
# plain-value converters, one pair per Arrow type
# --------------------------------------------------------------------------------------------

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]

_INT_BOUNDS = {8: 1 << 7, 16: 1 << 15, 32: 1 << 31, 64: 1 << 63}
_I64 = 1 << 63
# Spark decimals have up to 38 digits; the default context (28) would round or refuse them.
_DECIMAL_CONTEXT = decimal.Context(prec=80, traps=[decimal.InvalidOperation])


def to_arrow_schema(spec: TypeLike | pa.Schema | Any) -> pa.Schema:
    """A pyarrow schema from a DDL string ("a string, b bigint"), a struct type, a pyarrow
    schema or a Spark StructType."""
    if isinstance(spec, pa.Schema):
        return spec
    if hasattr(spec, "simpleString") and hasattr(spec, "fields"):  # Spark StructType
        spec = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in spec.fields)
    arrow = parse_type(spec)
    if not pa.types.is_struct(arrow):
        raise OutputSchemaError(f"an output schema needs named columns, got {spec!r}")
    return pa.schema([arrow.field(i) for i in range(arrow.num_fields)])


#: pyarrow type -> the name Spark's ``DataType.simpleString()`` gives it
_SPARK_NAMES: dict[pa.DataType, str] = {
    pa.bool_(): "boolean", pa.int8(): "tinyint", pa.int16(): "smallint", pa.int32(): "int",
    pa.int64(): "bigint", pa.float32(): "float", pa.float64(): "double",
    pa.string(): "string", pa.large_string(): "string", pa.binary(): "binary",
    pa.large_binary(): "binary", pa.date32(): "date",
}


def type_ddl(type_: pa.DataType) -> str:
    """The Spark DDL of a key column's pyarrow type, spelled as Spark's ``simpleString()``
    spells it (``bigint``, ``timestamp``, ``decimal(10,2)``), so that a job keyed by a
    pyarrow table records the same key types as the same job on Spark; other types as
    pyarrow prints them."""
    if pa.types.is_timestamp(type_):
        return "timestamp" if type_.tz else "timestamp_ntz"
    if pa.types.is_decimal(type_):
        return f"decimal({type_.precision},{type_.scale})"
    return _SPARK_NAMES.get(type_, str(type_))


def _fail(value: Any, type_: pa.DataType) -> SerializationError:
    return SerializationError(f"value {value!r} ({type(value).__name__}) does not match type {type_}")


def converters(type_: pa.DataType) -> tuple[Encode, Decode]:
    """``(encode, decode)`` between Python values of ``type_`` and their plain-value form.

    ``encode`` checks the value against the type and raises :class:`SerializationError`;
    ``None`` is allowed everywhere (a null).
    """
    if pa.types.is_boolean(type_):
        def enc(v: Any) -> Any:
            if v is None or type(v) is bool:
                return v
            raise _fail(v, type_)
        return enc, _identity
    if pa.types.is_integer(type_):
        bound = _INT_BOUNDS[type_.bit_width]
        lo, hi = (-bound, bound) if pa.types.is_signed_integer(type_) else (0, 2 * bound)

        def enc(v: Any) -> Any:
            if v is None:
                return None
            if type(v) is not int:
                if isinstance(v, bool) or not hasattr(v, "__index__"):
                    raise _fail(v, type_)
                v = int(v)  # numpy integers
            if not lo <= v < hi:
                raise _fail(v, type_)
            return v
        return enc, _identity
    if pa.types.is_floating(type_):
        def enc(v: Any) -> Any:
            if v is None or type(v) is float:
                return v
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                try:
                    return float(v)
                except OverflowError:
                    raise _fail(v, type_) from None
            raise _fail(v, type_)
        return enc, _identity
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        def enc(v: Any) -> Any:
            if v is None or type(v) is str:
                return v
            raise _fail(v, type_)
        return enc, _identity
    if pa.types.is_binary(type_) or pa.types.is_large_binary(type_):
        def enc(v: Any) -> Any:
            if v is None or type(v) is bytes:
                return v
            if isinstance(v, (bytearray, memoryview)):
                return bytes(v)
            raise _fail(v, type_)
        return enc, _identity
    if pa.types.is_date32(type_):
        def enc(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, _dt.date) and not isinstance(v, _dt.datetime):
                return (v - EPOCH_DATE).days
            raise _fail(v, type_)
        return enc, lambda v: None if v is None else EPOCH_DATE + _dt.timedelta(days=v)
    if pa.types.is_timestamp(type_):
        aware = type_.tz is not None

        def enc(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, _dt.datetime):
                return datetime_to_micros(v)
            raise _fail(v, type_)

        def dec(v: Any) -> Any:
            if v is None:
                return None
            ts = micros_to_datetime(v)
            return ts if aware else ts.replace(tzinfo=None)
        return enc, dec
    if pa.types.is_decimal(type_):
        scale = type_.scale
        quantum = decimal.Decimal(1).scaleb(-scale)
        limit = 10 ** type_.precision

        def enc(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, (decimal.Decimal, int)) and not isinstance(v, bool):
                d = decimal.Decimal(v)
                if d.is_finite():
                    try:
                        unscaled = int(d.quantize(quantum, context=_DECIMAL_CONTEXT)
                                       .scaleb(scale, context=_DECIMAL_CONTEXT))
                    except decimal.InvalidOperation:
                        raise _fail(v, type_) from None
                    if abs(unscaled) < limit:
                        # MessagePack integers are 64-bit: wider ones are kept as digits.
                        return unscaled if -_I64 <= unscaled < _I64 else str(unscaled)
            raise _fail(v, type_)
        return enc, lambda v: None if v is None else decimal.Decimal(int(v)).scaleb(
            -scale, context=_DECIMAL_CONTEXT)
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        item_enc, item_dec = converters(type_.value_type)

        def enc(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, (list, tuple)):
                return [item_enc(x) for x in v]
            raise _fail(v, type_)
        return enc, lambda v: None if v is None else [item_dec(x) for x in v]
    if pa.types.is_map(type_):
        k_enc, k_dec = converters(type_.key_type)
        i_enc, i_dec = converters(type_.item_type)

        def enc(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, dict):
                return [[k_enc(k), i_enc(x)] for k, x in v.items()]
            raise _fail(v, type_)
        return enc, lambda v: None if v is None else {k_dec(k): i_dec(x) for k, x in v}
    if pa.types.is_struct(type_):
        names = [type_.field(i).name for i in range(type_.num_fields)]
        pairs = [converters(type_.field(i).type) for i in range(type_.num_fields)]

        def enc(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, dict):
                if set(v) - set(names):
                    raise SerializationError(
                        f"fields {sorted(set(v) - set(names))} are not in type {type_}"
                    )
                return [e(v.get(n)) for n, (e, _) in zip(names, pairs)]
            if isinstance(v, (tuple, list)) and len(v) == len(names):
                return [e(x) for x, (e, _) in zip(v, pairs)]
            raise _fail(v, type_)

        def dec(v: Any) -> Any:
            if v is None:
                return None
            return {n: d(x) for n, x, (_, d) in zip(names, v, pairs)}
        return enc, dec
    raise SerializationError(f"type {type_} is not supported for state values")


def _identity(v: Any) -> Any:
    return v


def datetime_to_micros(v: _dt.datetime) -> int:
    """Microseconds since the epoch; a naive datetime is taken as UTC (as Spark's sessions here)."""
    if v.tzinfo is None:
        v = v.replace(tzinfo=_dt.timezone.utc)
    delta = v - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def micros_to_datetime(us: int) -> _dt.datetime:
    return EPOCH + _dt.timedelta(microseconds=us)


# --------------------------------------------------------------------------------------------
# serializers
# --------------------------------------------------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()
_decode = msgspec.msgpack.decode


class TypeSerializer(ABC):
    """Turns values of one declared type into bytes and back. Must pickle (sent to executors)."""

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


def serializer_for(type_: TypeLike | None) -> TypeSerializer:
    """An :class:`ArrowTypeSerializer` for a declared type, a :class:`PickleSerializer` for None."""
    return PickleSerializer() if type_ is None else ArrowTypeSerializer(type_)


# --------------------------------------------------------------------------------------------
# type strings (what snapshots before format version 3 record)
# --------------------------------------------------------------------------------------------

_SIMPLE_ARROW = {
    "bool": pa.bool_(), "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(),
    "int64": pa.int64(), "uint8": pa.uint8(), "uint16": pa.uint16(), "uint32": pa.uint32(),
    "uint64": pa.uint64(), "halffloat": pa.float16(), "float": pa.float32(),
    "double": pa.float64(), "string": pa.string(), "large_string": pa.large_string(),
    "binary": pa.binary(), "large_binary": pa.large_binary(),
}
_WORD = re.compile(r"[a-z_0-9]+")


class _ArrowTypeParser:
    """Parses what ``str(pyarrow type)`` prints, for the types state values can have."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def _expect(self, literal: str) -> None:
        if not self.text.startswith(literal, self.i):
            raise ValueError(f"expected {literal!r} at position {self.i}")
        self.i += len(literal)

    def _peek(self, literal: str) -> bool:
        return self.text.startswith(literal, self.i)

    def _word(self) -> str:
        m = _WORD.match(self.text, self.i)
        if not m:
            raise ValueError(f"expected a name at position {self.i}")
        self.i = m.end()
        return m.group(0)

    def _field(self) -> pa.Field:
        end = self.text.find(": ", self.i)
        if end < 0:
            raise ValueError(f"expected a field at position {self.i}")
        name = self.text[self.i:end]
        self.i = end + 2
        type_ = self.type_()
        nullable = True
        if self._peek(" not null"):
            self.i += len(" not null")
            nullable = False
        return pa.field(name, type_, nullable)

    def type_(self) -> pa.DataType:
        word = self._word()
        if word in ("list", "large_list"):
            self._expect("<")
            field = self._field()
            self._expect(">")
            return pa.list_(field) if word == "list" else pa.large_list(field)
        if word == "struct":
            self._expect("<")
            fields: list[pa.Field] = []
            while not self._peek(">"):
                if fields:
                    self._expect(", ")
                fields.append(self._field())
            self._expect(">")
            return pa.struct(fields)
        if word == "map":
            self._expect("<")
            key = self.type_()
            self._expect(", ")
            item = self.type_()
            keys_sorted = self._peek(", keys_sorted")
            if keys_sorted:
                self.i += len(", keys_sorted")
            self._expect(">")
            return pa.map_(key, item, keys_sorted=keys_sorted)
        if word == "timestamp":
            self._expect("[")
            unit = self._word()
            tz = None
            if self._peek(", tz="):
                self.i += len(", tz=")
                end = self.text.index("]", self.i)
                tz, self.i = self.text[self.i:end], end
            self._expect("]")
            return pa.timestamp(unit, tz=tz)
        if word == "date32":
            self._expect("[day]")
            return pa.date32()
        if word in ("decimal128", "decimal256"):
            self._expect("(")
            precision = int(self._word())
            self._expect(", ")
            negative = self._peek("-")
            self.i += negative
            scale = int(self._word()) * (-1 if negative else 1)
            self._expect(")")
            return pa.decimal128(precision, scale) if word == "decimal128" \
                else pa.decimal256(precision, scale)
        if word in _SIMPLE_ARROW:
            return _SIMPLE_ARROW[word]
        raise ValueError(f"unknown type {word!r}")


def type_from_string(text: str) -> pa.DataType:
    """The Arrow type a snapshot names: a keyedstate type string (``str(pyarrow type)``, e.g.
    ``struct<count: int64, total: double>``) or a Spark DDL string (``bigint``); raises
    :class:`SerializationError` when it is neither."""
    try:
        parser = _ArrowTypeParser(text)
        parsed = parser.type_()
        # Only an exact round trip is trusted (a field name with ", " could mislead the parser).
        if parser.i == len(text) and str(parsed) == text:
            return parsed
    except (ValueError, pa.ArrowException):
        pass
    try:
        return parse_type(text)
    except SerializationError:
        raise SerializationError(
            f"type {text!r} recorded in the snapshot can't be rebuilt; give struct fields names "
            f"without ', ' or ': ' in them"
        ) from None


def serializer_from_string(text: str | None) -> TypeSerializer | None:
    """The serializer a snapshot's type string names (None for no type: not a map state)."""
    if text is None:
        return None
    if text == PickleSerializer.type_string:
        return PickleSerializer()
    serializer = ArrowTypeSerializer(type_from_string(text))
    if serializer.type_string != text:
        raise SerializationError(f"type {text!r} rebuilds as {serializer.type_string}")
    return serializer


# --------------------------------------------------------------------------------------------
# namespaces
# --------------------------------------------------------------------------------------------

#: The stored form of the default namespace (``None``), Flink's ``VoidNamespace``.
VOID_NAMESPACE = _ENCODER.encode(None)


_NAMESPACE_ATOMS = (type(None), bool, int, float, str, bytes)


def _check_namespace(namespace: Any, whole: Any) -> None:
    # Only types MessagePack keeps apart: a date would be encoded like its ISO string and two
    # windows would merge; a set would come back as a tuple.
    if type(namespace) is tuple:
        for part in namespace:
            _check_namespace(part, whole)
    elif type(namespace) not in _NAMESPACE_ATOMS or (
            type(namespace) is int and not -_I64 <= namespace < (1 << 64)):
        raise SerializationError(
            f"namespace {whole!r} must be None, bool, a 64-bit int, float, str, bytes or a tuple "
            f"of them"
        )


def serialize_namespace(namespace: Any) -> bytes:
    """Canonical bytes of a namespace: None, bool, int, float, str, bytes or tuples of them."""
    _check_namespace(namespace, namespace)
    return _ENCODER.encode(namespace)


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def deserialize_namespace(data: bytes) -> Any:
    try:
        return _tuples(_decode(data))
    except msgspec.DecodeError as exc:
        raise SerializationError(f"stored namespace bytes are corrupt: {exc}") from exc
