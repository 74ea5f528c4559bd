"""Namespaces: the canonical bytes of a state's or a timer's namespace (Flink's
``VoidNamespace`` for None)."""

from __future__ import annotations

from typing import Any

import msgspec

from keyedstate.errors import SerializationError
from keyedstate.serde.converters import _I64
from keyedstate.serde.serializers import _ENCODER, _decode

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
