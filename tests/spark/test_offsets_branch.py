"""Seeding a Spark checkpoint location from a snapshot's offset log makes a new branch: a
fresh query id, the parent and fork batch recorded beside it; seeding again finds the same
branch. Files only, no Spark."""

from __future__ import annotations

import json
import os

import pytest

from keyedstate.errors import SourcePositionsError
from keyedstate.spark.offsets import BRANCH_FILE, Branch, OffsetLog, rewind, seed

PARENT = "11111111-2222-3333-4444-555555555555"


def parent_log(root: str, batches: int) -> OffsetLog:
    """A Spark checkpoint location as Spark leaves it after ``batches`` batches."""
    for folder in ("offsets", "commits", "sources/0"):
        os.makedirs(os.path.join(root, folder), exist_ok=True)
    for b in range(batches):
        for folder in ("offsets", "commits", "sources/0"):
            with open(os.path.join(root, folder, str(b)), "w") as f:
                f.write(f"v1\n{{\"batch\": {b}}}")
    with open(os.path.join(root, "metadata"), "w") as f:
        f.write(json.dumps({"id": PARENT}))
    return OffsetLog.at(root)


def test_a_seeded_location_is_a_branch_with_a_query_id_of_its_own(tmp_path):
    parent = parent_log(str(tmp_path / "parent"), 5)
    location = OffsetLog.at(str(tmp_path / "new"))
    branch = seed(location, parent, 2)
    assert branch is not None and branch.query_id != PARENT
    assert location.query_id() == branch.query_id
    assert (branch.parent_query_id, branch.fork_batch_id) == (PARENT, 2)
    assert location.branch() == branch
    assert location.batches("offsets") == [0, 1, 2] and location.last_committed() == 2
    # a start that crashed before its first checkpoint finds its own seed again
    assert seed(location, parent, 2) == branch
    assert location.query_id() == branch.query_id
    # another fork of the same parent is another query's location
    with pytest.raises(SourcePositionsError, match="new, empty spark_checkpoint_location"):
        seed(location, parent, 1)


def test_the_parents_own_location_is_no_branch(tmp_path):
    parent = parent_log(str(tmp_path / "parent"), 3)
    assert seed(parent, parent, 2) is None
    assert parent.query_id() == PARENT and parent.branch() is None


def test_a_branch_record_of_another_version_is_refused(tmp_path):
    location = OffsetLog.at(str(tmp_path / "new"))
    seed(location, parent_log(str(tmp_path / "parent"), 2), 1)
    with open(os.path.join(str(tmp_path / "new"), BRANCH_FILE), "w") as f:
        f.write(json.dumps({"version": 99}))
    with pytest.raises(SourcePositionsError, match="version 99"):
        location.branch()
    assert Branch.decode(Branch("q", "p", 3).encode(), "x") == Branch("q", "p", 3)


def test_a_file_sources_log_is_copied_up_to_the_forks_log_offset(tmp_path):
    """A file source's log (``sources/<n>/<k>``, compacted into ``<k>.compact``) is cut at the
    log offset the fork batch's offsets record: entries the parent found later are its own
    (read again in the branch's batches as the parent planned them), while another source's
    log (here a rate-like source at index 1) is copied whole."""
    root = tmp_path / "parent"
    for folder in ("offsets", "commits", "sources/0", "sources/1"):
        (root / folder).mkdir(parents=True)
    for b in range(6):
        # batch b read the file source up to log offset b + 10 (offsets differ from batch ids)
        (root / "offsets" / str(b)).write_text(
            f'v1\n{{"batchWatermarkMs":0}}\n{{"logOffset":{b + 10}}}\n{{"start":0}}')
        (root / "commits" / str(b)).write_text('v1\n{"nextBatchWatermarkMs":0}')
    for k in range(10, 18):  # a plan for batch 6 and later found files too
        name = f"{k}.compact" if k == 13 else str(k)
        (root / "sources" / "0" / name).write_text(f'v1\n{{"path":"f{k}","batchId":{k}}}')
    (root / "sources" / "1" / "0").write_text("v1\n0")
    (root / "metadata").write_text(json.dumps({"id": PARENT}))
    location = OffsetLog.at(str(tmp_path / "new"))
    seed(location, OffsetLog.at(str(root)), 3)
    copied = sorted(location.storage.list_files("sources"))
    assert copied == ["sources/0/10", "sources/0/11", "sources/0/12", "sources/0/13.compact",
                      "sources/1/0"]


def test_rewind_makes_spark_run_the_batches_after_one_again(tmp_path):
    """The asynchronous mode's restart: Spark recorded batches 3 and 4 as done (and planned 5)
    while keyedstate's checkpoints cover batch 2 only. After the rewind the log says batch 2
    is the last done and batch 3 is planned with its logged offsets (Spark re-runs it); later
    plans are gone, and so are the file source's entries after batch 3's log offset (found
    for those plans), but not a compaction (it holds the earlier entries) nor another
    source's log; the query id stays."""
    root = tmp_path / "spark"
    for folder in ("offsets", "commits", "sources/0", "sources/1"):
        (root / folder).mkdir(parents=True)
    for b in range(6):
        # batch b read the file source up to log offset b + 10
        (root / "offsets" / str(b)).write_text(
            f'v1\n{{"batchWatermarkMs":0}}\n{{"logOffset":{b + 10}}}\n{{"start":0}}')
        if b < 5:
            (root / "commits" / str(b)).write_text('v1\n{"nextBatchWatermarkMs":0}')
    (root / "commits" / ".4.crc").write_text("crc")
    for k in range(10, 16):
        name = f"{k}.compact" if k == 14 else str(k)
        (root / "sources" / "0" / name).write_text(f'v1\n{{"path":"f{k}","batchId":{k}}}')
    (root / "sources" / "0" / ".15.crc").write_text("crc")
    (root / "sources" / "1" / "0").write_text("v1\n0")
    (root / "metadata").write_text(json.dumps({"id": PARENT}))
    location = OffsetLog.at(str(root))
    planned = (root / "offsets" / "3").read_text()
    assert rewind(location, 2) == [3, 4]
    assert location.batches("commits") == [0, 1, 2]
    assert location.batches("offsets") == [0, 1, 2, 3]
    assert (root / "offsets" / "3").read_text() == planned
    assert sorted(os.listdir(root / "commits")) == ["0", "1", "2"]
    assert sorted(location.storage.list_files("sources")) == [
        "sources/0/10", "sources/0/11", "sources/0/12", "sources/0/13", "sources/0/14.compact",
        "sources/1/0"]
    assert not (root / "sources" / "0" / ".15.crc").exists()
    assert location.query_id() == PARENT
    assert rewind(location, 2) == []  # again: nothing left to rewind
