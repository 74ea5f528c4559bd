"""Schema conversions between Spark DDL, pyarrow and Spark's StructType."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

# to_arrow_schema is engine-independent (the local runtime takes the same schemas); imported
# from here as before.
from keyedstate.serde import to_arrow_schema as to_arrow_schema


def to_spark_schema(schema: pa.Schema) -> Any:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def spark_type_ddl(data_type: Any) -> str:
    """The DDL string of a Spark data type, as keyedstate's type parser reads it."""
    return str(data_type.simpleString())
