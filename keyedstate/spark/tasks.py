"""The Spark side of a batch's subtasks: the ``mapInArrow`` function, one Spark task running
one subtask or a contiguous group of them (:mod:`keyedstate.runtime.subtask` does the work)."""

from __future__ import annotations

from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from keyedstate.runtime.failures import subtask_failed
from keyedstate.runtime.grouping import subtasks_of_task
from keyedstate.runtime.live_copies import catch_up_in_background
from keyedstate.runtime.prefetch import prefetch_in_background
from keyedstate.runtime.subtask import BatchPlan, process_group, process_subtask, restorer
from keyedstate.runtime.wire import SUBTASK_COLUMN


def run_subtask(plan: BatchPlan, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function: the subtasks of one Spark task of one batch (see the module
    docstring), one after another, one result row each; then, with
    ``plan.background_catch_up``, the worker's other live copies of the job caught up (or, with
    ``plan.background_restore``, restored) in the background
    (:mod:`keyedstate.runtime.live_copies`), or, with ``plan.background_prefetch``, the files
    they lack fetched into the file cache (:mod:`keyedstate.runtime.prefetch`)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:  # only a Spark task has one
        raise RuntimeError("run_subtask runs inside a Spark task (mapInArrow), not on the driver")
    subtasks = subtasks_of_task(context.partitionId(), plan.tasks, plan.parallelism)
    checked = routed_to(plan.batch_id, subtasks, batches)
    if plan.tasks == plan.parallelism:
        yield from process_subtask(plan, subtasks[0], checked)
    else:
        yield from process_group(plan, subtasks, checked)
    if plan.background_catch_up:
        # The worker idles until its next task: its copies of the job's other subtasks are
        # brought to this batch's checkpoint meanwhile, once the driver commits it; in the
        # asynchronous mode, which completes it only beside the next batch's tasks (planned on
        # it in flight), once every subtask acknowledged its upload of it.
        catch_up_in_background(plan.job_id, plan.start_id, plan.storage, plan.checkpoint_id,
                               restorer(plan) if plan.background_restore else None,
                               in_flight=plan.parallelism if plan.async_upload else None)
    if plan.background_prefetch:  # the asynchronous mode only (JobConfig)
        # The next batch's tasks start at once (no idle worker to catch copies up in): only
        # fetch the files a restore of a moved subtask here would need.
        prefetch_in_background(plan.job_id, plan.start_id, plan.storage, plan.checkpoint_id,
                               plan.parallelism)


def routed_to(batch_id: int, subtasks: range, batches: Iterator[pa.RecordBatch]
              ) -> Iterator[pa.RecordBatch]:
    """``batches``, refused (``BatchFailedError``) if a row belongs to a subtask this task does
    not run: a routing that put it here would otherwise lose it (a group keeps its subtasks'
    rows only) or run it against the wrong state."""
    for batch in batches:
        if batch.num_rows:
            low, high = pc.min_max(batch.column(SUBTASK_COLUMN)).values()
            if low.as_py() < subtasks.start or high.as_py() >= subtasks.stop:
                raise subtask_failed(batch_id, subtasks.start, "routing failed with",
                                     RuntimeError(
                    f"Spark task for subtasks {subtasks.start}-{subtasks.stop - 1} got rows of "
                    f"subtasks {low.as_py()}-{high.as_py()}"))
        yield batch
