"""Output rows to Arrow (``rows_to_table``): exactly the declared fields, named errors;
no Spark needed."""

from __future__ import annotations

import pytest

from keyedstate.errors import OutputSchemaError
from keyedstate.runtime.output import rows_to_table
from keyedstate.spark.schema import to_arrow_schema

SCHEMA = to_arrow_schema("user_id string, count bigint, note string")
KEYS = [(0, "a"), (2, "b")]  # rows 0-1 of key "a", 2- of key "b"


def test_dict_and_tuple_rows_convert():
    table = rows_to_table([{"user_id": "a", "count": 1, "note": None},
                            {"note": "x", "count": 2, "user_id": "b"}], SCHEMA, "main")
    assert table.to_pylist() == [{"user_id": "a", "count": 1, "note": None},
                                 {"user_id": "b", "count": 2, "note": "x"}]
    assert rows_to_table([("a", 1, None)], SCHEMA, "main").equals(table.slice(0, 1))
    assert rows_to_table([], SCHEMA, "main").num_rows == 0


@pytest.mark.parametrize(("rows", "message"), [
    # a misspelled field used to be dropped, and the declared one written as null
    ([{"user_id": "a", "count": 1, "note": None}, {"user_id": "a", "count": 1, "note": None},
      {"user_id": "b", "cnt": 1, "note": None}],
     "output 'main', row 2 (key 'b'): field 'cnt' is not in the output schema"),
    ([{"user_id": "a", "count": 1, "note": None, "extra": 0}],
     "row 0 (key 'a'): field 'extra' is not in the output schema"),
    # a missing field used to be written as null, though DDL fields are all nullable
    ([{"user_id": "a", "count": 1, "note": None}, {"user_id": "a", "count": 1}],
     "row 1 (key 'a'): field 'note' is missing (the schema declares user_id, count, note); "
     "every field must be given, None for a null"),
    ([{"user_id": "a", "count": 1, "note": None}, ("a", 1, None)],
     "row 1 (key 'a') is a tuple, the first row a dict"),
    ([("a", 1, None), ("a", 1, None), ("b", 1, None, "x")],
     "row 2 (key 'b') has 4 values, the schema 3 fields"),
    ([("a", 1)], "row 0 (key 'a') has 2 values, the schema 3 fields"),
    ([("a", 1, None), {"user_id": "a", "count": 1, "note": None}],
     "row 1 (key 'a') is a dict, the first row a tuple"),
    ([{"user_id": "a", "count": 1, "note": None}, {"user_id": "a", "count": "x", "note": None}],
     "row 1 (key 'a'): field 'count' is int64, got 'x'"),
    ([("a", 1, None), ("a", 1, None), ("b", 1, 3.5)], "row 2 (key 'b'): field 'note' is string, "
                                                      "got 3.5"),
])
def test_rows_not_matching_the_schema_name_the_row_key_and_field(rows, message):
    with pytest.raises(OutputSchemaError) as failure:
        rows_to_table(rows, SCHEMA, "main", KEYS)
    assert message in str(failure.value)


def test_side_output_rows_without_keys_name_the_output():
    with pytest.raises(OutputSchemaError, match=r"^output 'alerts', row 0: field 'x' is not"):
        rows_to_table([{"x": 1}], SCHEMA, "alerts")
