"""The key-group function in Python equals Spark's ``pmod(xxhash64(cols), maxP)`` in the JVM."""

from __future__ import annotations

import datetime as dt
import decimal

import pytest

from keyedstate.keys import KeySerializer

pytestmark = pytest.mark.spark

UTC = dt.timezone.utc

ROWS = [
    (0, 0, "", b"", False, dt.date(1970, 1, 1), dt.datetime(1970, 1, 1, tzinfo=UTC),
     decimal.Decimal("0.00"), decimal.Decimal("0"), 0.0),
    (-1, -(1 << 63), "user-1", b"\x00\xff", True, dt.date(2024, 2, 29),
     dt.datetime(2024, 2, 29, 12, 30, 1, 123456, tzinfo=UTC), decimal.Decimal("-12.34"),
     decimal.Decimal("123456789012345678901234.5"), -0.0),
    (2147483647, (1 << 63) - 1, "ünïcødé ✓ and a longer string of more than 32 bytes", b"x" * 33,
     True, dt.date(1900, 1, 1), dt.datetime(1960, 6, 1, 1, 2, 3, tzinfo=UTC),
     decimal.Decimal("99999999.99"), decimal.Decimal("-1"), 3.5),
    (None, 42, None, None, None, None, None, None, None, None),
]
SCHEMA = (
    "i int, l bigint, s string, b binary, z boolean, d date, t timestamp, "
    "m decimal(10,2), big decimal(30,1), f double"
)
COLUMNS = [c.split()[0] for c in SCHEMA.split(", ")]
TYPES = [c.split(" ", 1)[1] for c in SCHEMA.split(", ")]


@pytest.mark.parametrize("max_parallelism", [128, 32768, 7])
@pytest.mark.parametrize("column", COLUMNS)
def test_single_column_key_group_matches_spark(spark, column, max_parallelism):
    df = spark.createDataFrame(ROWS, SCHEMA)
    got = df.selectExpr(column, f"pmod(xxhash64({column}), {max_parallelism}) AS kg").collect()
    ser = KeySerializer([TYPES[COLUMNS.index(column)]])
    for row in got:
        assert ser.key_group(row[0], max_parallelism) == row["kg"], (column, row[0])


def test_composite_key_group_matches_spark(spark):
    df = spark.createDataFrame(ROWS, SCHEMA)
    cols = ", ".join(COLUMNS)
    got = df.selectExpr(*COLUMNS, f"pmod(xxhash64({cols}), 128) AS kg").collect()
    ser = KeySerializer(TYPES)
    for row in got:
        key = tuple(row[c] for c in COLUMNS)
        assert ser.key_group(key, 128) == row["kg"]


def test_many_string_keys_match_spark(spark):
    df = spark.range(5000).selectExpr("concat('user-', id) AS u", "id")
    got = df.selectExpr("u", "id", "pmod(xxhash64(u, id), 1024) AS kg").collect()
    ser = KeySerializer(["string", "bigint"])
    assert all(ser.key_group((r.u, r.id), 1024) == r.kg for r in got)
