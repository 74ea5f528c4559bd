"""The soak's input publication: a segment's query sees exactly the files up to the segment's
end, also where a rollback reads again files its parent published further (the 500-batch soak
of seed 20261121 fed a rollback's segment one file of the next definition before this)."""

from __future__ import annotations

import os

import pytest

from keyedstate.testing.chaos.plan import make_plan
from keyedstate.testing.chaos.workload import input_file_name, publish_input, write_input

pytestmark = pytest.mark.chaos


def _visible(input_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(input_dir) if not n.startswith("."))


def test_publishing_withdraws_the_files_past_the_segment(tmp_path):
    generated, input_dir = str(tmp_path / "generated"), str(tmp_path / "input")
    write_input(generated, 3, 6, 10, 5)
    publish_input(generated, input_dir, 5)  # the parent published up to its own end
    mtime = os.path.getmtime(os.path.join(input_dir, input_file_name(2)))
    publish_input(generated, input_dir, 3)  # a rollback's segment ending earlier
    assert _visible(input_dir) == [input_file_name(b) for b in range(4)]
    # The files it keeps are the same files (the source has seen them by path and time).
    assert os.path.getmtime(os.path.join(input_dir, input_file_name(2))) == mtime
    publish_input(generated, input_dir, 5)  # the next segment
    assert _visible(input_dir) == [input_file_name(b) for b in range(6)]


def test_other_files_in_the_input_directory_are_left_alone(tmp_path):
    generated, input_dir = str(tmp_path / "generated"), str(tmp_path / "input")
    write_input(generated, 3, 3, 10, 5)
    os.makedirs(input_dir)
    for name in ("_spark_metadata", ".part-00009.parquet.tmp", "notes.txt"):
        open(os.path.join(input_dir, name), "w").close()
    publish_input(generated, input_dir, 1)
    assert sorted(os.listdir(input_dir)) == sorted(
        [".part-00009.parquet.tmp", "_spark_metadata", "notes.txt",
         input_file_name(0), input_file_name(1)])


def test_long_plans_draw_rollbacks_whose_segment_ends_before_the_parents_files():
    """The case the withdrawal is for exists in the plans the soak runs: a rollback with a
    changed definition inside the files its parent already published."""
    plan = make_plan(20261121, 500, 25)
    cases = [job.index for job in plan.jobs if job.rollback and any(
        plan.first_file(job) <= f < plan.jobs[job.index - 1].end_file
        for f in plan.redefine_after)]
    assert cases, "no rollback re-reads a file past one of its segments"
