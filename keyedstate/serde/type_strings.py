"""Type strings: what a snapshot records for a state's types (``str(pyarrow type)``, or a
Spark DDL string before format version 3) and the serializer each names."""

from __future__ import annotations

import re

import pyarrow as pa

from keyedstate.errors import SerializationError
from keyedstate.serde.ddl import parse_type
from keyedstate.serde.serializers import ArrowTypeSerializer, PickleSerializer, TypeSerializer

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

