"""What identifies a job at start (key columns, key types, states), restarting a job that was
started from a snapshot, and errors whose advice works when followed; on the local runtime
(real RocksDB and heap state, no Java). docs/checkpoints.md, "What identifies a job";
docs/restore-modes.md, "Restarting a job started from a snapshot"."""

from __future__ import annotations

import logging
import os
from typing import Any

import pyarrow as pa
import pytest

from keyedstate.errors import ConfigurationError, CorruptCheckpointError, JobMismatchError
from keyedstate.processor.inspection import find_garbage
from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.runtime.local import LocalJob
from keyedstate.state.descriptors import ValueStateDescriptor
from tests.checkpoint.test_savepoints import files_under
from tests.runtime.test_local_job import batches, config, new_job, reference, rows
from tests.spark.jobs import COUNT_SCHEMA, IdleCounts

pytestmark = pytest.mark.integration

SKU_INPUT = "sku string, ts timestamp, amount double"
SKU_OUTPUT = "sku string, stock bigint"


class Stock(KeyedProcessFunction):
    """Another job: stock per SKU, a state of its own (shares nothing with IdleCounts)."""

    stock = ValueStateDescriptor("stock", "bigint")

    def open(self, ctx: Context) -> None:
        self.state = ctx.get_state(self.stock)

    def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
        level = (self.state.value() or 0) + rows.num_rows
        self.state.update(level)
        return [{"sku": key, "stock": level}]


def sku_job(cfg: Any) -> LocalJob:
    return LocalJob(Stock(), key_columns=["sku"], input_schema=SKU_INPUT,
                    output_schema=SKU_OUTPUT, config=cfg)


def sku_batch(table: pa.Table) -> pa.Table:
    return table.rename_columns(["sku", "ts", "amount"])


# -- what identifies a job ---------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_another_job_on_a_directory_is_refused_before_anything_is_written(tmp_path, backend):
    """Another function, state and key column (same key type) on a job's directory: refused
    at start, naming the recorded job, what differs and the ways out; nothing touched."""
    data = batches(2)
    cfg = config(tmp_path, backend=backend)
    with new_job(cfg) as job:
        job.process_batch(data[0])
    before = files_under(str(tmp_path / "ckpt"))
    with pytest.raises(JobMismatchError) as refused:
        sku_job(cfg)
    message = str(refused.value)
    for part in ("['user_id']", "['sku']", "'count'", "'last'", "'stock'", "IdleCounts",
                 "restore_path", "keyedstate.state-recovery.allow-job-change"):
        assert part in message, (part, message)
    assert isinstance(refused.value, ConfigurationError)
    assert files_under(str(tmp_path / "ckpt")) == before
    # The directory's own job still restarts from it.
    with new_job(cfg) as job:
        assert job.last_batch_id == 0
        job.process_batch(data[1])


def test_the_ways_out_of_a_refused_start_work(tmp_path):
    """The error's two ways out: the new job in a new directory restored from the old one's
    checkpoint, and the option for an intended change taking over the directory in place."""
    data = batches(2)
    cfg = config(tmp_path)
    with new_job(cfg) as job:
        job.process_batch(data[0])
    # Way out 1: a new checkpoint directory, restored from this one (the old states are kept).
    moved = config(tmp_path / "new", restore_path=str(tmp_path / "ckpt"))
    with sku_job(moved) as job:
        assert job.last_batch_id == 0
        job.process_batch(sku_batch(data[1]))
    with sku_job(moved) as job:  # and it restarts there as the job it now is
        assert job.last_batch_id == 1
    # Way out 2: the option, in place; the directory then records the new job.
    with sku_job(cfg.replace(allow_job_change=True)) as job:
        job.process_batch(sku_batch(data[1]))
    with sku_job(cfg) as job:
        assert job.last_batch_id == 1
    with pytest.raises(JobMismatchError, match="sku"):
        new_job(cfg)


def test_renaming_a_key_column_needs_the_option_and_keeps_the_state(tmp_path):
    data = batches(3)
    cfg = config(tmp_path, watermark_column=None, late_events="drop")
    with new_job(cfg) as job:
        first = job.process_batch(data[0])["main"]

    class SkuCounts(IdleCounts):
        """IdleCounts after the key column was renamed: the same states."""

        def process_key(self, key: Any, rows: pa.Table, ctx: Context) -> list[dict[str, Any]]:
            out = super().process_key(key, rows, ctx)
            return [{"sku": r.pop("user_id"), **r} for r in out]

        def on_timer(self, timestamp: int, ctx: Context) -> None:
            ctx.output("idle", {"sku": ctx.current_key, "at": timestamp,
                                "count": self.count_state.value()})
            self.last_state.clear()

    def renamed(config: Any) -> LocalJob:
        return LocalJob(SkuCounts(), key_columns=["sku"], input_schema=SKU_INPUT,
                        output_schema=COUNT_SCHEMA.replace("user_id", "sku"),
                        side_outputs={"idle": "sku string, at bigint, count bigint"},
                        config=config)

    with pytest.raises(JobMismatchError, match=r"key columns \['user_id'\].*\['sku'\]"):
        renamed(cfg)
    with renamed(cfg.replace(allow_job_change=True)) as job:
        second = job.process_batch(sku_batch(data[1]))["main"]
    # The counts went on from the state keyed by the old column's values.
    before = dict(zip(first.column("user_id").to_pylist(), first.column("count").to_pylist()))
    seen = data[1].group_by("user_id").aggregate([("user_id", "count")]).to_pylist()
    after = dict(zip(second.column("sku").to_pylist(), second.column("count").to_pylist()))
    for row in seen:
        assert after[row["user_id"]] == before.get(row["user_id"], 0) + row["user_id_count"]
    with renamed(cfg) as job:  # the new name is recorded: no option needed any more
        job.process_batch(sku_batch(data[2]))


def test_documented_evolutions_start_without_the_option(tmp_path):
    """Adding a state, dropping one (drop_states) and evolving a type are no job change."""

    class WithExtra(IdleCounts):
        extra = ValueStateDescriptor("extra", "bigint")

        def open(self, ctx: Context) -> None:
            super().open(ctx)
            ctx.get_state(self.extra)

    class OnlyExtra(IdleCounts):
        def open(self, ctx: Context) -> None:
            self.count_state = ctx.get_state(ValueStateDescriptor("extra", "bigint"))
            self.last_state = ctx.get_state(ValueStateDescriptor("last2", "bigint"))

    data = batches(3)
    cfg = config(tmp_path)
    with new_job(cfg) as job:
        job.process_batch(data[0])
    with new_job(cfg, WithExtra()) as job:  # a state added
        job.process_batch(data[1])
    # Every old state dropped on purpose and new ones declared: drop_states says so.
    with new_job(cfg.replace(drop_states=("count", "last")), OnlyExtra()) as job:
        job.process_batch(data[2])


def test_a_job_without_recorded_key_columns_still_starts(tmp_path):
    """Checkpoints written before the identity was recorded (no key columns, no function):
    the start checks what is there (key types, states)."""
    import msgspec

    from keyedstate.checkpoint.properties import JOB_FUNCTION
    from keyedstate.processor.canonical import PROP_KEY_COLUMNS
    from keyedstate.storage.checkpoint_storage import CheckpointStorage

    data = batches(2)
    cfg = config(tmp_path)
    with new_job(cfg) as job:
        job.process_batch(data[0])
        latest = job.latest_checkpoint
    storage = CheckpointStorage(cfg.checkpoint_dir)
    props = {k: v for k, v in latest.metadata.properties.items()
             if k not in (PROP_KEY_COLUMNS, JOB_FUNCTION)}
    storage.write_metadata(msgspec.structs.replace(latest.metadata, properties=props),
                           latest.metadata_path)
    with new_job(cfg) as job:
        job.process_batch(data[1])
    with pytest.raises(JobMismatchError, match="stock"):
        sku_job(cfg)


# -- restarting a job started from a snapshot --------------------------------------------------

@pytest.mark.parametrize("again", ["same", "none", "other"])
def test_restart_of_a_job_started_from_a_savepoint_resumes_its_own_checkpoints(
        tmp_path, again, caplog):
    """Own checkpoints win: the restart resumes the job's latest checkpoint whatever restore
    path it is given (the same, none, another one: logged), as docs/restore-modes.md says."""
    data = batches(4)
    with new_job(config(tmp_path / "one")) as job:
        outputs = [job.process_batch(t) for t in data[:2]]
        job.stop(savepoint=str(tmp_path / "savepoint"))
    with new_job(config(tmp_path / "other")) as job:
        job.process_batch(data[0])
        job.stop(savepoint=str(tmp_path / "other-savepoint"))
    cfg = config(tmp_path / "two", restore_path=str(tmp_path / "savepoint"))
    with new_job(cfg) as job:
        outputs.append(job.process_batch(data[2]))
    restart = {"same": cfg, "none": cfg.replace(restore_path=None),
               "other": cfg.replace(restore_path=str(tmp_path / "other-savepoint"))}[again]
    with caplog.at_level(logging.WARNING, logger="keyedstate"):
        with new_job(restart) as job:
            assert job.last_batch_id == 2
            outputs.append(job.process_batch(data[3]))
            outputs.append(job.drain())
    assert rows(outputs) == reference(tmp_path, data, "rocksdb")
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert bool(ignored) == (again == "other"), ignored
    # The lineage stays that of the first start.
    latest = job.latest_checkpoint
    assert latest.metadata.properties["restored_from"] == str(tmp_path / "savepoint")


# -- advice that works when followed ------------------------------------------------------------

def corrupt(path: Any) -> None:
    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"garbage")


def test_corrupt_latest_checkpoint_advice_works_when_followed(tmp_path):
    """No readable checkpoint: the advice (restore from a savepoint into a new checkpoint
    directory) works as written; the corrupt directory is left as it was."""
    data = batches(3)
    cfg = config(tmp_path)
    with new_job(cfg) as job:
        job.process_batch(data[0])
        job.savepoint(str(tmp_path / "savepoint"))
        job.process_batch(data[1])
        latest = job.latest_checkpoint
    corrupt(tmp_path / "ckpt" / latest.metadata_path)
    before = files_under(str(tmp_path / "ckpt"))
    with pytest.raises(CorruptCheckpointError, match="new checkpoint directory") as refused:
        new_job(cfg.replace(restore_path=str(tmp_path / "savepoint")))
    assert "Nothing was deleted" in str(refused.value)
    assert files_under(str(tmp_path / "ckpt")) == before
    with new_job(config(tmp_path / "new", restore_path=str(tmp_path / "savepoint"))) as job:
        assert job.last_batch_id == 0
        job.process_batch(data[1])


@pytest.mark.parametrize("retained", [2, 1])
def test_gc_advice_on_a_corrupt_checkpoint_works_when_followed(tmp_path, retained):
    """gc refuses a directory with an unreadable _metadata; its advice works as written:
    with an older readable checkpoint, run the job until a newer checkpoint subsumes the
    corrupt one; without one, restore from a savepoint into a new directory."""
    data = batches(3)
    cfg = config(tmp_path, num_retained=retained)
    with new_job(cfg) as job:
        job.process_batch(data[0])
        job.savepoint(str(tmp_path / "savepoint"))
        job.process_batch(data[1])
        latest = job.latest_checkpoint
    corrupt(tmp_path / "ckpt" / latest.metadata_path)
    with pytest.raises(CorruptCheckpointError, match="keyedstate checkpoints show") as refused:
        find_garbage(cfg.checkpoint_dir)
    if retained == 2:
        assert "run the job until it completes a checkpoint" in str(refused.value)
        with new_job(cfg) as job:
            job.process_batch(data[1])
            job.process_batch(data[2])
        assert find_garbage(cfg.checkpoint_dir).files == []
    else:
        assert "restore it from a savepoint into a new checkpoint directory" in str(
            refused.value)
        new = config(tmp_path / "new", restore_path=str(tmp_path / "savepoint"))
        with new_job(new) as job:
            job.process_batch(data[1])
        assert find_garbage(new.checkpoint_dir).files == []


# -- errors at start -----------------------------------------------------------------------------

def test_canonical_savepoint_of_another_key_type_is_refused_at_start(tmp_path):
    """The job's DDL types named, before any batch, nothing written."""
    with new_job(config(tmp_path / "one")) as job:
        job.process_batch(batches(1)[0])
        job.stop(savepoint=str(tmp_path / "savepoint"), format="canonical")
    cfg = config(tmp_path / "two", restore_path=str(tmp_path / "savepoint"))
    with pytest.raises(JobMismatchError, match=r"\['string'\].*\['bigint'\]"):
        LocalJob(Stock(), key_columns=["sku"], input_schema="sku bigint, ts timestamp",
                 output_schema="sku bigint, stock bigint", config=cfg)
    assert not os.path.exists(tmp_path / "two" / "ckpt")
