"""The Spark side of a batch's subtasks: the ``mapInArrow`` function, one Spark task running
one subtask or a contiguous group of them (:mod:`keyedstate.runtime.subtask` does the work)."""

from __future__ import annotations

from typing import Iterator

import pyarrow as pa

from keyedstate.runtime.subtask import BatchPlan, process_group, process_subtask, subtasks_of_task


def run_subtask(plan: BatchPlan, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function: the subtasks of one Spark task of one batch (see the module
    docstring), one after another, one result row each."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:  # only a Spark task has one
        raise RuntimeError("run_subtask runs inside a Spark task (mapInArrow), not on the driver")
    if plan.tasks == plan.parallelism:
        return process_subtask(plan, context.partitionId(), batches)
    return process_group(
        plan, subtasks_of_task(context.partitionId(), plan.tasks, plan.parallelism), batches)
