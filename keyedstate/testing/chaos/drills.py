"""Corruption drills: damage one file of a job's latest checkpoint, restore, judge the outcome.

A drill works on a **copy** of a job's checkpoint directory (the real job never sees it):

1. copy the directory (a local copy, also for an object store);
2. damage one file of the latest checkpoint (:func:`damage_file`): a **shared** file (an SST
   or heap chain file that later checkpoints may reference too), a **private** file (MANIFEST,
   OPTIONS, meta) or ``_metadata``, by **truncating** it to half, **flipping** one byte, or
   **deleting** it;
3. restore exactly as a restarted Spark driver does (:func:`spark_drill`: a new
   ``KeyedJobDriver`` over the copy, then the batch Spark would deliver next: the one after the
   latest checkpoint's batch, or, in a *replay* drill, that batch again, as after a crash
   before Spark recorded it);
4. judge (:class:`DrillResult`): the restore must either **fail with a clear error** (a
   keyedstate error), or succeed and produce exactly the oracle's output for the batch (the
   latest checkpoint was intact where it mattered, or recovery **fell back** to an older
   retained checkpoint and the batch replays from there, which its recovery notes say).
   Output that differs from the oracle is **silent wrong state**: a violation.

A **positions drill** (:func:`positions_drill`) works on a copy of a job's savepoint: without
its ``context/`` (Spark's offset log and any uncommitted output it carries), restored in a
new Spark checkpoint location, the start must be refused with
:class:`~keyedstate.errors.SourcePositionsError` and leave nothing behind: no file in the new
checkpoint directory, the new location or the output, the savepoint not claimed. A job that
starts would read its source again from the beginning.
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from keyedstate.checkpoint.savepoint import CONTEXT_DIR
from keyedstate.errors import KeyedStateError, SourcePositionsError
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import CLAIM_MARKER_FILE

#: a drill's outcomes; only ``silent-wrong`` is a violation
OUTCOMES = ("error", "fallback", "restored", "silent-wrong")


@dataclass
class Damage:
    checkpoint_id: int
    batch_id: int
    target: str
    damage: str
    file: str
    size: int


def damage_file(root: str, target: str, damage: str, rng: random.Random) -> Damage:
    """Damage one file of the latest checkpoint under the local directory ``root``."""
    storage = CheckpointStorage(root)
    latest = storage.checkpoint_ids()[-1]
    metadata_path = storage.metadata_path(latest)
    metadata = storage.read_metadata(metadata_path)
    if target == "metadata":
        relative = metadata_path
    else:
        # Stored objects only: a file inlined in _metadata has none (damaging it is damaging
        # _metadata), a merged small file is a segment of an object.
        files = sorted({s.path for h in metadata.handles
                        for s in (h.shared if target == "shared" else h.private).values()
                        if getattr(s, "data", None) is None and s.path})
        if not files:  # e.g. a heap checkpoint, or every private file inlined
            files = sorted({f.path for f in metadata.files()})
        relative = rng.choice(files)
    path = os.path.join(root, relative)
    size = os.path.getsize(path)
    if damage == "truncate":
        os.truncate(path, size // 2)
    elif damage == "flip":
        with open(path, "r+b") as f:
            at = rng.randrange(max(1, size))
            f.seek(at)
            byte = f.read(1) or b"\0"
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "delete":
        os.remove(path)
    else:
        raise ValueError(f"unknown damage {damage!r}")
    return Damage(latest, int(metadata.properties.get("batch_id", "-1")), target, damage,
                  relative, size)


@dataclass
class DrillResult:
    outcome: str
    target: str
    damage: str
    file: str
    checkpoint_id: int
    num_retained: int
    batches: list[int] = field(default_factory=list)
    restored_checkpoint: int | None = None
    recovery_notes: list[str] = field(default_factory=list)
    error: str = ""
    #: the error is keyedstate's (typed), not an arbitrary crash
    clear_error: bool = False
    #: the error message names the damaged file or its checkpoint
    names_file: bool = False
    mismatches: list[str] = field(default_factory=list)

    @property
    def violation(self) -> bool:
        return self.outcome == "silent-wrong" or (self.outcome == "error" and not self.clear_error)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "violation": self.violation}


def copy_job_dir(url: str, storage_options: dict[str, Any], target: str) -> None:
    shutil.rmtree(target, ignore_errors=True)
    storage = CheckpointStorage(url, storage_options)
    if storage.is_local:
        shutil.copytree(storage.root, target)
    else:
        os.makedirs(target)
        for relative in storage.list_files():
            local = os.path.join(target, relative)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            storage.fs.get_file(storage.path(relative), local)


def _error_text(exc: BaseException) -> str:
    text = str(exc)
    at = text.find("keyedstate.errors.")
    if at >= 0:
        return text[at:].split("\n", 1)[0][:600]
    return f"{type(exc).__name__}: {text.splitlines()[0][:600] if text else ''}"


def spark_drill(spark: Any, plan: Any, run_dir: str, job: Any,
                build_job: Callable[..., Any]) -> dict[str, Any]:
    """Run the job's planned drill (``job.drill``) on a copy of its checkpoint directory and
    return :meth:`DrillResult.to_json`."""
    from keyedstate.testing.chaos.driver import job_config, spark_location
    from keyedstate.testing.chaos.workload import INPUT_DDL, input_file_name

    drill = job.drill
    rng = random.Random(drill["seed"])
    # A directory of its own per drill run: a drill that ends in an error may leave Spark tasks
    # of its failed batch running for a moment, and they write into the drill's checkpoint
    # directory (its staging/); a later drill reusing the path would collide with them.
    scratch = os.path.join(run_dir, "drills", f"job-{job.index:03d}-{uuid.uuid4().hex[:8]}")
    root = os.path.join(scratch, "ckpt")
    copy_job_dir(plan.job_dir(job.index), plan.storage_options, root)
    dmg = damage_file(root, drill["target"], drill["damage"], rng)
    result = DrillResult("restored", dmg.target, dmg.damage, dmg.file, dmg.checkpoint_id,
                         job.num_retained)
    # The batch Spark delivers next (its latest batch is recorded), or in a replay drill
    # that batch again (a crash before Spark recorded it), then the next one.
    nxt = dmg.batch_id + 1
    if plan.file_of_batch(nxt) is None:
        result.batches = [dmg.batch_id]
    else:
        result.batches = [dmg.batch_id, nxt] if drill["replay"] else [nxt]
    # The definition in force at the job's end (no definition changes at a job's last file).
    definition = plan.definition_of_file(job.end_file)
    # Synchronous, whatever the job's mode: the drill judges each batch's output as its call
    # returns (an asynchronous job's checkpoints restore in either mode).
    cfg = job_config(plan, run_dir, job, rng.randint(1, 4), definition, "sync").replace(
        checkpoint_dir=root, restore_mode="NO_CLAIM", storage_options={},
        local_dir=os.path.join(run_dir, "local"))
    out = os.path.join(scratch, "out")
    generated = os.path.join(run_dir, "generated")
    try:
        static = spark.read.schema(INPUT_DDL).parquet(
            os.path.join(generated, input_file_name(_file(plan, result.batches[0]))))
        # A copy of the job's Spark checkpoint location too: a start on an asynchronous
        # job's checkpoints may rewind it (docs/checkpoints.md, point 10).
        location = os.path.join(scratch, "spark")
        shutil.copytree(spark_location(run_dir, job), location)
        driver = build_job(static, None, out, None, definition=definition).driver(
            cfg, location)
        latest = driver.coordinator.latest_completed
        result.restored_checkpoint = latest.checkpoint_id if latest is not None else None
        result.recovery_notes = list(driver.coordinator.recovery_notes)
        processed = []
        for batch in result.batches:
            df = spark.read.schema(INPUT_DDL).parquet(
                os.path.join(generated, input_file_name(_file(plan, batch))))
            driver.process_batch(df, batch)
            if not driver.stats[-1].skipped_replay:
                processed.append(batch)
    except Exception as exc:  # noqa: BLE001 - judged below
        result.outcome = "error"
        result.error = _error_text(exc)
        result.clear_error = isinstance(exc, KeyedStateError) or "keyedstate.errors." in str(exc)
        name = os.path.basename(dmg.file)
        result.names_file = name in str(exc) or f"chk-{dmg.checkpoint_id}" in str(exc)
        return result.to_json()
    from keyedstate.testing.chaos.compare import compare_main, read_sink

    # Every branch of the run agrees on the state at each batch (a rollback reruns one batch
    # with the same file and definition), so the run's schedule gives the batch's rows. A
    # batch the drill did not process but whose output it committed (the recovered
    # checkpoint's pending output: committed at the start, as Spark had logged the batch in
    # the asynchronous mode, or by a replay) is judged as well.
    found = read_sink(os.path.join(out, "main"))
    committed = sorted({int(b) for b in found["_file_batch"]} - set(processed)) \
        if len(found) else []
    expected = [r for b in sorted(set(processed) | set(committed))
                for r in oracle_rows(generated, b, plan.schedule(), plan.definitions())]
    comparison = compare_main(expected, os.path.join(out, "main"))
    if comparison.violations:
        result.outcome = "silent-wrong"
        result.mismatches = comparison.examples
    elif result.restored_checkpoint != dmg.checkpoint_id:
        result.outcome = "fallback"
    shutil.rmtree(scratch, ignore_errors=True)
    return result.to_json()


def _file(plan: Any, batch: int) -> int:
    file = plan.file_of_batch(batch)
    assert file is not None, f"batch {batch} reads no input file"
    return int(file)


def positions_drill(spark: Any, plan: Any, run_dir: str, job: Any,
                    build_job: Callable[..., Any]) -> dict[str, Any]:
    """Restore ``job``'s savepoint, without its ``context/``, in a new checkpoint directory
    and a new Spark checkpoint location, as the next job would (its restore mode): judged in
    the module docstring. Returns ``outcome`` (``refused``, ``started`` or ``other-error``),
    ``error``, ``left`` (files written), ``claimed`` and ``violation``."""
    from keyedstate.testing.chaos.driver import job_config
    from keyedstate.testing.chaos.workload import INPUT_DDL, input_file_name

    following = plan.jobs[job.index + 1]
    scratch = os.path.join(run_dir, "drills",
                           f"positions-{job.index:03d}-{uuid.uuid4().hex[:8]}")  # as above
    savepoint = os.path.join(scratch, "savepoint")
    copy_job_dir(plan.savepoint_dir(job.index), plan.storage_options, savepoint)
    shutil.rmtree(os.path.join(savepoint, CONTEXT_DIR))
    written = {name: os.path.join(scratch, name) for name in ("ckpt", "spark", "out")}
    definition = plan.definition_of_file(job.end_file)
    cfg = job_config(plan, run_dir, following, following.parallelism, definition).replace(
        checkpoint_dir=written["ckpt"], restore_path=savepoint, storage_options={},
        local_dir=os.path.join(run_dir, "local"), on_rollback="refuse")
    result: dict[str, Any] = {"outcome": "refused", "mode": following.restore_mode,
                              "format": job.savepoint_format, "error": ""}
    try:
        static = spark.read.schema(INPUT_DDL).parquet(
            os.path.join(run_dir, "generated", input_file_name(0)))
        build_job(static, None, written["out"], None, definition=definition).driver(
            cfg, written["spark"])
        result["outcome"] = "started"
    except SourcePositionsError as exc:
        result["error"] = _error_text(exc)
    except Exception as exc:  # noqa: BLE001 - judged below
        result["outcome"] = "other-error"
        result["error"] = _error_text(exc)
    result["left"] = sorted(os.path.relpath(os.path.join(folder, name), scratch)
                            for path in written.values()
                            for folder, _, names in os.walk(path) for name in names)[:20]
    result["claimed"] = os.path.exists(os.path.join(savepoint, CLAIM_MARKER_FILE))
    result["violation"] = (result["outcome"] != "refused" or bool(result["left"])
                           or result["claimed"])
    if not result["violation"]:
        shutil.rmtree(scratch, ignore_errors=True)
    return result


_oracle_cache: dict[tuple[str, tuple[tuple[int, int | None], ...] | None,
                          tuple[tuple[int, int], ...] | None],
                    tuple[Any, dict[int, list[dict[str, Any]]]]] = {}


def oracle_rows(generated: str, batch: int,
                schedule: list[tuple[int, int | None]] | None = None,
                definitions: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """The oracle's main output of one batch (one oracle kept per input, schedule and
    definitions, advanced as asked; without a schedule batch ``b`` reads file ``b``)."""
    from keyedstate.testing.chaos.oracle import Oracle

    key = (generated, tuple(schedule) if schedule is not None else None,
           tuple(sorted(definitions.items())) if definitions else None)
    entry = _oracle_cache.get(key)
    if entry is None or entry[0].state.batch_id >= batch and batch not in entry[1]:
        entry = (Oracle(generated, schedule, definitions), {})
        _oracle_cache[key] = entry
    oracle, rows = entry
    while oracle.state.batch_id < batch:
        b = oracle.state.batch_id + 1
        rows[b] = oracle.step(b)[0]
    return rows[batch]
