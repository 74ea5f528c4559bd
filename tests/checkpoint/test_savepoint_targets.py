"""Where a savepoint may be written: only into a new or empty directory, outside its source;
its source verified before anything is copied; nothing left behind when it fails. Every way
of taking one (the command line, the Python functions, the local runtime's stop), native and
canonical, on real files and real RocksDB."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.savepoint import create_native_savepoint, write_native_savepoint
from keyedstate.cli import main
from keyedstate.errors import (
    CorruptCheckpointError,
    MissingCheckpointFileError,
    SnapshotExistsError,
    TargetNotEmptyError,
)
from keyedstate.processor.canonical import write_canonical_savepoint
from tests.checkpoint.test_savepoints import _damage, files_under, run_job
from tests.runtime.test_local_job import batches, config, new_job

pytestmark = pytest.mark.integration


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.fixture
def two_jobs(tmp_path):
    """Job A (2 checkpoints) and job B (4 checkpoints, the latest at batch 3), both closed."""
    a, _ = run_job(str(tmp_path / "a"), "rocksdb", rounds=2)
    a.close()
    b, _ = run_job(str(tmp_path / "b"), "rocksdb", rounds=4)
    b.close()
    return tmp_path / "a", tmp_path / "b"


@pytest.mark.parametrize("fmt", ["native", "canonical"])
def test_savepoint_into_another_jobs_checkpoint_directory_is_refused(two_jobs, fmt):
    a, b = two_jobs
    before = files_under(str(b))
    code, output = invoke("savepoint", "create", str(a), str(b), "--format", fmt)
    assert code == 1 and "TargetNotEmptyError" in output and str(b) in output, output
    assert "chk-4" in output  # names what is there
    assert files_under(str(b)) == before
    # The job's directory still shows the job's own latest checkpoint.
    assert resolve_snapshot(str(b)).metadata.properties["batch_id"] == "3"


def test_every_api_refuses_a_non_empty_target_and_a_file(tmp_path):
    op, _ = run_job(str(tmp_path / "job"), "heap")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    (tmp_path / "a-file").write_text("mine too")
    source = resolve_snapshot(str(tmp_path / "job"))
    for target in (tmp_path / "busy", tmp_path / "a-file"):
        with pytest.raises(TargetNotEmptyError, match=str(target)):
            op.savepoint(str(target))
        with pytest.raises(TargetNotEmptyError):
            create_native_savepoint(str(tmp_path / "job"), str(target))
        with pytest.raises(TargetNotEmptyError):
            write_canonical_savepoint(source, str(target))
    op.close()
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    assert os.listdir(tmp_path / "busy") == ["notes.txt"]
    assert (tmp_path / "a-file").read_text() == "mine too"
    # A new directory, and an existing empty one, are fine.
    (tmp_path / "empty").mkdir()
    for target in ("empty", "new/nested"):
        create_native_savepoint(str(tmp_path / "job"), str(tmp_path / target))
        assert resolve_snapshot(str(tmp_path / target)).metadata.kind == "savepoint"
    with pytest.raises(SnapshotExistsError):
        create_native_savepoint(str(tmp_path / "job"), str(tmp_path / "empty"))


def test_local_job_stop_refuses_a_non_empty_target_before_stopping(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with new_job(config(tmp_path / "one")) as job:
        job.process_batch(batches(1)[0])
        with pytest.raises(TargetNotEmptyError):
            job.stop(savepoint=str(tmp_path / "busy"))
        with pytest.raises(TargetNotEmptyError):
            job.savepoint(str(tmp_path / "busy"), format="canonical")
        job.process_batch(batches(2)[1])  # still running
    assert os.listdir(tmp_path / "busy") == ["notes.txt"]


@pytest.mark.parametrize("fmt", ["native", "canonical"])
def test_a_target_inside_the_source_directory_is_refused(tmp_path, fmt):
    op, _ = run_job(str(tmp_path / "job"), "rocksdb")
    op.close()
    code, output = invoke("savepoint", "create", str(tmp_path / "job"),
                          str(tmp_path / "job" / "chk-2" / "sp"), "--format", fmt)
    assert code == 1 and "inside the source snapshot's own directory" in output, output
    assert not os.path.exists(tmp_path / "job" / "chk-2" / "sp")


@pytest.mark.parametrize("how", ["altered", "missing"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "empty-dir"])
def test_a_damaged_source_fails_and_leaves_the_target_as_it_was(tmp_path, how, existing):
    op, _ = run_job(str(tmp_path / "job"), "rocksdb")
    op.close()
    snap = resolve_snapshot(str(tmp_path / "job"))
    victim = sorted((f for f in snap.metadata.files() if f.path.endswith(".sst")),
                    key=lambda f: f.size)[-1]
    _damage(str(tmp_path / "job" / victim.path), how)
    target = tmp_path / "out" / "sp"
    if existing:
        target.mkdir(parents=True)
    code, output = invoke("savepoint", "create", str(tmp_path / "job"), str(target))
    error = "MissingCheckpointFileError" if how == "missing" else "CorruptCheckpointError"
    assert code == 1 and error in output, output
    assert os.path.basename(victim.path) in output  # names the damaged file
    if existing:
        assert os.listdir(target) == []
    else:
        assert not os.path.exists(tmp_path / "out")  # the directories it created go too


@pytest.mark.parametrize("fmt", ["native", "canonical"])
def test_a_failure_after_files_were_written_removes_them(tmp_path, fmt):
    op, _ = run_job(str(tmp_path / "job"), "rocksdb")
    op.close()
    source = resolve_snapshot(str(tmp_path / "job"))
    written: list[str] = []

    def attach(storage):  # runs once every state file is in
        written.extend(storage.list_files())
        raise OSError("the disk is full")

    write = write_native_savepoint if fmt == "native" else write_canonical_savepoint
    with pytest.raises(OSError, match="disk is full"):
        write(source, str(tmp_path / "new" / "sp"), attach=attach)
    assert written and not os.path.exists(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="disk is full"):
        write(source, str(tmp_path / "empty"), attach=attach)
    assert os.listdir(tmp_path / "empty") == []


def test_python_api_verifies_the_source_before_writing(tmp_path):
    op, _ = run_job(str(tmp_path / "job"), "heap")
    op.close()
    snap = resolve_snapshot(str(tmp_path / "job"))
    victim = sorted(snap.metadata.files(), key=lambda f: f.size)[-1]
    _damage(str(tmp_path / "job" / victim.path), "altered")
    with pytest.raises(CorruptCheckpointError, match=victim.path):
        create_native_savepoint(str(tmp_path / "job"), str(tmp_path / "sp"))
    assert not os.path.exists(tmp_path / "sp")
    os.remove(tmp_path / "job" / victim.path)
    with pytest.raises(MissingCheckpointFileError, match=victim.path):
        create_native_savepoint(str(tmp_path / "job"), str(tmp_path / "sp"))
    assert not os.path.exists(tmp_path / "sp")



def test_savepoint_writer_refuses_a_non_empty_target_before_anything_runs(tmp_path):
    # The Spark state processor's writer follows the same rule; the refusal needs no Spark.
    from keyedstate.spark.processor import SavepointWriter

    (tmp_path / "busy" / "states").mkdir(parents=True)
    (tmp_path / "busy" / "states" / "kept.parquet").write_bytes(b"mine")
    writer = SavepointWriter.new_savepoint(128, key_columns=["user_id"], key_types=["string"])
    with pytest.raises(TargetNotEmptyError, match="not empty"):
        writer.write(str(tmp_path / "busy"))
    assert (tmp_path / "busy" / "states" / "kept.parquet").read_bytes() == b"mine"
