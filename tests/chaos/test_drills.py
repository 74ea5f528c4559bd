"""Corruption drills: truncate, flip a byte in, or delete a shared file, a private file or the
``_metadata`` of the latest checkpoint; a restore must then fall back to an older retained
checkpoint (saying so) or fail with a clear error, and never restore wrong state silently.

Two levels: the engine-independent restore (:class:`LocalKeyedOperator`, both backends, every
target and damage), and the Spark job (a new driver over the damaged directory, then the batch
Spark delivers next), checked against the soak's oracle.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import pytest

from keyedstate import ListStateDescriptor, ValueStateDescriptor
from keyedstate.backends.base.backend import KeyedStateBackend
from keyedstate.errors import KeyedStateError
from keyedstate.processor.inspection import find_garbage
from keyedstate.runtime.local import LocalKeyedOperator
from keyedstate.testing.chaos.drills import damage_file

pytestmark = pytest.mark.chaos

BACKENDS = ["rocksdb", "heap"]
TARGETS = ["shared", "private", "metadata"]
DAMAGES = ["truncate", "flip", "delete"]
KEYS = 120
COUNT = ValueStateDescriptor("count", "bigint", default=0)
SEEN = ListStateDescriptor("seen", "bigint")

State = dict[int, tuple[int, list[int]]]


def _feed(op: LocalKeyedOperator, round_: int, state: State) -> None:
    def fn(backend: KeyedStateBackend, key: Any, value: int) -> None:
        backend.get_state(COUNT).update(backend.get_state(COUNT).value() + 1)
        backend.get_state(SEEN).add(value)

    records = [(k, round_ * 1000 + k) for k in range(0, KEYS, 1 + round_ % 3)]
    op.process(records, fn)
    for key, value in records:
        count, seen = state.get(key, (0, []))
        state[key] = (count + 1, [*seen, value])


def _read(op: LocalKeyedOperator) -> State:
    out: State = {}
    for key in range(KEYS):
        sub, kg = op.subtask_for(key)
        sub.set_current_key(key, kg)
        count = sub.get_state(COUNT).value()
        if count:
            out[key] = (count, list(sub.get_state(SEEN).get()))
    return out


def _job(root: str, backend: str, num_retained: int, rounds: int = 3
         ) -> dict[int, State]:
    """``rounds`` checkpoints; the expected state at each checkpoint id."""
    by_checkpoint: dict[int, State] = {}
    state: State = {}
    with LocalKeyedOperator(root, key_types=["bigint"], backend=backend, parallelism=2,
                            num_retained=num_retained) as op:
        for n in range(rounds):
            _feed(op, n, state)
            completed = op.checkpoint({"batch_id": str(n)})
            by_checkpoint[completed.checkpoint_id] = {k: (c, list(s)) for k, (c, s)
                                                      in state.items()}
    return by_checkpoint


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_latest_checkpoint_falls_back_or_fails_clearly(tmp_path, backend, target,
                                                               damage):
    root = str(tmp_path / "ckpt")
    expected = _job(root, backend, num_retained=2)
    dmg = damage_file(root, target, damage, random.Random(f"{backend}{target}{damage}"))
    assert dmg.checkpoint_id == max(expected)
    try:
        op = LocalKeyedOperator(root, key_types=["bigint"], backend=backend, parallelism=3,
                                num_retained=2)
    except KeyedStateError as exc:
        # A clear error names what is wrong; nothing was deleted by the failed restore.
        assert os.path.basename(dmg.file) in str(exc) or f"chk-{dmg.checkpoint_id}" in str(exc)
        assert target != "metadata", "a damaged _metadata has an older checkpoint to fall to"
        return
    with op:
        restored = op.coordinator.latest_completed
        assert restored is not None
        # Never wrong state: exactly the state of the checkpoint it restored.
        assert _read(op) == expected[restored.checkpoint_id]
        if restored.checkpoint_id != dmg.checkpoint_id:
            assert target == "metadata"
            # Said also for a deleted _metadata (it may as well be an uncommitted checkpoint).
            assert any(f"recovered from checkpoint {restored.checkpoint_id}" in note
                       for note in op.coordinator.recovery_notes)
        # The job goes on from there and its directory stays clean.
        state = expected[restored.checkpoint_id]
        _feed(op, 7, state)
        op.checkpoint({"batch_id": "7"})
        _feed(op, 8, state)
        op.checkpoint({"batch_id": "8"})
        assert _read(op) == state
    assert find_garbage(root).files == []


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_unreadable_only_checkpoint_fails_and_deletes_nothing(tmp_path, damage):
    root = str(tmp_path / "ckpt")
    _job(root, "rocksdb", num_retained=1)
    damage_file(root, "metadata", damage, random.Random(1))
    before = sorted(p for _, _, names in os.walk(root) for p in names)
    with pytest.raises(KeyedStateError, match="no checkpoint .* can be read"):
        LocalKeyedOperator(root, key_types=["bigint"], parallelism=2)
    assert sorted(p for _, _, names in os.walk(root) for p in names) == before


def test_a_damaged_savepoint_is_refused_before_anything_is_written(tmp_path):
    root = str(tmp_path / "ckpt")
    _job(root, "rocksdb", num_retained=1)
    with LocalKeyedOperator(root, key_types=["bigint"], parallelism=2) as op:
        op.savepoint(str(tmp_path / "sp"))
    savepoint = tmp_path / "sp"
    victim = sorted(p for p in savepoint.rglob("*.sst"))[0]
    with open(victim, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(KeyedStateError, match=victim.name):
        LocalKeyedOperator(str(tmp_path / "new"), key_types=["bigint"], parallelism=2,
                           restore_path=str(savepoint))
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").rglob("_metadata"))


# -- the Spark job ----------------------------------------------------------------------------

SPARK_DRILLS = [
    # (num_retained, target, damage, replay, expected outcome)
    (2, "metadata", "flip", False, "error"),       # fell back to batch B-1, Spark sends B+1
    (2, "metadata", "truncate", True, "fallback"),  # Spark replays B: the fallback is right
    (2, "metadata", "delete", True, "fallback"),
    (1, "metadata", "delete", False, "error"),      # nothing left; commit markers tell
    (2, "shared", "flip", False, "error"),
    (1, "private", "truncate", True, "error"),
    (1, "shared", "delete", False, "error"),
]


@pytest.mark.spark
def test_spark_drills(spark, tmp_path):
    """A restarted driver over a damaged copy of the job's directory: a clear error, or a
    fallback whose next batches equal the oracle's; never silently wrong output."""
    from keyedstate.testing.chaos import drills
    from keyedstate.testing.chaos.driver import build_job
    from keyedstate.testing.chaos.workload import write_input
    from tests.chaos.conftest import reference_run

    runs: dict[int, tuple[str, Any, Any]] = {}
    for num_retained in (1, 2):
        run_dir = str(tmp_path / f"retained-{num_retained}")
        os.makedirs(run_dir)
        plan, job = reference_run(spark, run_dir, 5, num_retained=num_retained)
        plan.batches = 7  # the drills read batches after the job's last one
        write_input(os.path.join(run_dir, "generated"), plan.seed, plan.batches,
                    plan.rows_per_batch, plan.keys)
        runs[num_retained] = (run_dir, plan, job)
    for n, (num_retained, target, damage, replay, outcome) in enumerate(SPARK_DRILLS):
        run_dir, plan, job = runs[num_retained]
        job.drill = {"target": target, "damage": damage, "replay": replay, "seed": n}
        result = drills.spark_drill(spark, plan, run_dir, job, build_job)
        assert not result["violation"], result
        assert result["outcome"] == outcome, result
        if outcome == "error":
            assert result["clear_error"], result
        else:
            assert result["restored_checkpoint"] < result["checkpoint_id"]
        shutil.rmtree(os.path.join(run_dir, "drills"), ignore_errors=True)
