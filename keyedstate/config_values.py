"""Configuration values from their string form, the way Flink's configuration reads them.

A setting of :class:`keyedstate.config.JobConfig` has one type, taken from its field's
annotation, and :func:`value_type` turns that annotation into a :class:`ValueType`: the
parser of both the Python value and the string form (``"false"``, ``"5 min"``, ``"32 mb"``,
``"side_output"``). What doesn't parse is a :class:`ConfigurationError` naming the key, the
value and what the key takes. The rules (docs/configuration.md):

- booleans: ``true`` / ``false``, any case (Flink's ``ConfigurationUtils.convertToBoolean``);
- integers: decimal digits with an optional sign (``Integer.parseInt``);
- byte sizes (:data:`Bytes`): an integer with an optional unit ``b``, ``k``/``kb``,
  ``m``/``mb``, ``g``/``gb``, ``t``/``tb`` (powers of 1024, Flink's ``MemorySize``);
- durations: an integer with an optional unit ``d``, ``h``, ``min``/``m``, ``s``, ``ms``,
  ``µs``/``us``, ``ns`` or their words (``day(s)``, ``hour(s)``, ``minute(s)``,
  ``sec(s)``/``second(s)``, ``milli(s)``/``millisecond(s)``, ...); no unit: milliseconds
  (Flink's ``TimeUtils.parseDuration``);
- enums: a member's value, any case, ``-`` and ``_`` alike;
- lists of names: one string of comma-separated names;
- mappings: a JSON object.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Mapping

from keyedstate.errors import ConfigurationError


class _BytesUnit:
    """Marker of an ``int`` setting that counts bytes (see :data:`Bytes`)."""

    def __repr__(self) -> str:
        return "BYTES"


BYTES = _BytesUnit()
#: An ``int`` of bytes whose string form may carry a unit (``"32 mb"``).
Bytes = Annotated[int, BYTES]


class Invalid(Exception):
    """A value a :class:`ValueType` does not take (turned into a ConfigurationError)."""


@dataclass(frozen=True)
class ValueType:
    """The type of one setting: ``takes`` says in words what it accepts; ``parse`` turns a
    Python value or its string form into the setting's value or raises :class:`Invalid`."""

    takes: str
    parse: Callable[[Any], Any]
    #: the Python type of a parsed value (besides None, where ``optional``)
    python_type: Any = None
    #: None (or an empty string) means unset
    optional: bool = False

    def describe(self, minimum: int | None = None) -> str:
        """What a setting of this type takes, in words."""
        return (self.takes + (f" >= {minimum}" if minimum is not None else "")
                + (", or none (None or an empty string)" if self.optional else ""))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) else None


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(value)
    if text is not None and text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise Invalid


_INT = re.compile(r"[+-]?[0-9]+")


def parse_int(value: Any) -> int:
    if _is_int(value):
        return int(value)
    text = _text(value)
    if text is not None and _INT.fullmatch(text):
        return int(text)
    raise Invalid


_MEMORY_UNITS = {unit: 1024 ** power for power, names in enumerate(
    [("b", "bytes"), ("k", "kb", "kibibytes"), ("m", "mb", "mebibytes"),
     ("g", "gb", "gibibytes"), ("t", "tb", "tebibytes")]) for unit in names}
_AMOUNT = re.compile(r"([0-9]+)\s*(\S*)")


def parse_bytes(value: Any) -> int:
    """An int of bytes, or Flink's ``MemorySize`` string (``"20kb"``, ``"32 mb"``); a plain
    integer string may be negative (``-1``: automatic, where the setting says so)."""
    try:
        return parse_int(value)
    except Invalid:
        pass
    text = _text(value)
    match = _AMOUNT.fullmatch(text.lower()) if text is not None else None
    if match is None or match.group(2) not in _MEMORY_UNITS:
        raise Invalid
    return int(match.group(1)) * _MEMORY_UNITS[match.group(2)]


def _plural(*words: str) -> tuple[str, ...]:
    return tuple(w for word in words for w in (word, word + "s"))


#: nanoseconds per unit
_DURATION_UNITS: dict[str, int] = {
    unit: nanos for nanos, names in [
        (86_400 * 10**9, ("d", *_plural("day"))),
        (3_600 * 10**9, ("h", *_plural("hour"))),
        (60 * 10**9, ("min", "m", *_plural("minute"))),
        (10**9, ("s", *_plural("sec", "second"))),
        (10**6, ("ms", *_plural("milli", "millisecond"))),
        (10**3, ("µs", "us", *_plural("micro", "microsecond"))),
        (1, ("ns", *_plural("nano", "nanosecond"))),
    ] for unit in names}


def parse_duration(value: Any) -> dt.timedelta:
    """A non-negative ``timedelta``, a number of milliseconds, or Flink's duration string
    (``"5 min"``, ``"300 s"``, ``"300000 ms"``, ``"2h"``; no unit: milliseconds)."""
    if isinstance(value, dt.timedelta):
        if value < dt.timedelta(0):
            raise Invalid
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not value >= 0:  # also NaN
            raise Invalid
        return dt.timedelta(milliseconds=value)
    text = _text(value)
    match = _AMOUNT.fullmatch(text.lower()) if text is not None else None
    if match is None:
        raise Invalid
    unit = match.group(2) or "ms"
    if unit not in _DURATION_UNITS:
        raise Invalid
    # timedelta counts microseconds: less is rounded down
    micros = int(match.group(1)) * _DURATION_UNITS[unit] // 1000
    try:
        return dt.timedelta(microseconds=micros)
    except OverflowError:
        raise Invalid from None


def _enum_spelling(text: str) -> str:
    return text.strip().upper().replace("-", "_")


def enum_parser(cls: type[enum.Enum]) -> Callable[[Any], Any]:
    """A member of ``cls``, or its value (or name) as a string in any case, ``-`` and ``_``
    alike (``"side_output"`` is ``side-output``)."""
    spellings: dict[str, enum.Enum] = {}
    for member in cls:
        spellings[_enum_spelling(member.name)] = member
        spellings[_enum_spelling(str(member.value))] = member

    def parse(value: Any) -> enum.Enum:
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and _enum_spelling(value) in spellings:
            return spellings[_enum_spelling(value)]
        raise Invalid

    return parse


def parse_str(value: Any) -> str:
    """A non-empty string (a path-like object as its path)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.strip():
        return value
    raise Invalid


def parse_names(value: Any) -> tuple[str, ...]:
    """A list or tuple of non-empty names, or one string of comma-separated names."""
    if isinstance(value, str):
        value = [n.strip() for n in value.split(",") if n.strip()]
    if isinstance(value, (list, tuple)) and all(isinstance(n, str) and n for n in value):
        return tuple(value)
    raise Invalid


def parse_mapping(value: Any) -> dict[str, Any]:
    """A mapping with string keys (a copy), or its JSON object form."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise Invalid from None
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return dict(value)
    raise Invalid


_DURATION_TAKES = ("a duration: a timedelta, a number of milliseconds, or a string such as "
                   "'5 min', '300 s', '300000 ms', '2h' (units d, h, min, s, ms, us, ns; "
                   "none: ms)")


def value_type(annotation: Any) -> ValueType:
    """The :class:`ValueType` of a setting annotated ``annotation``; ``TypeError`` for a type
    no string form is defined for (a new setting must use one of the types here)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"no configuration value type for {annotation!r}")
        inner = value_type(rest[0])

        def parse_optional(value: Any) -> Any:
            if value is None or (isinstance(value, str) and not value.strip()):
                return None
            return inner.parse(value)

        return ValueType(inner.takes, parse_optional, inner.python_type, optional=True)
    if origin is Annotated and args[0] is int and BYTES in args[1:]:
        return ValueType("a number of bytes: an integer, or a size such as '20kb', '32 mb', "
                         "'1g' (units b, kb, mb, gb, tb: powers of 1024)", parse_bytes, int)
    if annotation is bool:
        return ValueType("true or false", parse_bool, bool)
    if annotation is int:
        return ValueType("an integer", parse_int, int)
    if annotation is str:
        return ValueType("a non-empty string", parse_str, str)
    if annotation is dt.timedelta:
        return ValueType(_DURATION_TAKES, parse_duration, dt.timedelta)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        choices = ", ".join(str(m.value) for m in annotation)
        return ValueType(f"one of {choices} (any case, '-' or '_')", enum_parser(annotation),
                         annotation)
    if origin is tuple and args == (str, Ellipsis):
        return ValueType("a list of names, or one string of comma-separated names",
                         parse_names, tuple)
    if origin is dict and args[:1] == (str,):
        return ValueType("a mapping with string keys, or its JSON object form",
                         parse_mapping, dict)
    raise TypeError(f"no configuration value type for {annotation!r}")


def parse_setting(key: str, field_name: str, vtype: ValueType, value: Any,
                  minimum: int | None = None, *, secret: bool = False) -> Any:
    """``value`` as the setting ``key`` (field ``field_name``) takes it;
    :class:`ConfigurationError` naming the key, the field, the value (its type only where
    ``secret``: it may hold credentials) and what it takes."""
    try:
        parsed = vtype.parse(value)
        if minimum is not None and parsed is not None and parsed < minimum:
            raise Invalid
    except Invalid:
        shown = f"a {type(value).__name__} (not shown: it may hold credentials)" if secret \
            else repr(value)
        raise ConfigurationError(
            f"{key} (JobConfig.{field_name}) can't be {shown}: it takes "
            f"{vtype.describe(minimum)}"
        ) from None
    return parsed
