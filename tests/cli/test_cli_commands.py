"""``keyedstate checkpoints list|show``, ``savepoint create`` and ``gc`` through click's
CliRunner, on real checkpoint directories written by both backends."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from keyedstate.backends.base.backend import OTHER_FILES
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.cli import main
from keyedstate.runtime.local import LocalKeyedOperator
from tests.checkpoint.test_savepoints import BACKENDS, SOME_KEYS, read_all, run_job

pytestmark = pytest.mark.integration

LISTING_FIELDS = {"id", "batch_id", "parallelism", "max_parallelism", "backend",
                  "incremental_bytes", "full_bytes", "files"}


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def invoke_json(*args: str) -> object:
    code, output = invoke(*args, "--json")
    assert code == 0, output
    return json.loads(output)


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_list_json(tmp_path, backend):
    op, _ = run_job(str(tmp_path / "job"), backend, rounds=3, num_retained=2,
                    later_keys=SOME_KEYS)
    op.close()
    listing = invoke_json("checkpoints", "list", str(tmp_path / "job"))
    assert [c["id"] for c in listing] == [2, 3]
    for entry, batch in zip(listing, (1, 2)):
        assert LISTING_FIELDS <= set(entry)
        assert entry["batch_id"] == batch and entry["backend"] == backend
        assert entry["parallelism"] == 2 and entry["max_parallelism"] == 128
        assert 0 < entry["incremental_bytes"] < entry["full_bytes"]
        assert all(os.path.isabs(f) and os.path.isfile(f) for f in entry["files"])
        metadata = resolve_snapshot(str(tmp_path / "job" / f"chk-{entry['id']}")).metadata
        assert sum(os.path.getsize(f) for f in entry["files"]) == metadata.full_size
    code, table = invoke("checkpoints", "list", str(tmp_path / "job"))
    assert code == 0 and backend in table


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_show_json_has_handles_and_per_state_sizes(tmp_path, backend):
    op, _ = run_job(str(tmp_path / "job"), backend)
    op.close()
    detail = invoke_json("checkpoints", "show", str(tmp_path / "job"))
    assert LISTING_FIELDS <= set(detail) and detail["kind"] == "checkpoint"
    assert [s["index"] for s in detail["subtasks"]] == [0, 1]
    assert detail["subtasks"][0]["key_group_start"] == 0
    assert detail["subtasks"][1]["key_group_end"] == 127
    handle_files = {f["path"] for s in detail["subtasks"]
                    for f in [*s["shared"].values(), *s["private"].values()]}
    assert handle_files == set(detail["files"])
    sizes = {s["name"]: s["bytes"] for s in detail["states"]}
    assert sizes["count"] > 0 and sizes["seen"] > sizes["count"]  # lists hold more
    assert sum(sizes.values()) == detail["full_bytes"]
    assert OTHER_FILES in sizes and detail["state_sizes"].startswith("computed")
    fast = invoke_json("checkpoints", "show", str(tmp_path / "job"), "--no-state-sizes")
    assert all(s["bytes"] is None for s in fast["states"])
    code, text = invoke("checkpoints", "show", str(tmp_path / "job" / "chk-2"))
    assert code == 0 and "seen" in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_savepoint_create_native_then_restore(tmp_path, backend):
    op, expected = run_job(str(tmp_path / "job"), backend)
    op.close()
    created = invoke_json("savepoint", "create", str(tmp_path / "job"), str(tmp_path / "sp"))
    assert created["savepoint"] == str(tmp_path / "sp" / "_metadata")
    assert created["source"] == str(tmp_path / "job" / "chk-2" / "_metadata")
    detail = invoke_json("checkpoints", "show", str(tmp_path / "sp"))
    assert (detail["kind"], detail["format"]) == ("savepoint", "native")
    assert all(f.startswith(str(tmp_path / "sp") + "/") for f in detail["files"])
    code, output = invoke("savepoint", "create", str(tmp_path / "job"), str(tmp_path / "sp"))
    assert code != 0 and "SnapshotExistsError" in output
    with LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], backend=backend,
                            parallelism=3, restore_path=str(tmp_path / "sp")) as restored:
        assert read_all(restored) == expected


def test_savepoint_create_canonical_moved_then_restored_in_the_other_backend(tmp_path):
    op, expected = run_job(str(tmp_path / "job"), "rocksdb")
    op.close()
    created = invoke_json("savepoint", "create", str(tmp_path / "job"), str(tmp_path / "sp"),
                          "--format", "canonical")
    detail = invoke_json("checkpoints", "show", created["savepoint"])
    assert (detail["kind"], detail["format"]) == ("savepoint", "canonical")
    # Self-contained and relocatable too: move it, delete the job, restore in another backend.
    shutil.move(str(tmp_path / "sp"), str(tmp_path / "moved"))
    shutil.rmtree(tmp_path / "job")
    with LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], backend="heap",
                            parallelism=3, restore_path=str(tmp_path / "moved")) as restored:
        assert read_all(restored) == expected


def _touch(path: str, data: bytes = b"x") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_checkpoints_list_of_a_missing_directory_fails_with_a_clear_error(tmp_path):
    code, text = invoke("checkpoints", "list", str(tmp_path / "no-such-job"))
    assert code != 0 and "does not exist" in text
    os.makedirs(tmp_path / "empty")
    assert invoke_json("checkpoints", "list", str(tmp_path / "empty")) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_gc_lists_and_with_apply_deletes_only_unreferenced_files(tmp_path, backend):
    root = str(tmp_path / "job")
    op, expected = run_job(root, backend, rounds=3, num_retained=2)  # checkpoints 2 and 3
    op.close()
    referenced = {f for c in invoke_json("checkpoints", "list", root) for f in c["files"]}
    referenced |= {os.path.join(root, f"chk-{i}", "_metadata") for i in (2, 3)}
    garbage = {
        _touch(f"{root}/shared/chk-1-sub-0-dead-000009.sst"),     # a subsumed checkpoint's
        _touch(f"{root}/chk-1/sub-0/MANIFEST-000001"),            # an incomplete chk dir
        _touch(f"{root}/chk-3/_metadata.1234.inprogress"),        # a failed commit's temp file
        _touch(f"{root}/staging/batch-1/main/part-00000.parquet"),  # a committed batch's
        _touch(f"{root}/commits/batch-0-chk-1"),                   # a subsumed checkpoint's
    }
    kept = {
        _touch(f"{root}/shared/chk-4-sub-0-inflight-000011.sst"),  # checkpoint 4 in flight
        _touch(f"{root}/chk-4/sub-1/MANIFEST-000002"),
        _touch(f"{root}/staging/batch-3/main/part-00001.parquet"),  # batch 3 in flight
        _touch(f"{root}/commits/batch-2-chk-3"),                   # the latest's marker
        _touch(f"{root}/taskowned/sub-0/LOCK"),                    # not the layout's
        _touch(f"{root}/spark/offsets/0"),                          # Spark's own
        _touch(f"{root}/notes.txt"),
    }
    report = invoke_json("gc", root)
    assert {f["path"] for f in report["files"]} == garbage
    assert report["latest_checkpoint_id"] == 3 and report["applied"] is False
    assert all(os.path.exists(p) for p in garbage | kept | referenced)  # listing deletes nothing
    code, text = invoke("gc", root)
    assert code == 0 and "--apply" in text
    code, text = invoke("gc", root, "--apply")
    assert code == 0 and f"deleted {len(garbage)} files" in " ".join(text.split()), text
    assert invoke_json("gc", root)["files"] == []
    assert not any(os.path.exists(p) for p in garbage)
    assert all(os.path.exists(p) for p in kept | referenced)
    assert not os.path.exists(f"{root}/chk-1")  # emptied folders go too
    assert invoke_json("gc", root)["files"] == []
    with LocalKeyedOperator(root, key_types=["bigint"], backend=backend,
                            parallelism=2, num_retained=2) as again:
        assert read_all(again) == expected


def test_gc_refuses_a_savepoint_and_an_unreadable_checkpoint(tmp_path):
    op, _ = run_job(str(tmp_path / "job"), "heap")
    op.savepoint(str(tmp_path / "sp"))
    op.close()
    code, output = invoke("gc", str(tmp_path / "sp"))
    assert code != 0 and "savepoint" in output
    with open(tmp_path / "job" / "chk-2" / "_metadata", "ab") as f:
        f.write(b"garbage")
    code, output = invoke("gc", str(tmp_path / "job"))
    assert code != 0 and "CorruptCheckpointError" in output and "chk-2" in output
    result = CliRunner().invoke(main, ["checkpoints", "list", str(tmp_path / "job"), "--json"])
    assert result.exit_code == 1  # listed in full, then the status says one can't be read
    assert "CorruptCheckpointError" in json.loads(result.stdout)[-1]["error"]
