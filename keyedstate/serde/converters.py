"""Plain-value converters, one pair per Arrow type: a Python value of a declared type <->
its checked plain form (dates as days, timestamps as microseconds, decimals as unscaled
integers, structs as lists in field order), what MessagePack stores."""

from __future__ import annotations

import datetime as _dt
import decimal
from typing import Any, Callable

import pyarrow as pa

from keyedstate.errors import SerializationError

EPOCH_DATE = _dt.date(1970, 1, 1)
EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
_ONE_US = _dt.timedelta(microseconds=1)

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]

_INT_BOUNDS = {8: 1 << 7, 16: 1 << 15, 32: 1 << 31, 64: 1 << 63}
_I64 = 1 << 63
# Spark decimals have up to 38 digits; the default context (28) would round or refuse them.
_DECIMAL_CONTEXT = decimal.Context(prec=80, traps=[decimal.InvalidOperation])


def _fail(value: Any, type_: pa.DataType) -> SerializationError:
    return SerializationError(f"value {value!r} ({type(value).__name__}) does not match type {type_}")


def converters(type_: pa.DataType) -> tuple[Encode, Decode]:
    """``(encode, decode)`` between Python values of ``type_`` and their plain-value form.

    ``encode`` checks the value against the type and raises :class:`SerializationError`;
    ``None`` is allowed everywhere (a null).
    """
    if pa.types.is_boolean(type_):
        return _exactly(bool, type_), _identity
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
        def to_float(v: Any) -> Any:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                try:
                    return float(v)
                except OverflowError:
                    raise _fail(v, type_) from None
            raise _fail(v, type_)
        return _exactly(float, type_, to_float), _identity
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return _exactly(str, type_), _identity
    if pa.types.is_binary(type_) or pa.types.is_large_binary(type_):
        def to_bytes(v: Any) -> Any:
            if isinstance(v, (bytearray, memoryview)):
                return bytes(v)
            raise _fail(v, type_)
        return _exactly(bytes, type_, to_bytes), _identity
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


def _exactly(py_type: type, type_: pa.DataType, other: Encode | None = None) -> Encode:
    """The encoder of ``type_``, whose plain form is a ``py_type`` value as it is: a value of
    exactly that type (not a subclass: a bool is no int) or None passes; any other goes to
    ``other`` (converts it or raises), else is refused."""
    def enc(v: Any) -> Any:
        if v is None or type(v) is py_type:
            return v
        if other is not None:
            return other(v)
        raise _fail(v, type_)
    return enc


def datetime_to_micros(v: _dt.datetime) -> int:
    """Microseconds since the epoch; a naive datetime is taken as UTC (as Spark's sessions here)."""
    if v.tzinfo is None:
        v = v.replace(tzinfo=_dt.timezone.utc)
    delta = v - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def micros_to_datetime(us: int) -> _dt.datetime:
    return EPOCH + _dt.timedelta(microseconds=us)

