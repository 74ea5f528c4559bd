"""Spark DDL -> pyarrow: the value types a descriptor or an output schema declares, and
the Spark name of a key column's pyarrow type."""

from __future__ import annotations

import re
from typing import Any, TypeAlias

import pyarrow as pa

from keyedstate.errors import OutputSchemaError, SerializationError

TypeLike: TypeAlias = str | pa.DataType

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
            fields = self.fields(">")
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

    def fields(self, end: str | None) -> list[pa.Field]:
        """``name[:] type`` fields, separated by commas, up to the token ``end`` (None: the
        end of the text), which is left to the caller."""
        fields = []
        while self.peek() != end:
            fname = self.name()
            if self.peek() == ":":
                self.take(":")
            fields.append(pa.field(fname, self.type_()))
            if self.peek() == ",":
                self.take(",")
        return fields

    def parse(self) -> pa.DataType:
        # "a BIGINT, b STRING" (a schema) becomes a struct; a lone type stays itself.
        start = self.i
        if len(self.tokens) >= 2 and self.tokens[1] not in ("<", "(") and (
            self.tokens[0].lower() not in _SIMPLE_DDL or self.tokens[1].lower() in _ALL_WORDS
        ):
            return pa.struct(self.fields(None))
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

