"""The shape of every ``--json`` output (docs/cli.md, "JSON output"): strict JSON (no NaN), typed
values (no JSON inside strings, labelled objects, null for what is unknown), one shape for a
readable and an unreadable listing entry. Checked against the schemas below, which the docs
page spells out field by field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner

from keyedstate.cli import main
from keyedstate.processor.inspection import TRANSFER_FIELDS
from tests.runtime.test_local_job import batches, config, new_job
from tests.spark.jobs import RunningTotals


class Map:
    """A JSON object of any keys whose values all match ``schema``."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema


N = type(None)


def conforms(value: Any, schema: Any, where: str = "$") -> None:
    """Assert ``value`` matches ``schema``: a type or tuple of types (``bool`` is not an
    ``int``), ``[schema]`` a list of it, ``{key: schema}`` an object with exactly those keys,
    :class:`Map`."""
    if isinstance(schema, Map):
        assert isinstance(value, dict), f"{where}: {value!r} is not an object"
        for k, v in value.items():
            conforms(v, schema.schema, f"{where}.{k}")
    elif isinstance(schema, dict):
        assert isinstance(value, dict), f"{where}: {value!r} is not an object"
        assert set(value) == set(schema), f"{where}: keys {sorted(value)} != {sorted(schema)}"
        for k, s in schema.items():
            conforms(value[k], s, f"{where}.{k}")
    elif isinstance(schema, list):
        assert isinstance(value, list), f"{where}: {value!r} is not a list"
        for i, v in enumerate(value):
            conforms(v, schema[0], f"{where}[{i}]")
    elif isinstance(schema, tuple):
        errors = []
        for alternative in schema:
            try:
                conforms(value, alternative, where)
                return
            except AssertionError as exc:
                errors.append(str(exc))
        raise AssertionError(" / ".join(errors))
    elif schema is float:
        assert isinstance(value, (int, float)) and not isinstance(value, bool), \
            f"{where}: {value!r} is not a number"
    else:
        assert isinstance(value, schema) and not (
            isinstance(value, bool) and schema is not bool), f"{where}: {value!r} is not {schema}"


def _reject(constant: str) -> Any:
    raise AssertionError(f"{constant} is not JSON")


def run_json(*args: str, code: int = 0) -> Any:
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == code, result.output
    return json.loads(result.stdout, parse_constant=_reject)


COUNTS = Map(int)
TRANSFER = {"snapshot": {f: int for f in TRANSFER_FIELDS},
            "restore": {f: int for f in TRANSFER_FIELDS},
            "objects": int, "inline_files": int, "merged_objects": int}
LISTING = {"id": int, "kind": (str, N), "format": (str, N), "batch_id": (int, N),
           "timestamp_ms": (int, N), "parallelism": (int, N), "max_parallelism": (int, N),
           "backend": (str, N), "key_types": ([str], N), "incremental_bytes": (int, N),
           "full_bytes": (int, N), "metadata": str, "files": ([str], N), "error": (str, N)}
FILE = {"path": (str, N), "size": int, "checksum": str, "inline": bool,
        "offset": (int, N), "object_size": (int, N)}
SHOW = {**{k: v for k, v in LISTING.items() if k != "error"},
        "properties": dict, "other_properties": Map(str), "transfer": TRANSFER,
        "subtasks": [{"index": int, "key_group_start": int, "key_group_end": int,
                      "checkpoint_id": int, "incremental_bytes": int, "full_bytes": int,
                      "states": [str], "shared": Map(FILE), "private": Map(FILE),
                      "properties": Map(int), "other_properties": Map(str),
                      "transfer": {"snapshot": COUNTS, "restore": COUNTS}}],
        "states": [{"name": str, "kind": (str, N), "value_type": (str, N),
                    "user_key_type": (str, N), "ttl_ms": (int, N), "bytes": (int, N)}],
        "state_sizes": str}
HISTORY_ROW = Map((int, float, N))
JOB_PROPERTIES = {"batch_id": int, "watermark": int, "tokens": [str], "staged": Map([str]),
                  "drained": bool, "restored_from": (str, N), "job_config": dict,
                  "checkpoint_history": [HISTORY_ROW], "subtask_stats": [Map((int, float,
                                                                              bool, N))],
                  "key_columns": [str]}
GC = {"directory": str, "latest_checkpoint_id": (int, N), "bytes": int,
      "files": [{"path": str, "size": int}], "deleted": int, "applied": bool}
STORAGE_CHECK = {"url": str, "access": str, "local_disk": bool, "object_store": bool,
                 "inline_threshold": int, "merge_file_size": int, "file_cache": bool,
                 "retried_calls": int}
SAVEPOINT = {"savepoint": str, "format": str, "source": str, "seconds": (int, float)}
STATE_ROWS = [{"key_group": int, "user_id": str, "namespace": N,
               "value": ({"count": int, "total": (float, N)}, N)}]
STATE_OUT = {"state": str, "rows": int, "files": [str]}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job's checkpoint directory (RunningTotals, state ``totals``) whose totals include a
    NaN (an amount of NaN): a float JSON can't hold."""
    root = tmp_path_factory.mktemp("json")
    with new_job(config(root), RunningTotals()) as job:
        first, second, third = batches(3, events=50)
        job.process_batch(first)
        job.process_batch(second)
        # The third batch's amounts all NaN: its users' totals become NaN.
        job.process_batch(third.set_column(2, "amount", pa.array([float("nan")] * 50)))
    return root / "ckpt"


def test_checkpoints_list(job):
    listing = run_json("checkpoints", "list", str(job))
    conforms(listing, [LISTING])
    assert [e["error"] for e in listing] == [None]


def test_an_unreadable_listing_entry_has_the_shape_of_a_readable_one(job, tmp_path):
    import shutil

    root = tmp_path / "job"
    shutil.copytree(job, root)
    shutil.copytree(root / "chk-3", root / "chk-4")
    (root / "chk-4" / "_metadata").write_bytes(b"not metadata")
    listing = run_json("checkpoints", "list", str(root), code=1)  # partial: exit status 1
    conforms(listing, [LISTING])
    readable, unreadable = listing
    assert readable["error"] is None and "CorruptCheckpointError" in unreadable["error"]
    assert unreadable["id"] == 4 and unreadable["files"] is None


def test_checkpoints_show_types_its_properties(job):
    detail = run_json("checkpoints", "show", str(job))
    conforms(detail, SHOW)
    properties = detail["properties"]
    conforms({k: properties[k] for k in JOB_PROPERTIES}, JOB_PROPERTIES)
    assert properties["batch_id"] == 2 and properties["drained"] is False
    history = properties["checkpoint_history"]
    assert [r["checkpoint_id"] for r in history] == [1, 2, 3]
    assert all(r["batch_id"] == r["checkpoint_id"] - 1 for r in history)
    assert properties["subtask_stats"][0].keys() >= {"sync_ms", "rows_in", "reused"}
    assert properties["job_config"]["parallelism.default"] == 2
    assert detail["other_properties"] == {}  # every property a local job records is typed
    assert any(s["other_properties"] for s in detail["subtasks"])  # rocksdb.*: the backend's


def test_checkpoints_transfer(job):
    conforms(run_json("checkpoints", "transfer", str(job)),
             [{"id": int, "kind": str, "metadata": str, **TRANSFER}])


def test_gc(job):
    conforms(run_json("gc", str(job)), GC)


def test_storage_check(job):
    conforms(run_json("storage", "check", str(job)), STORAGE_CHECK)


def test_savepoint_create(job, tmp_path):
    conforms(run_json("savepoint", "create", str(job), str(tmp_path / "sp")), SAVEPOINT)


def test_state_read_writes_null_for_nan(job, tmp_path):
    rows = run_json("state", "read", str(job), "--state", "totals", "--limit", "1000")
    conforms(rows, STATE_ROWS)
    assert any(r["value"]["total"] is None for r in rows)  # the NaN total
    assert any(isinstance(r["value"]["total"], float) for r in rows)
    conforms(run_json("state", "read", str(job), "--state", "totals", "--out",
                      str(tmp_path / "rows")), STATE_OUT)
