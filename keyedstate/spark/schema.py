"""Schema conversions between Spark DDL, pyarrow and Spark's StructType."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from keyedstate.errors import OutputSchemaError
from keyedstate.serde import TypeLike, parse_type


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


def to_spark_schema(schema: pa.Schema) -> Any:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def spark_type_ddl(data_type: Any) -> str:
    """The DDL string of a Spark data type, as keyedstate's type parser reads it."""
    return str(data_type.simpleString())
