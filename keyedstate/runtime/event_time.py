"""Event time as the watermark reads it: a watermark column's values in epoch milliseconds."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from keyedstate.errors import OutputSchemaError


def event_time_ms(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """``column`` (a timestamp, or an integer of epoch milliseconds) in epoch milliseconds
    (integer division, truncating toward zero, as Spark's ``div`` does); nulls stay null."""
    if pa.types.is_timestamp(column.type):
        return pc.divide(column.cast(pa.timestamp("us", tz=column.type.tz)).cast(pa.int64()), 1000)
    if pa.types.is_integer(column.type):
        return column.cast(pa.int64())
    raise OutputSchemaError(f"watermark column must be a timestamp or integer (ms), got {column.type}")
