"""Native savepoints: self-contained and relocatable, duplicated (never re-encoded), verified on
restore; rescaling from any checkpoint or savepoint at any parallelism 1..max parallelism.

Real files, real RocksDB, both backends, through :class:`LocalKeyedOperator`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from keyedstate import ListStateDescriptor, ValueStateDescriptor
from keyedstate.backends.base.backend import KeyedStateBackend
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.checkpoint.savepoint import create_native_savepoint, duplicate_file
from keyedstate.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    MaxParallelismMismatchError,
    MissingCheckpointFileError,
    SnapshotExistsError,
)
from keyedstate.runtime.local import LocalKeyedOperator
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import SnapshotFormat, SnapshotKind
from keyedstate.storage.layout import METADATA_FILE

pytestmark = pytest.mark.integration

BACKENDS = ["rocksdb", "heap"]
KEYS = 400
COUNT = ValueStateDescriptor("count", "bigint", default=0)
SEEN = ListStateDescriptor("seen", "bigint")


#: Keys a round touches when it must change only part of the state: the heap backend then
#: writes a diff and a few key groups' images on top of its chain; a round touching every key
#: makes it image every key group (a full file, as large as the change).
SOME_KEYS = range(0, KEYS, 10)


def feed(op: LocalKeyedOperator, round_: int, expected: dict[int, tuple[int, list[int]]],
         keys: range = range(KEYS)) -> None:
    """One round of records (each of ``keys`` once, some twice), applied to ``op`` and
    ``expected``."""
    def fn(backend: KeyedStateBackend, key: Any, value: int) -> None:
        backend.get_state(COUNT).update(backend.get_state(COUNT).value() + 1)
        backend.get_state(SEEN).add(value)

    records = [(k, round_ * 1000 + k) for k in keys]
    records += [(k, -round_) for k in keys if k % 7 == 0]
    op.process(records, fn)
    for key, value in records:
        count, seen = expected.get(key, (0, []))
        expected[key] = (count + 1, [*seen, value])


def read_all(op: LocalKeyedOperator) -> dict[int, tuple[int, list[int]]]:
    out = {}
    for key in range(KEYS):
        sub, kg = op.subtask_for(key)
        sub.set_current_key(key, kg)
        out[key] = (sub.get_state(COUNT).value(), list(sub.get_state(SEEN).get()))
    return out


def run_job(root: str, backend: str, *, rounds: int = 2, parallelism: int = 2,
            num_retained: int = 1, max_parallelism: int | None = None,
            later_keys: range = range(KEYS)
            ) -> tuple[LocalKeyedOperator, dict[int, tuple[int, list[int]]]]:
    """A job with ``rounds`` checkpoints (the later ones incremental, each round after the
    first touching ``later_keys``); still open."""
    op = LocalKeyedOperator(root, key_types=["bigint"], backend=backend,
                            parallelism=parallelism, num_retained=num_retained,
                            max_parallelism=max_parallelism)
    expected: dict[int, tuple[int, list[int]]] = {}
    for n in range(rounds):
        feed(op, n, expected, range(KEYS) if n == 0 else later_keys)
        op.checkpoint({"batch_id": str(n)})
    return op, expected


def files_under(root: str) -> dict[str, bytes]:
    """Every file below ``root`` (relative path -> content)."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("new_parallelism", [1, 3])
def test_native_savepoint_moved_elsewhere_restores_at_another_parallelism(
        tmp_path, backend, new_parallelism):
    op, expected = run_job(str(tmp_path / "job"), backend, rounds=3, later_keys=SOME_KEYS)
    assert op.coordinator.latest_completed.metadata.incremental_size < \
        op.coordinator.latest_completed.metadata.full_size  # built on shared files
    url = op.savepoint(str(tmp_path / "sp"))
    op.close()
    assert url == str(tmp_path / "sp" / METADATA_FILE)
    # Self-contained: every reference is a file under the savepoint directory.
    snap = resolve_snapshot(str(tmp_path / "sp"))
    assert snap.metadata.kind is SnapshotKind.SAVEPOINT
    assert snap.metadata.format is SnapshotFormat.NATIVE
    referenced = {f.path for f in snap.metadata.files()}
    assert referenced | {METADATA_FILE} == set(files_under(str(tmp_path / "sp")))
    assert all(p.startswith("sub-") for p in referenced)
    # Relocatable: move it, delete the job that made it, restore at another parallelism.
    shutil.move(str(tmp_path / "sp"), str(tmp_path / "elsewhere" / "sp"))
    shutil.rmtree(tmp_path / "job")
    with LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], backend=backend,
                            parallelism=new_parallelism,
                            restore_path=str(tmp_path / "elsewhere" / "sp")) as restored:
        assert restored.max_parallelism == 128  # adopted from the savepoint
        assert read_all(restored) == expected
        feed(restored, 9, expected)
        restored.checkpoint()
        restored.rescale(2)
        assert read_all(restored) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_savepoint_files_are_hard_links_of_the_checkpoint_on_one_disk(tmp_path, backend):
    op, _ = run_job(str(tmp_path / "job"), backend)
    op.savepoint(str(tmp_path / "sp"))
    latest = op.coordinator.latest_completed.metadata
    savepoint = resolve_snapshot(str(tmp_path / "sp")).metadata
    op.close()
    for source, copy in zip(latest.handles, savepoint.handles):
        for name, stream in [*source.shared.items(), *source.private.items()]:
            duplicate = {**copy.shared, **copy.private}[name]
            assert (duplicate.size, duplicate.checksum) == (stream.size, stream.checksum)
            assert os.stat(tmp_path / "job" / stream.path).st_ino == \
                os.stat(tmp_path / "sp" / duplicate.path).st_ino


def test_duplicate_file_ways(tmp_path):
    local = CheckpointStorage(str(tmp_path / "a"))
    handle = local.write("x/f.bin", b"0123456789")
    other_local = CheckpointStorage(str(tmp_path / "b"))
    memory = CheckpointStorage(f"memory://{tmp_path.name}/m")
    memory2 = CheckpointStorage(f"memory://{tmp_path.name}/n")
    assert duplicate_file(local, handle.path, other_local, "y/f.bin", handle.size) == "link"
    assert duplicate_file(local, handle.path, memory, "y/f.bin", handle.size) == "stream"
    assert duplicate_file(memory, "y/f.bin", memory2, "z/f.bin", handle.size) == "server-copy"
    assert memory2.read("z/f.bin") == b"0123456789"
    with pytest.raises(MissingCheckpointFileError, match="missing"):
        duplicate_file(local, "x/none.bin", other_local, "y/none.bin", 1)
    with pytest.raises(CorruptCheckpointError, match="10 bytes"):
        duplicate_file(local, handle.path, other_local, "y/g.bin", 11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_savepoint_on_another_filesystem_restores(tmp_path, backend):
    op, expected = run_job(str(tmp_path / "job"), backend)
    target = f"memory://{tmp_path.name}-{backend}/sp"
    create_native_savepoint(str(tmp_path / "job"), target)
    op.close()
    with LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], backend=backend,
                            parallelism=2, restore_path=target) as restored:
        assert read_all(restored) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_offline_savepoint_of_a_retained_checkpoint_and_of_a_savepoint(tmp_path, backend):
    op, _ = run_job(str(tmp_path / "job"), backend, rounds=3, num_retained=2)
    ids = op.coordinator.storage.checkpoint_ids()
    op.close()
    assert len(ids) == 2
    url = create_native_savepoint(str(tmp_path / "job" / f"chk-{ids[0]}"), str(tmp_path / "sp"))
    assert resolve_snapshot(url).metadata.checkpoint_id == ids[0]
    again = create_native_savepoint(str(tmp_path / "sp"), str(tmp_path / "sp2"))
    assert resolve_snapshot(again).metadata.properties["savepoint_of"] == url
    with LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], backend=backend,
                            parallelism=3, restore_path=str(tmp_path / "sp2")) as restored:
        assert restored.coordinator.latest_completed is None and restored.restored is not None


def test_savepoint_target_holding_a_savepoint_is_refused_before_anything_is_written(tmp_path):
    op, _ = run_job(str(tmp_path / "job"), "rocksdb")
    op.savepoint(str(tmp_path / "sp"))
    before = files_under(str(tmp_path / "sp"))
    feed(op, 5, {})
    op.checkpoint()
    with pytest.raises(SnapshotExistsError, match="never overwrites"):
        op.savepoint(str(tmp_path / "sp"))
    with pytest.raises(SnapshotExistsError):
        create_native_savepoint(str(tmp_path / "job"), str(tmp_path / "sp"))
    op.close()
    assert files_under(str(tmp_path / "sp")) == before
    with pytest.raises(ConfigurationError, match="own directory"):
        create_native_savepoint(str(tmp_path / "job"), str(tmp_path / "job"))


def _damage(path: str, how: str) -> None:
    if how == "missing":
        os.remove(path)
        return
    with open(path, "r+b") as f:  # altered in place, same size: only the checksum tells
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["altered", "missing"])
@pytest.mark.parametrize("mode", ["NO_CLAIM", "CLAIM"])
def test_damaged_savepoint_is_refused_before_anything_is_touched(tmp_path, backend, how, mode):
    op, _ = run_job(str(tmp_path / "job"), backend)
    op.savepoint(str(tmp_path / "sp"))
    op.close()
    snap = resolve_snapshot(str(tmp_path / "sp"))
    victim = sorted(snap.metadata.files(), key=lambda f: f.size)[-1]
    _damage(str(tmp_path / "sp" / victim.path), how)
    before = files_under(str(tmp_path / "sp"))
    error = MissingCheckpointFileError if how == "missing" else CorruptCheckpointError
    with pytest.raises(error, match=victim.path):
        LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], backend=backend,
                           parallelism=2, restore_path=str(tmp_path / "sp"), restore_mode=mode)
    assert not os.path.exists(tmp_path / "job2")  # nothing written for the new job
    assert files_under(str(tmp_path / "sp")) == before  # no claim marker either


@pytest.mark.parametrize("how", ["altered", "missing"])
@pytest.mark.parametrize("kind", ["savepoint", "checkpoint"])
def test_checkpoints_show_of_a_damaged_snapshot_names_its_file_and_the_way_out(tmp_path, how,
                                                                             kind):
    from click.testing import CliRunner

    from keyedstate.cli import main

    op, _ = run_job(str(tmp_path / "job"), "rocksdb")
    op.savepoint(str(tmp_path / "sp"))
    op.close()
    root = tmp_path / ("sp" if kind == "savepoint" else "job")
    snap = resolve_snapshot(str(root))
    victim = sorted((f for f in snap.metadata.files() if f.path.endswith(".sst")),
                    key=lambda f: f.size)[-1]
    _damage(str(root / victim.path), how)
    result = CliRunner().invoke(main, ["checkpoints", "show", str(root)])
    text = " ".join(result.output.split())
    error = "MissingCheckpointFileError" if how == "missing" else "CorruptCheckpointError"
    assert result.exit_code == 1 and error in text, text
    assert str(root / victim.path) in text  # the snapshot's own file, no temporary copy
    assert "keyedstate-inspect" not in text and "--no-state-sizes" in text
    assert ("Copy the file back" in text) == (kind == "savepoint")
    assert "restore from a checkpoint" not in text.lower()
    assert CliRunner().invoke(main, ["checkpoints", "show", str(root),
                                     "--no-state-sizes"]).exit_code == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_rescale_from_a_checkpoint_to_every_extreme(tmp_path, backend):
    op, expected = run_job(str(tmp_path / "job"), backend, parallelism=3, max_parallelism=8)
    op.close()
    for parallelism in (1, 8):
        root = str(tmp_path / f"p{parallelism}")
        with LocalKeyedOperator(root, key_types=["bigint"], backend=backend,
                                parallelism=parallelism,
                                restore_path=str(tmp_path / "job")) as restored:
            assert restored.max_parallelism == 8
            assert read_all(restored) == expected
    with pytest.raises(ConfigurationError):
        LocalKeyedOperator(str(tmp_path / "p9"), key_types=["bigint"], backend=backend,
                           parallelism=9, restore_path=str(tmp_path / "job"))


def test_another_max_parallelism_is_refused_with_the_way_out(tmp_path):
    op, _ = run_job(str(tmp_path / "job"), "rocksdb", max_parallelism=64)
    op.savepoint(str(tmp_path / "sp"))
    op.close()
    with pytest.raises(MaxParallelismMismatchError,
                       match="canonical savepoint.*state processor API"):
        LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], parallelism=2,
                           max_parallelism=128, restore_path=str(tmp_path / "sp"))
    assert not os.path.exists(tmp_path / "job2")
    with pytest.raises(MaxParallelismMismatchError, match="max parallelism 64"):
        LocalKeyedOperator(str(tmp_path / "job"), key_types=["bigint"], parallelism=2,
                           max_parallelism=128)


# -- the capability table of docs/savepoints.md --------------------------------------------------

def _snapshot_of_kind(tmp_path, backend: str, kind: str) -> tuple[str, dict]:
    """A snapshot of a 2-checkpoint job: its latest ``checkpoint``, a ``native`` savepoint or a
    ``canonical`` savepoint (part B's writer)."""
    op, expected = run_job(str(tmp_path / "job"), backend)
    op.close()
    if kind == "checkpoint":
        return str(tmp_path / "job"), expected
    if kind == "native":
        return create_native_savepoint(str(tmp_path / "job"), str(tmp_path / "sp")), expected
    from keyedstate.processor.canonical import write_canonical_savepoint

    return write_canonical_savepoint(resolve_snapshot(str(tmp_path / "job")),
                                     str(tmp_path / "sp")), expected


@pytest.mark.parametrize("kind", ["checkpoint", "native"])
def test_backend_change_from_a_native_snapshot_is_refused_with_the_way_out(tmp_path, kind):
    path, _ = _snapshot_of_kind(tmp_path, "rocksdb", kind)
    with pytest.raises(ConfigurationError, match="canonical savepoint"):
        LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], backend="heap",
                           parallelism=2, restore_path=path)
    assert not os.path.exists(tmp_path / "job2")


def test_key_types_of_another_job_are_refused(tmp_path):
    path, _ = _snapshot_of_kind(tmp_path, "heap", "native")
    with pytest.raises(ConfigurationError, match="key types"):
        LocalKeyedOperator(str(tmp_path / "job2"), key_types=["string"], backend="heap",
                           parallelism=2, restore_path=path)


def test_a_checkpoint_is_not_self_contained(tmp_path):
    op, _ = run_job(str(tmp_path / "job"), "rocksdb", rounds=2)
    latest = op.coordinator.latest_completed.checkpoint_id
    op.close()
    # Its shared files live in the job's shared/ folder: chk-N alone does not restore.
    shutil.copytree(tmp_path / "job" / f"chk-{latest}", tmp_path / "moved" / f"chk-{latest}")
    with pytest.raises(MissingCheckpointFileError, match="shared/"):
        LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], parallelism=2,
                           restore_path=str(tmp_path / "moved" / f"chk-{latest}"))


UPGRADED = ValueStateDescriptor("upgraded", "string")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["checkpoint", "native", "canonical"])
def test_job_upgrade_adds_a_state_and_keeps_the_others(tmp_path, backend, kind):
    path, expected = _snapshot_of_kind(tmp_path, backend, kind)
    with LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], backend=backend,
                            parallelism=3, restore_path=path) as upgraded:
        def fn(b: KeyedStateBackend, key: Any, value: int) -> None:
            b.get_state(UPGRADED).update(f"v{value}")  # a new state; "seen" is left alone

        upgraded.process([(k, k) for k in range(KEYS)], fn)
        upgraded.checkpoint()
        upgraded.rescale(2)
        assert read_all(upgraded) == expected
        sub, kg = upgraded.subtask_for(5)
        sub.set_current_key(5, kg)
        assert sub.get_state(UPGRADED).value() == "v5"


@pytest.mark.parametrize("kind", ["checkpoint", "native", "canonical"])
def test_schema_evolution_in_place_is_refused(tmp_path, kind):
    from keyedstate.errors import StateTypeMismatchError

    path, _ = _snapshot_of_kind(tmp_path, "rocksdb", kind)
    with LocalKeyedOperator(str(tmp_path / "job2"), key_types=["bigint"], parallelism=2,
                            restore_path=path) as restored:
        sub, kg = restored.subtask_for(1)
        sub.set_current_key(1, kg)
        with pytest.raises(StateTypeMismatchError, match="state processor API"):
            sub.get_state(ValueStateDescriptor("count", "string"))


@pytest.mark.s3
@pytest.mark.parametrize("backend", BACKENDS)
def test_savepoint_and_claim_on_s3_use_server_side_copies(s3_bucket, tmp_path, backend):
    url, options = s3_bucket
    op = LocalKeyedOperator(f"{url}/job", key_types=["bigint"], backend=backend, parallelism=2,
                            storage_options=options, local_dir=str(tmp_path / "work"))
    expected: dict[int, tuple[int, list[int]]] = {}
    for n in range(2):
        feed(op, n, expected)
        op.checkpoint()
    metadata_url = op.savepoint(f"{url}/sp")
    op.close()
    assert metadata_url == f"{url}/sp/_metadata"
    storage = CheckpointStorage(f"{url}/sp", options)
    assert all(p.startswith("sub-") for p in storage.list_files() if p != METADATA_FILE)
    with LocalKeyedOperator(f"{url}/job2", key_types=["bigint"], backend=backend,
                            parallelism=3, storage_options=options, restore_path=f"{url}/sp",
                            restore_mode="CLAIM", local_dir=str(tmp_path / "work2")) as claimed:
        assert storage.exists("_claimed")
        assert read_all(claimed) == expected
        claimed.checkpoint()
        assert storage.list_files() == []  # the claimed savepoint went with its checkpoint
