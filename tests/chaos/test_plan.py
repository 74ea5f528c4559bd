"""The soak's plan: a function of the seed that draws every fault kind and every edge (storage
errors after the checkpoint commit, the four ways a job ends, fresh Spark checkpoint locations,
positions drills, the second job; with asynchronous jobs the points of the asynchronous
phase), keeps an older seed's draws, and plans faults on the batch that reads their file once
drains have shifted batch ids."""

from __future__ import annotations

import json

import pytest

from keyedstate.testing.chaos.plan import (
    ASYNC_EXECUTOR_POINTS,
    ASYNC_POINTS,
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
    assert plan.planned_counts() == {kind: 0 for kind in KINDS if kind != "async"}


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


# -- the asynchronous phase ----------------------------------------------------------------------

def _without_async(plan: Plan) -> dict:
    """The plan's JSON without what the asynchronous phase adds."""
    data = plan.to_json()
    for key in ("checkpointing", "restart_checkpointing", "notes"):
        data.pop(key)
    for job in data["jobs"]:
        job.pop("checkpointing"), job.pop("max_concurrent")
    for key in ("executor_faults", "driver_faults"):
        data[key] = [f for f in data[key] if f["kind"] != "async"]
    return data


def test_sync_is_the_default_and_draws_no_async_point():
    plan = make_plan(54, 40, 2, checkpoint_root="/x")
    assert plan.to_json() == make_plan(54, 40, 2, checkpoint_root="/x",
                                       checkpointing="sync").to_json()
    assert plan.checkpointing == "sync" and not plan.async_faults()
    assert {j.checkpointing for j in plan.jobs} == {"sync"}
    assert "async" not in plan.planned_counts() and not plan.restart_checkpointing
    assert not [p for p in plan.planned_points() if p.startswith(("async", "checkpointing"))]


@pytest.mark.parametrize("checkpointing", ["async", "mixed"])
@pytest.mark.parametrize("seed", range(8))
def test_async_points_are_drawn_as_often_as_asked_and_keep_the_seeds_plan(seed, checkpointing):
    """Each point ``faults_per_kind`` times, on files of asynchronous jobs holding no other
    fault and ending no sink or crash job, planned on the batch reading them; the executor
    points with a subtask; everything else the seed's synchronous plan."""
    plan = make_plan(seed, 120, 3, checkpoint_root="/x", checkpointing=checkpointing)
    assert plan.notes == []
    assert plan.planned_counts()["async"] == 3 * len(ASYNC_POINTS)
    points = plan.planned_points()
    assert {p: points[f"async:{p}"] for p in ASYNC_POINTS} == {p: 3 for p in ASYNC_POINTS}
    faults = plan.async_faults()
    others = {f["file"] for f in plan.executor_faults + plan.driver_faults + plan.storage_faults
              if f["kind"] != "async"}
    ends = {j.end_file for j in plan.jobs[:-1] if j.stop in ("sink", "crash")}
    assert len({f["file"] for f in faults}) == len(faults), "one fault per input file"
    for fault in faults:
        assert fault["file"] not in others | ends
        assert plan.job_of_file(fault["file"]).checkpointing == "async"
        assert fault["batch"] == plan.batch_of_file(fault["file"])
        assert fault["id"].startswith("async-") and fault["id"].endswith(f"-b{fault['batch']}")
        point = fault.get("at") or fault["point"]
        assert (fault in plan.executor_faults) == (point in ASYNC_EXECUTOR_POINTS)
        assert ("subtask" in fault) == (point in ASYNC_EXECUTOR_POINTS)
    assert _without_async(plan) == _without_async(make_plan(seed, 120, 3, checkpoint_root="/x"))
    assert plan.to_json() == make_plan(seed, 120, 3, checkpoint_root="/x",
                                       checkpointing=checkpointing).to_json()
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).to_json() == plan.to_json()


def test_async_runs_every_job_asynchronously_some_with_two_in_flight():
    plans = [make_plan(seed, 60, 2, checkpoint_root="/x", checkpointing="async")
             for seed in range(8)]
    assert all(j.checkpointing == "async" for p in plans for j in p.jobs)
    assert {j.max_concurrent for p in plans for j in p.jobs} == {1, 2}
    assert all(not p.restart_checkpointing for p in plans), "restarts keep the mode"


@pytest.mark.parametrize("seed", range(12))
def test_mixed_draws_both_modes_and_the_restarts_modes(seed):
    plan = make_plan(seed, 60, 2, checkpoint_root="/x", checkpointing="mixed")
    assert {j.checkpointing for j in plan.jobs} == {"sync", "async"}
    points = plan.planned_points()
    assert points["checkpointing:sync"] + points["checkpointing:async"] == len(plan.jobs)
    assert any("->" in p for p in points), "a job boundary between the modes"
    assert len(plan.restart_checkpointing) == len(plan.restart_parallelism)
    assert set(plan.restart_checkpointing) <= {"sync", "async"}
    modes = [m for s in range(12) for m in make_plan(
        s, 60, 2, checkpoint_root="/x", checkpointing="mixed").restart_checkpointing]
    assert {"sync", "async"} <= set(modes)


def test_async_points_that_do_not_fit_are_fewer_and_the_plan_says_why():
    plan = make_plan(3, 14, 1, checkpoint_root="/x", checkpointing="async")
    drawn = len(plan.async_faults())
    assert 0 < drawn < len(ASYNC_POINTS)
    assert plan.planned_counts()["async"] == drawn
    assert plan.notes and plan.notes[0].startswith(f"async: {drawn} of {len(ASYNC_POINTS)}")
    assert "--batches" in plan.notes[0]
    counts = [plan.planned_points().get(f"async:{p}", 0) for p in ASYNC_POINTS]
    assert max(counts) - min(counts) <= 1, "as evenly as the files allow"


def test_a_plan_json_of_before_the_asynchronous_phase_loads():
    data = make_plan(3, 14, 1, checkpoint_root="/x").to_json()
    for key in ("checkpointing", "restart_checkpointing", "notes"):
        data.pop(key)
    for job in data["jobs"]:
        job.pop("checkpointing"), job.pop("max_concurrent")
    plan = Plan.from_json(data)
    assert plan.checkpointing == "sync" and plan.jobs[0].checkpointing == "sync"


def test_an_unknown_checkpointing_mode_is_refused():
    with pytest.raises(ValueError, match="checkpointing must be one of"):
        make_plan(1, 14, 1, checkpoint_root="/x", checkpointing="both")
