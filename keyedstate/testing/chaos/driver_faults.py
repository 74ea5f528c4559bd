"""The soak's faults in the driver process (planned by :mod:`keyedstate.testing.chaos.plan`): SIGKILL
of the driver after each step of the checkpoint commit (``CheckpointCoordinator._complete_steps``
yields after each), around the sink commit, before the staging clean-up, and at a ``crash`` job
end; a failing ``_metadata`` write (an aborted checkpoint); transient storage errors after the
checkpoint commit (the sink-commit marker write, the staging delete, a batch listener); and
the driver's ``async`` faults of the asynchronous phase: SIGKILL as the oldest checkpoint in
flight starts to complete (Spark has logged its batch as done), a
:class:`~keyedstate.errors.TransientStorageError` writing its ``_metadata`` or registering its
files, SIGKILL right before and right after the sink commit of the completed checkpoint (the
crash points are in :class:`~keyedstate.testing.chaos.driver.ChaosSink`).

:func:`install_driver_hooks` wraps keyedstate's classes in this process only; keyedstate
itself has no fault hook. Each fault fires once (its marker first, ``O_EXCL``); a storage
error fires its ``times`` first calls in a driver.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, Iterator

from keyedstate.checkpoint.coordinator import CheckpointCoordinator
from keyedstate.checkpoint.registry import SharedStateRegistry
from keyedstate.errors import TransientStorageError
from keyedstate.runtime.inflight import InFlightCheckpoints
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata
from keyedstate.storage.layout import COMMITS_DIR, STAGING_DIR
from keyedstate.testing.chaos.plan import Job, Plan
from keyedstate.testing.chaos.workload import INJECTED, claim_marker, marker_path


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


#: where a ``crash`` job end kills the driver: the main sink's commit of the job's last batch,
#: before anything (its checkpoint is complete, its output not committed)
BOUNDARY_CRASH = "boundary-crash"


def boundary_crash_id(plan: Plan, job: Job) -> str:
    return f"boundary-{job.index:03d}-b{plan.end_batch(job)}"


class DriverFaults:
    """The plan's driver-side faults, each fired once (marker first); storage errors fire
    their ``times`` first calls in this driver."""

    def __init__(self, run_dir: str, plan: Plan) -> None:
        self.run_dir = run_dir
        self.by_point: dict[tuple[int, str], dict[str, Any]] = {
            (f["batch"], f["point"]): f for f in plan.driver_faults}
        for job in plan.jobs[:-1]:
            if job.stop == "crash":
                batch = plan.end_batch(job)
                self.by_point[(batch, BOUNDARY_CRASH)] = {
                    "id": boundary_crash_id(plan, job), "batch": batch, "kind": "boundary",
                    "point": BOUNDARY_CRASH}
        self.storage: dict[tuple[int, str], dict[str, Any]] = {
            (f["batch"], f["point"]): f for f in plan.storage_faults}
        self._storage_failed: dict[str, int] = {}
        #: off while a drill, the second job or a directory check runs (the hooks are
        #: process-wide)
        self.paused = False
        #: the running query's Spark checkpoint location (set by ``run_job``)
        self.spark_location: str | None = None
        #: the driver whose start-up commits a completed checkpoint's pending output (an
        #: asynchronous job's restart): a sink savepoint taken in that commit needs it
        self.starting: Any = None

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused

    def due(self, batch: int, point: str) -> dict[str, Any] | None:
        fault = self.by_point.get((batch, point))
        if self.paused or fault is None or os.path.exists(marker_path(self.run_dir,
                                                                      fault["id"])):
            return None
        return fault

    def crash(self, batch: int, point: str, **info: Any) -> None:
        fault = self.due(batch, point)
        if fault is not None and claim_marker(self.run_dir, fault["id"], kind="kill_driver",
                                              at=point, batch=batch, **info):
            _die()

    def fail_async(self, batch: int, point: str, checkpoint_id: int) -> None:
        """Raise an ``async`` fault's :class:`TransientStorageError` at ``point`` of
        ``batch``'s checkpoint, once."""
        fault = self.due(batch, point)
        if fault is not None and claim_marker(self.run_dir, fault["id"], kind="storage",
                                              at=point, batch=batch,
                                              checkpoint_id=checkpoint_id):
            raise TransientStorageError(
                f"{INJECTED} transient storage error at {point} of checkpoint "
                f"{checkpoint_id} (batch {batch}) (fault {fault['id']})")

    def spark_committed(self, batch: int) -> bool | None:
        """Whether Spark's commit log records ``batch`` as done (None: no query runs)."""
        if self.spark_location is None:
            return None
        return os.path.exists(os.path.join(self.spark_location, "commits", str(batch)))

    def fail_storage(self, batch: int, point: str) -> None:
        """Raise the :class:`TransientStorageError` an object store whose retries ran out
        raises, if the plan has one at ``point`` of ``batch`` not yet raised ``times`` times
        (a fault whose marker an earlier driver claimed is done)."""
        fault = self.storage.get((batch, point))
        if self.paused or fault is None:
            return
        failed = self._storage_failed.get(fault["id"], 0)
        if failed >= fault["times"]:
            return
        if failed == 0 and not claim_marker(self.run_dir, fault["id"], kind="storage", at=point,
                                            batch=batch, times=fault["times"]):
            return
        self._storage_failed[fault["id"]] = failed + 1
        raise TransientStorageError(
            f"{INJECTED} transient storage error at {point} of batch {batch}, {failed + 1} of "
            f"{fault['times']} (fault {fault['id']})")


def install_driver_hooks(faults: DriverFaults) -> None:
    """Wrap keyedstate's commit path in this process (see the module docstring)."""
    def complete(self: CheckpointCoordinator, pending: Any, properties: Any = None) -> Any:
        batch = int(pending.properties.get("batch_id", "-1"))
        for step in self._complete_steps(pending, properties):
            faults.crash(batch, f"commit-step-{step}")
        return pending.completed

    CheckpointCoordinator.complete = complete  # type: ignore[method-assign]
    write_metadata = CheckpointStorage.write_metadata

    def failing_write_metadata(self: CheckpointStorage, metadata: CheckpointMetadata,
                               relative: str | None = None) -> str:
        if relative is None and "tokens" in metadata.properties:  # a batch's checkpoint
            batch = int(metadata.properties.get("batch_id", "-1"))
            faults.fail_async(batch, "metadata-error", metadata.checkpoint_id)
            fault = faults.due(batch, "metadata-write")
            if fault is not None and claim_marker(faults.run_dir, fault["id"], kind="abort",
                                                  at="metadata-write", batch=batch):
                raise OSError(f"{INJECTED} _metadata write failure of checkpoint "
                              f"{metadata.checkpoint_id} (fault {fault['id']})")
        return write_metadata(self, metadata, relative)

    CheckpointStorage.write_metadata = failing_write_metadata  # type: ignore[method-assign]
    delete_dir = CheckpointStorage.delete_dir
    staging = f"{STAGING_DIR}/batch-"

    def crashing_delete_dir(self: CheckpointStorage, relative: str) -> None:
        if relative.startswith(staging):
            batch = int(relative[len(staging):])
            faults.crash(batch, "staging-cleanup")
            faults.fail_storage(batch, "staging-delete")
        delete_dir(self, relative)

    CheckpointStorage.delete_dir = crashing_delete_dir  # type: ignore[method-assign]
    write = CheckpointStorage.write
    markers = f"{COMMITS_DIR}/batch-"

    def failing_write(self: CheckpointStorage, relative: str, data: bytes) -> Any:
        if relative.startswith(markers):
            faults.fail_storage(int(relative[len(markers):].split("-", 1)[0]), "marker-write")
        return write(self, relative, data)

    CheckpointStorage.write = failing_write  # type: ignore[method-assign]

    from keyedstate.spark.driver import KeyedJobDriver  # this process runs Spark

    commit_if_pending = KeyedJobDriver._commit_if_pending

    def starting_commit(self: KeyedJobDriver, completed: Any) -> None:
        faults.starting = self
        try:
            commit_if_pending(self, completed)
        finally:
            faults.starting = None

    KeyedJobDriver._commit_if_pending = starting_commit  # type: ignore[method-assign]
    register_all = SharedStateRegistry.register_all

    def failing_register_all(self: SharedStateRegistry, metadata: CheckpointMetadata, *,
                             owned: bool = True) -> None:
        if "tokens" in metadata.properties:  # a batch's checkpoint, completing (step 4)
            faults.fail_async(int(metadata.properties.get("batch_id", "-1")), "registry-error",
                              metadata.checkpoint_id)
        register_all(self, metadata, owned=owned)

    SharedStateRegistry.register_all = failing_register_all  # type: ignore[method-assign]
    complete_oldest = InFlightCheckpoints.complete_oldest

    def crashing_complete_oldest(self: InFlightCheckpoints, *args: Any, **kwargs: Any) -> Any:
        oldest = next(iter(self))
        faults.crash(oldest.batch_id, "kill-before-completion",
                     checkpoint_id=oldest.checkpoint_id,
                     spark_committed=faults.spark_committed(oldest.batch_id))
        return complete_oldest(self, *args, **kwargs)

    InFlightCheckpoints.complete_oldest = crashing_complete_oldest  # type: ignore[method-assign]
