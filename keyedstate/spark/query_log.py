"""A job's Spark query as its offset log records it, and the start-up steps that align it with
the job's checkpoints.

Spark numbers a query's batches in its checkpoint location (``offsets/``, ``commits/``:
:mod:`keyedstate.spark.offsets`); keyedstate's checkpoints record the batch they cover and the
query's id. At start the two must tell one story, or the source is read again, skipped or
doubled:

- a new job from a snapshot resumes its source exactly after the snapshot's batch
  (:meth:`QueryLog.resume`: the snapshot's own location, or a new one seeded from the offset
  log the snapshot carries; a new location is a new lineage branch, refused over sinks that
  hold the parent's later batches unless ``keyedstate.sinks.on-rollback`` is ``branch``);
- a restart refuses a location that holds another query, or none, than the one the
  checkpoints cover (:meth:`QueryLog.check_query`);
- a start after a crash in the asynchronous mode makes Spark run again the batches it
  recorded as done whose checkpoints were still in flight (:meth:`QueryLog.rewind`), whether
  the crashed start's checkpoints or its job's marker (:func:`mark_async_start`,
  :func:`async_bound`) tell that it ran asynchronously.

Every step reads or writes the offset log only; nothing here imports pyspark.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterable, Mapping

from keyedstate.checkpoint.coordinator import CompletedCheckpoint
from keyedstate.checkpoint.properties import BATCH_ID, JOB_CONFIG
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.config import JobConfig, OnRollback, SourcePositions
from keyedstate.errors import SinkRollbackError, SourcePositionsError
from keyedstate.spark.carry import source_log_of
from keyedstate.spark.offsets import (
    OFFSETS,
    PROP_QUERY_ID,
    PROP_SPARK_CHECKPOINT_LOCATION,
    Branch,
    OffsetLog,
    rewind,
    seed,
    seeded_branch,
)
from keyedstate.spark.sinks import Sink
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import ASYNC_MARKER_FILE

log = logging.getLogger("keyedstate")

#: the key of :data:`~keyedstate.storage.layout.ASYNC_MARKER_FILE`'s JSON, and of the setting a
#: checkpoint records in its ``job_config``
_BOUND_KEY = "keyedstate.checkpointing.max-concurrent-checkpoints"
_ASYNC_KEY = "keyedstate.checkpointing.async-upload"


def async_bound(storage: CheckpointStorage | None, latest: CompletedCheckpoint | None) -> int:
    """How many batches Spark may have logged as done beyond the job's state, their
    checkpoints in flight when a start of the job in the asynchronous mode ended: the largest
    ``max-concurrent-checkpoints`` that the job's marker
    (:data:`~keyedstate.storage.layout.ASYNC_MARKER_FILE`, in ``storage``, the job's root;
    None: not read) or the ``job_config`` of its ``latest`` checkpoint records; 0 when
    neither says the job ran asynchronously (Spark then logs a batch only after its
    checkpoint completed)."""
    bound = 0
    if latest is not None:
        recorded = json.loads(latest.metadata.properties.get(JOB_CONFIG, "{}"))
        if recorded.get(_ASYNC_KEY) is True:
            bound = int(recorded.get(_BOUND_KEY, 1))
    if storage is not None and storage.exists(ASYNC_MARKER_FILE):
        try:
            marked = int(json.loads(storage.read(ASYNC_MARKER_FILE)).get(_BOUND_KEY, 1))
        except (ValueError, AttributeError):  # a torn write: the smallest bound there is
            marked = 1
        bound = max(bound, marked, 1)
    return bound


def mark_async_start(storage: CheckpointStorage, max_concurrent_checkpoints: int) -> None:
    """Record in the job's root (``storage``), before a start in the asynchronous mode runs a
    batch, that Spark may log its batches as done before their checkpoints complete, and how
    many (:func:`async_bound`). The caller writes it only over a smaller bound: an earlier
    start's larger one is kept."""
    storage.write(ASYNC_MARKER_FILE,
                  json.dumps({_BOUND_KEY: max_concurrent_checkpoints}).encode())


class QueryLog:
    """The Spark query of one job: its checkpoint location ``location`` ("" for a job
    without one: then it has no query id, no branch, and its source positions can't be
    restored), read through ``storage_options``. The query id and the branch are read once
    (after :meth:`resume` may have seeded the location)."""

    def __init__(self, location: str, storage_options: Mapping[str, Any] | None) -> None:
        self.location = location
        self._storage_options = storage_options
        self._query_id: str | None = None
        self._branch: Branch | None = None
        self._branch_read = False

    def offset_log(self) -> OffsetLog:
        """Spark's offset log of this job (its location, which must be set)."""
        return OffsetLog.at(self.location, self._storage_options)

    def query_id(self) -> str:
        """The id of the Spark query whose batch ids this job's batches carry ("" without a
        Spark checkpoint location): it names the sinks' output, so that a replayed batch
        replaces its own output and never another job's."""
        if self._query_id is None:
            self._query_id = (self.offset_log().query_id() or "" if self.location else "")
        return self._query_id

    def branch(self) -> Branch | None:
        """The branch this job's query is (its location was seeded from a snapshot), None
        for a query Spark started itself."""
        if not self._branch_read:
            self._branch = self.offset_log().branch() if self.location else None
            self._branch_read = True
        return self._branch

    def properties(self) -> dict[str, str]:
        """What each checkpoint records of the query its batch ids belong to: the query id
        and, for a branch, its parent query and fork batch."""
        branch = self.branch()
        return {PROP_QUERY_ID: self.query_id(),
                **(branch.properties() if branch is not None else {})}

    def resume(self, snap: ResolvedSnapshot, config: JobConfig, sinks: Iterable[Sink], *,
               ahead: int = 0) -> int:
        """Restore the source positions of a snapshot this new job starts from; returns the
        Spark batch id its state covers in this job's location (-1: none).

        A snapshot covers Spark batch ``B`` of one query (Spark's batch ids mean something
        only within one offset log). The job resumes exactly after ``B`` (Flink's savepoints
        carry their sources' positions too):

        - in the snapshot's own Spark checkpoint location (if it got as far as ``B``): Spark
          resumes there after its last done batch; batches up to ``B`` are skipped as covered
          (a later one that is not, because the location moved on after the snapshot, is
          refused per batch by the driver's continuity check);
        - in a new, empty location: it is seeded with the offset log up to ``B``, from the copy
          a savepoint carries or from the snapshot's own location
          (:func:`keyedstate.spark.offsets.seed`), after :meth:`check_rollback` over ``sinks``;
          a location seeded so by an earlier start of this job is kept, also with up to
          ``ahead`` batches done after ``B`` (an asynchronous start crashed before its first
          checkpoint completed: :func:`async_bound`; the driver rewinds them);
        - nowhere, when neither exists or the job has no Spark checkpoint location: the source
          would be read again from the start of the new location, input the state already
          holds. Refused with :class:`SourcePositionsError`.

        With ``keyedstate.state-recovery.source-positions: ignore`` (a job over a new source,
        or reprocessing intended), and for a snapshot that covers no batch (bootstrapped by
        the state processor API), the source starts afresh.
        """
        props = snap.metadata.properties
        batch = int(props.get(BATCH_ID, -1))
        location = self.location
        where = snap.storage.url_of(snap.metadata_path)
        if batch < 0:
            return -1
        if config.source_positions is SourcePositions.IGNORE:
            log.warning("%s covers Spark batch %d of another query; its source positions are "
                        "not restored (keyedstate.state-recovery.source-positions: ignore): "
                        "the source starts from where %s starts", where, batch,
                        location or "the new query")
            return -1
        if location and props.get(PROP_SPARK_CHECKPOINT_LOCATION) == location:
            own = self.offset_log().batches(OFFSETS)
            if own and own[-1] >= batch:
                return batch
        carried = source_log_of(snap, config.storage_options) if location else None
        if carried is not None:
            parent = carried.query_id() or ""
            target = self.offset_log()
            if target.query_id() is None or seeded_branch(target, parent, batch) is not None:
                # A new branch of the snapshot's lineage (the seed gives it a query id of
                # its own): the sinks must not hold the parent's batches after the fork.
                self.check_rollback(snap, parent, batch, config.on_rollback, sinks)
            seed(target, carried, batch, ahead=ahead)
            return batch
        raise SourcePositionsError(
            f"{where} holds the state after Spark batch {batch} of query "
            f"{props.get(PROP_QUERY_ID, '?')}, but its source positions can't be restored: it "
            f"carries no copy of Spark's offset log, and its Spark checkpoint location "
            f"{props.get('spark_checkpoint_location') or '(none recorded)'} does not have that "
            f"batch's offsets. Started from "
            f"{location or 'a job without a Spark checkpoint location'}, the source would be "
            f"read again from its start and input the state already holds counted twice. "
            f"Restore a savepoint taken by keyedstate (it carries the positions), start in the "
            f"snapshot's own Spark checkpoint location, or set "
            f"keyedstate.state-recovery.source-positions=ignore if the job reads a new source "
            f"or reprocessing is intended"
        )

    def check_rollback(self, snap: ResolvedSnapshot, parent: str, batch: int,
                       on_rollback: OnRollback, sinks: Iterable[Sink]) -> None:
        """Before the source positions are seeded: refuse a restore into a new Spark
        checkpoint location over ``sinks`` that already hold batches of the snapshot's query
        ``parent`` after its batch ``batch`` (the old job went on after the snapshot: a
        rollback), unless ``on_rollback`` is ``branch``. The restored job is a new lineage
        either way (:func:`~keyedstate.spark.offsets.seed`), so nothing of its output is ever
        taken for a replay of those batches; the refusal keeps a sink from holding two
        branches that a reader of everything would mix. Reads only."""
        held = {}
        for sink in sinks:
            batches = sink.batches_after(parent, batch)
            if batches:
                held[sink.describe()] = batches
        if not held:
            return
        where = snap.storage.url_of(snap.metadata_path)
        found = "; ".join(f"{name}: batches {_batch_list(ids)}" for name, ids in held.items())
        if on_rollback is OnRollback.BRANCH:
            log.info("%s covers batch %d of query %s, whose later batches the sinks already "
                     "hold (%s); the restored job writes its batches beside them as a new "
                     "branch (keyedstate.sinks.on-rollback: branch)", where, batch, parent,
                     found)
            return
        raise SinkRollbackError(
            f"{where} holds the state after batch {batch} of query {parent}, but the sinks "
            f"already hold later batches of that query: {found}. Restored into the new Spark "
            f"checkpoint location {self.location}, the job rolls back: its "
            f"batches after {batch} are new output beside those, not replays of them. Nothing "
            f"was restored or written. Write to another path or table, or set "
            f"keyedstate.sinks.on-rollback=branch (JobConfig(on_rollback='branch')) to write "
            f"the restored job's batches as a new branch under a query id of its own (see "
            f"docs/sinks.md, 'Restarts, restores and rollbacks', for how readers select a "
            f"branch)"
        )

    def check_query(self, props: Mapping[str, str], checkpoint_dir: str) -> None:
        """Refuse a restart whose Spark checkpoint location holds another query than the one
        whose batches the checkpoints (in ``checkpoint_dir``; the latest's ``props``) cover:
        the location was deleted or replaced, Spark would number batches from 0 again, and
        batches the state covers would be skipped."""
        recorded = props.get(PROP_QUERY_ID)
        if not recorded or not self.location:
            return
        current = self.offset_log().query_id()
        if current is not None and current != recorded:
            raise SourcePositionsError(
                f"the Spark checkpoint location {self.location} holds query "
                f"{current}, but the checkpoints in {checkpoint_dir} cover batches of "
                f"query {recorded}: Spark would number its batches anew and the state would skip "
                f"or double input. Start with the query's own Spark checkpoint location, or take "
                f"a savepoint and start a new job from it in a new checkpoint directory"
            )
        if current is None and int(props.get(BATCH_ID, -1)) >= 0:
            raise SourcePositionsError(
                f"the Spark checkpoint location {self.location} is empty, but "
                f"the checkpoints in {checkpoint_dir} cover batches up to "
                f"{props['batch_id']} of query {recorded}: Spark would start the source from the "
                f"beginning and the state would skip or double input. Put the location back, "
                f"or take a savepoint (keyedstate savepoint create) and start a new job from it "
                f"in a new checkpoint directory"
            )

    def rewind(self, covered: int, bound: int, latest: CompletedCheckpoint | None,
               commit_pending_output: Callable[[CompletedCheckpoint], None]) -> None:
        """The start of a job that ran in the asynchronous mode (``bound`` > 0, from
        :func:`async_bound`; 0: never, nothing to do): Spark records a batch as done when
        ``foreachBatch`` returns, before its checkpoint completes. After a crash its log may
        say more than ``covered``, the batch the job's state covers: its ``latest`` recovered
        checkpoint's, or the snapshot's it was restored from, or -1 (a new job's empty state).

        - The covered batch's output is committed now if it is not yet
          (``commit_pending_output`` of ``latest``: its sinks commit after its completion,
          during a later batch; Spark, which recorded it as done, will not run it again to
          commit it). A restored snapshot's output was committed as it was restored.
        - Batches Spark recorded after it, no more than ``bound`` (the checkpoints the job's
          starts could leave in flight), are made to run again:
          :func:`~keyedstate.spark.offsets.rewind` deletes their commits and later plans.
          More than that means checkpoints were lost, which the driver's continuity check
          refuses per batch, as without the asynchronous mode."""
        if bound < 1 or not self.location:
            return
        location = self.offset_log()
        done = location.last_committed()
        if done < covered:
            return  # Spark runs the covered batch again (a replay commits its output)
        if latest is not None:
            commit_pending_output(latest)
        if done == covered or done - covered > bound:
            return
        undone = rewind(location, covered)
        log.warning("the job's state covers batch %d, but Spark recorded batches %s as "
                    "done: their checkpoints were in flight when the driver stopped. Spark "
                    "runs them again from batch %d with the same source positions (%s "
                    "rewound)", covered, _batch_list(undone), covered + 1, location.url)


def _batch_list(ids: list[int]) -> str:
    """Batch ids for a message: ``3, 4, 5``; the first and last few of a long list."""
    shown = [str(i) for i in ids]
    if len(shown) > 8:
        shown = [*shown[:4], f"... ({len(ids) - 6} more)", *shown[-2:]]
    return ", ".join(shown)
