"""The batch loop's asynchronous mode (``keyedstate.checkpointing.async-upload``;
docs/checkpoints.md, "The asynchronous phase"): :class:`AsyncBatchLoop` adds it to
:class:`~keyedstate.runtime.loop.BatchLoop`, whose steps it reuses, and the engines subclass
it.

A batch (:meth:`AsyncBatchLoop._run_batch_async`) runs steps 1-3, adds the checkpoint to those
in flight (:mod:`keyedstate.runtime.inflight`) and advances on it (step 5; the next batch's
subtasks reuse their copies at it, or restore from its acknowledgements). Steps 4 and 6 of the
oldest checkpoints in flight, in order, run on a driver thread of their own beside the next
batch's step 3, until at most ``max-concurrent-checkpoints`` are left with that batch's; their
step 7 follows on the batch thread. A failure there discards every checkpoint in flight, with
the batch that ran beside it, and sets the loop back to the last completed one
(:class:`~keyedstate.errors.CheckpointDiscardedError`). An engine whose loop runs in a process
that may end with checkpoints in flight (Spark Connect: the driver's copy in the server)
records each in storage (:meth:`AsyncBatchLoop._records_in_flight`); its loop in another
process completes them once that one ended (:meth:`AsyncBatchLoop._take_over_in_flight`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Mapping, NoReturn

from keyedstate.checkpoint.cleanup import Cleaner
from keyedstate.checkpoint.coordinator import CompletedCheckpoint
from keyedstate.checkpoint.properties import BATCH_ID, MIN_WATERMARK, WATERMARK
from keyedstate.checkpoint.resolve import ResolvedSnapshot
from keyedstate.checkpoint.stats import BatchStats
from keyedstate.errors import CheckpointDiscardedError
from keyedstate.runtime.batch import batch_stats, next_watermark
from keyedstate.runtime.identity import function_name
from keyedstate.runtime.inflight import (
    Beside,
    Committed,
    Completion,
    ContextT,
    InFlight,
    InFlightCheckpoints,
    adopt_recorded,
    ordered_reports,
    record_flight,
)
from keyedstate.runtime.live_copies import release_live
from keyedstate.runtime.loop import BatchLoop, BatchT
from keyedstate.runtime.startup import JobStart
from keyedstate.runtime.subtask import RestoreSource
from keyedstate.runtime.uploads import read_ack, wait_for_checkpoint
from keyedstate.runtime.wire import SubtaskAck, SubtaskReport, decode_reports
from keyedstate.storage.transfer import parallel_map


class AsyncBatchLoop(BatchLoop[BatchT, ContextT]):
    """:class:`~keyedstate.runtime.loop.BatchLoop` with the asynchronous mode (module
    docstring); an engine subclasses it and runs a batch with :meth:`_run_batch_async` when
    ``config.async_upload`` is set."""

    #: the asynchronous mode's checkpoints in flight, oldest first
    _in_flight: InFlightCheckpoints[ContextT]
    #: where the job stands at its last completed checkpoint (or its start)
    _committed: Committed
    #: completed checkpoints (asynchronous mode) whose sink commit failed, to retry first
    _to_commit: deque[tuple[InFlight[ContextT], CompletedCheckpoint, list[SubtaskReport]]]
    #: the thread completing checkpoints beside the running batch's tasks, None otherwise
    _beside: threading.Thread | None = None
    #: the clean-ups after each completion and sink commit (acknowledgements, staged output,
    #: old commit markers), off the batch's path; waited for whenever nothing is left in
    #: flight (:meth:`_complete_in_flight`), so a stopped job deletes nothing afterwards
    _cleanups: Cleaner | None = None

    # -- start-up ------------------------------------------------------------------------------

    def _start(self, on_restore: Callable[[ResolvedSnapshot], Mapping[str, str]]) -> JobStart:
        """:meth:`BatchLoop._start`, with nothing in flight: the job stands at what it
        resumed from."""
        start = super()._start(on_restore)
        self._in_flight = InFlightCheckpoints(self.storage.url)
        self._cleanups = Cleaner()
        self._to_commit = deque()
        self._committed = Committed(self.base, self.share_restored_files, self.watermark,
                                    self.last_batch_id, self.drained)
        return start

    # -- what an engine supplies ---------------------------------------------------------------

    def _records_in_flight(self) -> bool:
        """Whether each checkpoint in flight is recorded in storage
        (:func:`~keyedstate.runtime.inflight.record_flight`) for another process of the job to
        complete (:meth:`_take_over_in_flight`): the loop runs in a process that may end
        without completing them (the driver's copy in a Spark Connect server)."""
        return False

    def _cleaner(self) -> Cleaner | None:
        """The asynchronous mode's clean-ups after a sink commit run off the batch's path
        (:attr:`_cleanups`)."""
        return self._cleanups if self.config.async_upload else None

    def _wait_for_cleanups(self) -> None:
        """Return once every clean-up handed off the batch's path has ended."""
        if self._cleanups is not None:
            self._cleanups.wait()

    def _completed(self, stats: BatchStats) -> None:
        """Step 7 of a batch whose checkpoint completed in the asynchronous mode: its
        statistics, as soon as its output is committed (the engine records them). Called
        before the next checkpoint in flight completes, so that a later failure in the same
        call (its discard raises) loses none of the batches completed before it."""
        return None

    def _acknowledgements(self, flight: InFlight[ContextT]) -> list[SubtaskAck | None]:
        """``flight``'s acknowledgements in subtask order (None: not written), once written
        or never to be: the local runtime's subtasks upload in this process, so it waits for
        them, then reads them in parallel."""
        wait_for_checkpoint(self.storage.url, flight.checkpoint_id)
        storage = self.storage
        return parallel_map(lambda r: read_ack(storage, flight.checkpoint_id, r.subtask),
                            flight.reports, storage.request_threads)

    # -- one batch -----------------------------------------------------------------------------

    def _run_batch_async(self, batch: BatchT, batch_id: int, *, started: float,
                         drain: bool = False, context: ContextT) -> list[BatchStats]:
        """Batch ``batch_id`` in the asynchronous mode. Steps 1-2; steps 4 and 6 of the oldest
        checkpoints in flight on a driver thread *beside* step 3 (:meth:`_completion`), until
        at most ``max-concurrent-checkpoints`` - 1 are left; step 3 (the subtasks end after
        the synchronous phase); step 7 of the batches completed beside it; its checkpoint in
        flight and step 5 on it; after a drain, steps 4, 6 and 7 of every one in flight.
        Returns the statistics of the batches completed meanwhile. A failed batch aborts its
        own checkpoint and completes those in flight before raising: the job is then at the
        last one completed. Raises :class:`CheckpointDiscardedError` when a checkpoint in
        flight fails (this batch is discarded with it: it ran on its state)."""
        # Step 1. Trigger.
        pending = self.coordinator.trigger({BATCH_ID: str(batch_id)})
        # Step 2. Plan.
        tasks = self._tasks(batch)
        plan = self._plan(batch_id, pending.checkpoint_id, drain=drain, spark_tasks=tasks)
        # Steps 4 and 6 beside step 3, as Flink's JobManager completes a checkpoint while the
        # tasks go on: the tasks run on the state of the checkpoints in flight and need none
        # of them complete. Until the thread is joined, only it touches the coordinator, the
        # loop's committed point and the sinks. The subtasks that restore from the newest
        # checkpoint in flight read its acknowledgements: they are kept until the next batch.
        source = plan.restore
        restoring = source.checkpoint_id if source is not None and source.pending else None
        beside = Beside(lambda: self._completion(self.config.max_concurrent_checkpoints - 1,
                                                 keep_acks_of=restoring),
                        lambda run: self._completion_thread(run, context))
        # Known before it starts: a sink's commit there asks whether it runs on it.
        self._beside = beside.thread
        beside.start()
        try:
            # Step 3. Execute: the subtasks end after the synchronous phase.
            reports = ordered_reports(decode_reports(self._execute(plan, batch)),
                                      self.config.parallelism, batch_id)
            flight = InFlight(pending, batch_id, reports, drain, self.watermark, context,
                              started, tasks)
            if self._records_in_flight():
                # Before the batch returns: once it has, nothing may be lost of it, and this
                # process may end (Spark Connect's server ends it with the query).
                record_flight(self.storage, flight, self.start_id)
        except BaseException as exc:
            completion = self._joined(beside)
            # Its subtasks that succeeded upload in the background: abort once they are done.
            wait_for_checkpoint(self.storage.url, pending.checkpoint_id)
            self.coordinator.abort(pending, f"batch {batch_id} failed: {exc}")
            # A failed sink commit stays first: the completion below commits it again.
            completion.commit_failed = None
            # A listener's error waits: the checkpoints in flight are settled first.
            hook_error = self._record_completed(completion.done)
            try:
                self._resolve(completion)  # raises CheckpointDiscardedError if one failed
                self._complete_in_flight(0)  # the same
            except BaseException as later:
                _noted(later, hook_error)
                raise
            failure = self._failure(exc, batch_id) if isinstance(exc, Exception) else None
            if failure is not None:
                raise _noted(failure, hook_error) from exc
            _noted(exc, hook_error)
            raise
        completion = self._joined(beside)
        # Step 5. Advance, on the checkpoint in flight.
        self._advance_in_flight(flight)
        # Step 7 of those completed beside; a failed one discards this batch too.
        done = self._settled(completion)
        return done + self._complete_in_flight(0) if drain else done

    def _advance_in_flight(self, flight: InFlight[ContextT]) -> None:
        """Step 5 on a checkpoint in flight: add it to those in flight, and move the
        watermark, the last batch id, the drain flag and the restore source on to it."""
        self._in_flight.add(flight)
        self.watermark = next_watermark(flight.reports, self.watermark,
                                        self.config.watermark_delay_ms)
        self.last_batch_id = flight.batch_id
        self.drained = flight.drain
        self.base = RestoreSource.in_flight(self.storage, flight.checkpoint_id,
                                            self.config.parallelism,
                                            [r.token for r in flight.reports])
        self.share_restored_files = True

    def _complete_in_flight(self, leave: int) -> list[BatchStats]:
        """Complete checkpoints in flight, oldest first, and commit their output, until at
        most ``leave`` are left (:meth:`_completion`), on this thread; their statistics
        (:meth:`_settled`: a failed completion discards every one in flight; a failed sink
        commit raises and is retried first by the next call, so output is committed in batch
        order, once). With none left (a flush, a drain, a stop), also the clean-ups handed
        off the path meanwhile."""
        try:
            return self._settled(self._completion(leave))
        finally:
            if leave == 0:
                self._wait_for_cleanups()

    def _completion(self, leave: int, *, keep_acks_of: int | None = None) -> Completion:
        """Steps 4 and 6 of the checkpoints in flight, oldest first, until at most ``leave``
        are left: the completed ones whose sink commit failed before first. Stops at the
        first failure and says which (:class:`~keyedstate.runtime.inflight.Completion`);
        raises nothing, calls no engine hook but the sink commit: it may run on a thread of
        its own (:meth:`_run_batch_async`), while the batch thread runs the next batch's
        tasks. ``keep_acks_of``: the checkpoint in flight whose acknowledgements those tasks
        may read (kept until the next call)."""
        completion = Completion()
        try:
            self._commit_completed(completion.done)
        except BaseException as exc:
            completion.commit_failed = exc
            return completion
        if keep_acks_of is None and len(self._in_flight) <= leave:
            # Nothing completes here to delete them first (complete_oldest does, before it
            # subsumes their checkpoint): off the path.
            self._in_flight.delete_kept_acks(self.storage, self._cleanups)
        while len(self._in_flight) > leave:
            oldest = next(iter(self._in_flight)).checkpoint_id
            try:
                flight, completed, reports = self._in_flight.complete_oldest(
                    self.coordinator, acks=self._acknowledgements, config=self.config,
                    key_columns=self.key_columns, lineage=self.lineage,
                    function=function_name(self.function), extra=self._checkpoint_properties(),
                    keep_acks=oldest == keep_acks_of, cleaner=self._cleanups)
            except BaseException as exc:
                completion.failed = exc
                return completion
            props = completed.metadata.properties
            watermark = int(props.get(WATERMARK, MIN_WATERMARK))
            base = RestoreSource.of(self.storage, completed.metadata, own=True)
            if self.base is not None and self.base.pending \
                    and self.base.checkpoint_id == completed.checkpoint_id:
                self.base = base
            self._committed = Committed(base, True, watermark, flight.batch_id, flight.drain)
            # Step 6, after the checkpoint completed.
            self._to_commit.append((flight, completed, reports))
            try:
                self._commit_completed(completion.done)
            except BaseException as exc:
                completion.commit_failed = exc
                return completion
        return completion

    def _joined(self, beside: Beside) -> Completion:
        """Wait for the completion beside a batch's tasks to end; its outcome."""
        try:
            return beside.join()
        finally:
            self._beside = None

    def _settled(self, completion: Completion) -> list[BatchStats]:
        """Step 7 of the batches ``completion`` committed (:meth:`_record_completed`, on this
        thread, before anything is raised: none of them is lost), then its failure
        (:meth:`_resolve`), then the first error step 7 raised (a listener's). Returns the
        statistics."""
        hook_error = self._record_completed(completion.done)
        try:
            self._resolve(completion)
        except BaseException as exc:
            _noted(exc, hook_error)
            raise
        if hook_error is not None:
            raise hook_error
        return completion.done

    def _record_completed(self, done: list[BatchStats]) -> Exception | None:
        """The engine's :meth:`_completed` on each of ``done``, every one even if one raises
        (a user's listener); the first error, which the caller raises only once the
        checkpoints in flight are settled: a listener that raises must not keep a failed
        checkpoint from being discarded, nor the next from completing."""
        first: Exception | None = None
        for stats in done:
            try:
                self._completed(stats)
            except Exception as exc:  # noqa: BLE001 - raised by the caller, after the settling
                first = first or exc
        return first

    def _resolve(self, completion: Completion) -> None:
        """Raise ``completion``'s failure: a checkpoint in flight that failed discards every
        one in flight (:meth:`_discard_in_flight` raises :class:`CheckpointDiscardedError`), a
        failed sink commit is raised as it is."""
        if completion.failed is not None:
            self._discard_in_flight(completion.failed)
        if completion.commit_failed is not None:
            raise completion.commit_failed

    def _take_over_in_flight(self, context: ContextT) -> list[BatchStats]:
        """Complete the checkpoints in flight that this job's loop in another process
        recorded (:meth:`_records_in_flight`) and left when it ended (the driver's copy in a
        Spark Connect server: its process ends with the query), and commit their output with
        ``context``, in order; their statistics. That loop must run nothing any more (its
        query stopped). Nothing is done when it left none.

        Step 1. Adopt them (:func:`~keyedstate.runtime.inflight.adopt_recorded`: a
            coordinator recovered from storage, which the other loop changed since this one's
            start, keeping them).
        Step 2. Set the loop where the other one stood: at the latest completed checkpoint
            (its output committed first if its marker is missing: sinks commit in batch
            order), then advanced on each checkpoint in flight (step 5).
        Step 3. Complete them and commit their output (:meth:`_complete_in_flight`); a failure
            discards them and raises :class:`CheckpointDiscardedError`, as in the loop.
        """
        # Step 1.
        before = self.coordinator.latest_completed
        adopted = adopt_recorded(self.storage, self.start_id, context, backend=self.backend.name,
                                 parallelism=self.config.parallelism,
                                 max_parallelism=self.max_parallelism, key_types=self.key_types,
                                 num_retained=self.config.num_retained)
        if adopted is None:
            return []
        self.coordinator, flights = adopted
        # Step 2.
        latest = self.coordinator.latest_completed
        if latest is not None and (before is None
                                   or latest.checkpoint_id != before.checkpoint_id):
            self._committed = Committed.at(self.storage, latest)
            self._back_to_committed()
            self._commit_with_retries(context, latest)
        for flight in flights:
            self._advance_in_flight(flight)
        # Step 3.
        return self._complete_in_flight(0)

    def _commit_completed(self, done: list[BatchStats]) -> None:
        """Step 6 of the completed checkpoints whose output is not committed yet, in order,
        each one's statistics added to ``done`` as soon as it is; one whose commit fails stays
        first (the error is raised)."""
        while self._to_commit:
            flight, completed, reports = self._to_commit[0]
            fresh, flight.may_be_committed = not flight.may_be_committed, True
            self._commit_with_retries(flight.context, completed, fresh=fresh)
            self._to_commit.popleft()
            watermark = int(completed.metadata.properties.get(WATERMARK, MIN_WATERMARK))
            stats = batch_stats(reports, completed, watermark=watermark,
                                duration_s=time.perf_counter() - flight.started)
            stats.spark_tasks = flight.tasks or 0
            done.append(stats)

    def _completion_thread(self, run: Callable[[], None], context: ContextT
                           ) -> threading.Thread:
        """The thread that completes checkpoints beside a batch's tasks, not started; it runs
        ``run`` (the engine's kind of thread: Spark's carries the batch thread's job
        properties; ``context``: what the sink commits get)."""
        return threading.Thread(target=run, name="keyedstate-completion", daemon=True)

    def _on_completion_thread(self) -> bool:
        """Whether the caller runs on the thread completing checkpoints beside a batch's
        tasks (:meth:`_run_batch_async`): it works for the batch thread, which waits for it
        before it touches the coordinator again."""
        return self._beside is not None and threading.current_thread() is self._beside

    def _discard_in_flight(self, exc: BaseException) -> NoReturn:
        """A checkpoint in flight failed: abort it and every later one, close the job's live
        copies in this process (their state is after the last completed checkpoint), set the
        loop back to that checkpoint and raise :class:`CheckpointDiscardedError`."""
        oldest = next(iter(self._in_flight)).checkpoint_id
        discarded = self._in_flight.discard(
            self.coordinator, f"checkpoint {oldest} failed in flight: {exc}")
        release_live(self.storage.url, self.start_id)
        back = self._back_to_committed()
        raise CheckpointDiscardedError(
            f"checkpoint {oldest} failed in its asynchronous phase ({exc}); batches "
            f"{discarded} were discarded (their state and output are gone) and the job is "
            f"back at batch {back.last_batch_id}: send batches {back.last_batch_id + 1} and "
            f"later again", discarded_batches=discarded,
            last_batch_id=back.last_batch_id) from exc

    def _back_to_committed(self) -> Committed:
        """Set the loop to :attr:`_committed` (restore source, watermark, batch id, drain
        flag); returns it."""
        back = self._committed
        self.base, self.share_restored_files = back.base, back.share_restored_files
        self.watermark, self.last_batch_id = back.watermark, back.last_batch_id
        self.drained = back.drained
        return back


def _noted(exc: BaseException, also: BaseException | None) -> BaseException:
    """``exc``, with a note naming ``also`` (a listener's error raised in the same call, which
    ``exc`` takes precedence over) if there is one."""
    if also is not None:
        exc.add_note(f"a batch listener also failed in this call: {also!r}")
    return exc
