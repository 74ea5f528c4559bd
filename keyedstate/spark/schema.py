"""Schema conversions between Spark DDL, pyarrow and Spark's StructType."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

# to_arrow_schema is engine-independent (the local runtime takes the same schemas); imported
# from here as before.
from keyedstate.serde import to_arrow_schema as to_arrow_schema

if TYPE_CHECKING:
    from pyspark.sql.types import DataType, StructType


def to_spark_schema(schema: pa.Schema) -> StructType:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def spark_type_ddl(data_type: DataType) -> str:
    """The DDL string of a Spark data type, as keyedstate's type parser reads it."""
    return str(data_type.simpleString())
