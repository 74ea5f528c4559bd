"""The soak's plan: a function of the seed that draws every fault kind and every edge (storage
errors after the checkpoint commit, the four ways a job ends, fresh Spark checkpoint locations,
positions drills, the second job), keeps an older seed's draws, and plans faults on the batch
that reads their file once drains have shifted batch ids."""

from __future__ import annotations

import json

import pytest

from keyedstate.testing.chaos.plan import (
    KINDS,
    SINK_PATH_POINTS,
    STOPS,
    STORAGE_POINTS,
    TOLERABLE_FAILED,
    Plan,
    make_plan,
    min_batches,
)

pytestmark = pytest.mark.chaos

#: every edge a plan of at least one fault per kind draws
EDGES = {"fresh-location", "positions-drill", "savepoint:crash", "savepoint:drain",
         "savepoint:stop", "second-job", "storage:listener", "storage:marker-write",
         "storage:staging-delete", "rollback", "redefine:evolve-stats", "redefine:switch-ttl",
         "redefine:toggle-buckets"}


def _points(plan: Plan) -> set[str]:
    return {p for p in plan.planned_points() if not p.startswith("savepoint:sink")} | (
        {"savepoint:sink"} if any(j.stop == "sink" for j in plan.jobs) else set())


def test_plan_is_a_function_of_the_seed():
    a = make_plan(16, 14, 1, checkpoint_root="/x").to_json()
    assert a == make_plan(16, 14, 1, checkpoint_root="/x").to_json()
    assert a != make_plan(17, 14, 1, checkpoint_root="/x").to_json()
    assert json.loads(json.dumps(a)) == a
    assert Plan.from_json(json.loads(json.dumps(a))).to_json() == a


def test_a_long_plan_counts_and_spreads_its_faults():
    plan = make_plan(1, 500, 50, checkpoint_root="/x")
    assert plan.planned_counts() == {"worker": 50, "executor": 50, "driver": 50, "abort": 50,
                                     "storage": 150, "savepoint": 200}
    faults = plan.executor_faults + plan.driver_faults + plan.storage_faults
    assert len({f["file"] for f in faults}) == 350, "one fault per input file"
    points = plan.planned_points()
    for stop in STOPS:
        assert sum(n for p, n in points.items() if p.startswith(f"savepoint:{stop}")) == 50
    assert points["savepoint:sink:main-before"] == points["savepoint:sink:last-after"] == 25
    for point in STORAGE_POINTS:
        assert points[f"storage:{point}"] == 50
    assert points["storage:marker-write:absorbed"] == points["storage:marker-write:outlasting"]
    # Every other boundary moves to a fresh location, and so does every rollback.
    assert 100 <= points["fresh-location"] == points["positions-drill"] <= 100 + 50
    assert points["rollback"] == 50
    assert sum(n for p, n in points.items() if p.startswith("redefine:")) == 150
    assert points["redefine:evolve-stats"] == 1 and points["redefine:switch-ttl"] == 75


@pytest.mark.parametrize("seed", range(12))
def test_one_fault_per_kind_draws_every_edge(seed):
    plan = make_plan(seed, 14, 1, checkpoint_root="/x")
    assert plan.planned_counts() == {"worker": 1, "executor": 1, "driver": 1, "abort": 1,
                                     "storage": 3, "savepoint": 4}
    assert _points(plan) == EDGES | {"savepoint:sink"} | {
        f"storage:marker-write:{'outlasting' if f['times'] > TOLERABLE_FAILED else 'absorbed'}"
        for f in plan.storage_faults if f["point"] == "marker-write"}
    assert sorted(j.stop for j in plan.jobs[:-1]) == sorted(STOPS)
    assert plan.second_job is not None and plan.second_job["after_job"] < len(plan.jobs) - 1


def test_two_faults_per_kind_draw_both_variants():
    for seed in range(12):
        plan = make_plan(seed, 40, 2, checkpoint_root="/x")
        points = plan.planned_points()
        assert points["storage:marker-write:absorbed"] == 1
        assert points["storage:marker-write:outlasting"] == 1
        assert points["savepoint:sink:main-before"] == points["savepoint:sink:last-after"] == 1


def test_an_older_seed_keeps_its_draws():
    """Seed 16 (the CI soak before the new edges): the same faults on the same files, the
    same restart parallelisms, its boundary (file 5, then CLAIM) still a stop with its drill;
    the new boundaries split its jobs."""
    plan = make_plan(16, 14, 1, checkpoint_root="/x")
    per_file = sorted((f["id"].split("-")[0], f["file"], f.get("at") or f.get("point"))
                      for f in plan.executor_faults + plan.driver_faults)
    assert per_file == [("abort", 0, "metadata-write"), ("driver", 13, "commit-step-3"),
                        ("executor", 10, "upload"), ("worker", 3, "upload")]
    assert plan.restart_parallelism == [3, 1, 2, 1, 4, 4, 3, 2, 3, 3, 3, 4, 1, 3, 4, 4]
    ends = {j.end_file: j for j in plan.jobs}
    assert ends[5].stop == "stop" and plan.jobs[ends[5].index + 1].restore_mode == "CLAIM"
    assert (plan.jobs[0].parallelism, plan.jobs[0].num_retained) == (4, 2)
    starts_at_6 = plan.jobs[ends[5].index + 1]
    assert (starts_at_6.parallelism, starts_at_6.num_retained) == (4, 1)


def test_drains_shift_the_batch_ids_of_every_later_file():
    plan = make_plan(7, 40, 2, checkpoint_root="/x")
    drained = [j for j in plan.jobs[:-1] if j.stop == "drain"]
    assert len(drained) == 2
    schedule = plan.schedule()
    assert [b for b, _ in schedule] == list(range(len(schedule)))
    assert [f for _, f in schedule if f is not None] == list(range(plan.batches))
    drains = [b for b, f in schedule if f is None]
    assert drains == [plan.end_batch(j) + 1 for j in drained]
    for batch, file in schedule:
        assert plan.file_of_batch(batch) == file
        if file is not None:
            assert plan.batch_of_file(file) == batch
    assert plan.last_batch() == plan.batches - 1 + len(drains)
    for fault in plan.executor_faults + plan.driver_faults + plan.storage_faults:
        assert fault["batch"] == plan.batch_of_file(fault["file"]) not in drains
        assert fault["id"].endswith(f"-b{fault['batch']}")


@pytest.mark.parametrize("seed", range(20))
def test_faults_that_a_job_end_would_preempt_are_kept_apart(seed):
    plan = make_plan(seed, 60, 3, checkpoint_root="/x")
    other = {f["file"] for f in plan.executor_faults + plan.driver_faults}
    sink_or_crash = {j.end_file for j in plan.jobs[:-1] if j.stop in ("sink", "crash")}
    for fault in plan.storage_faults:
        assert fault["file"] not in other | sink_or_crash
    sink_path = {f["file"] for f in plan.driver_faults if f["point"] in SINK_PATH_POINTS}
    assert not sink_path & {j.end_file for j in plan.jobs[:-1] if j.stop == "crash"}
    ends = [-1] + [j.end_file for j in plan.jobs]
    assert all(b - a >= 2 for a, b in zip(ends, ends[1:])), "jobs of two files at least"
    for job, following in zip(plan.jobs, plan.jobs[1:]):
        if following.restore_mode == "CLAIM":
            assert job.savepoint_format == "native", "CLAIM builds on a native snapshot"
        assert job.positions_drill == (following.spark_location != job.spark_location)


def test_too_few_batches_are_refused():
    assert min_batches(1) == 11 and min_batches(0) == 1
    with pytest.raises(ValueError, match="too few"):
        make_plan(1, 10, 1, checkpoint_root="/x")
    make_plan(1, 11, 1, checkpoint_root="/x")
    plan = make_plan(1, 3, 0, checkpoint_root="/x")
    assert len(plan.jobs) == 1 and plan.second_job is None and not plan.storage_faults
    assert plan.planned_counts() == {kind: 0 for kind in KINDS}


def test_a_plan_json_of_an_older_run_loads():
    data = make_plan(3, 14, 1, checkpoint_root="/x").to_json()
    for job in data["jobs"]:
        job["end_batch"] = job.pop("end_file")
    assert Plan.from_json(data).jobs[-1].end_file == 13


def test_on_the_heap_backend_upload_faults_fire_on_the_first_file():
    """A heap snapshot often uploads one file: a kill planned on a second would not fire. The
    rest of the plan is the seed's, whatever the backend."""
    heap = make_plan(54, 14, 1, backend="heap", checkpoint_root="/x")
    rocksdb = make_plan(54, 14, 1, checkpoint_root="/x")
    uploads = [f for f in heap.executor_faults if f["at"] == "upload"]
    assert uploads and all(f["upload_index"] == 0 for f in uploads)
    assert any(f["upload_index"] == 1 for f in rocksdb.executor_faults if f["at"] == "upload")
    strip = [{k: v for k, v in f.items() if k != "upload_index"} for f in heap.executor_faults]
    assert strip == [{k: v for k, v in f.items() if k != "upload_index"}
                     for f in rocksdb.executor_faults]
