"""The checkpoint coordinator: trigger, acknowledge, complete, abort, subsume, recover.

Engine-independent and driver-side (Flink's ``CheckpointCoordinator``). One checkpoint::

    pending = coordinator.trigger({"batch_id": "7"})
    location = pending.location(i)                   # pickled to subtask i, which snapshots
    coordinator.acknowledge(pending, handle)         # through it and returns its handle
    completed = coordinator.complete(pending)        # or coordinator.abort(pending, reason)

A checkpoint is complete exactly when its ``chk-<N>/_metadata`` is durable. Everything else
(registering shared files, subsuming old checkpoints, deleting files) follows the commit and may
be interrupted by a crash at any point: :meth:`CheckpointCoordinator.recover` rebuilds the
coordinator from storage alone (what the root holds is read by :mod:`.recovery`) and finishes
the clean-up. The protocol, the registry rules and
the recovery rules are explained in ``docs/checkpoints.md``.

One coordinator runs per job (per snapshot root); it is not thread-safe. What the executors
need (storage, locations, handles) pickles; the coordinator itself stays on the driver.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Collection, Iterator, Mapping, Sequence

from keyedstate.checkpoint.cleanup import (
    delete_dir_quietly,
    delete_quietly,
    discard_completed,
    list_quietly,
    written_for,
)
from keyedstate.checkpoint.pending import (
    CompletedCheckpoint,
    CompletedCheckpointStore,
    PendingCheckpoint,
    check_subtask_index,
)
from keyedstate.checkpoint.recovery import (
    check_configuration,
    highest_used_id,
    lost_checkpoints,
    read_stored_checkpoints,
)
from keyedstate.checkpoint.registry import SharedStateRegistry
from keyedstate.errors import (
    CheckpointAbortedError,
    CheckpointProtocolError,
    ConfigurationError,
    CorruptCheckpointError,
    KeyGroupRangeError,
)
from keyedstate.keygroups import KeyGroupRange, check_parallelism
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.filesystem import is_object_store
from keyedstate.storage.handles import CheckpointMetadata, KeyedStateHandle
from keyedstate.storage.layout import (
    ABORTED_MARKER_FILE,
    COMPLETED_MARKER_FILE,
    SHARED_DIR,
    checkpoint_dir_name,
    checkpoint_id_of_shared_file,
)
from keyedstate.storage.transfer import parallel_map

logger = logging.getLogger(__name__)



def has_completed_checkpoints(storage: CheckpointStorage) -> bool:
    """Whether the job in ``storage`` has completed a checkpoint: one is committed now, or the
    root's :data:`~keyedstate.storage.layout.COMPLETED_MARKER_FILE` says one was (then
    :meth:`CheckpointCoordinator.recover` either finds a complete checkpoint or raises; a
    runtime must never start such a job from empty state or from its initial snapshot)."""
    return bool(storage.checkpoint_ids()) or storage.exists(COMPLETED_MARKER_FILE)


def _checked_properties(properties: Mapping[str, str] | None) -> dict[str, str]:
    checked = dict(properties or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in checked.items()):
        raise ConfigurationError(f"checkpoint properties must map str to str: {checked!r}")
    return checked


class CheckpointCoordinator:
    """Triggers, completes, aborts and subsumes the checkpoints of one job in ``storage``.

    ``num_retained`` is Flink's ``execution.checkpointing.num-retained`` (>= 1). The constructor
    starts a new job: it refuses a root holding completed checkpoints (resume those with
    :meth:`recover`, which also accepts an empty root) or whose completed checkpoints were lost
    (:class:`MissingCheckpointFileError`, see :meth:`recover`), and numbers its checkpoints
    above any leftover of a crashed start, which it leaves for :meth:`recover` or
    ``keyedstate gc``. The first checkpoint that completes writes the root's
    :data:`~keyedstate.storage.layout.COMPLETED_MARKER_FILE`.
    """

    def __init__(self, storage: CheckpointStorage, *, backend: str, parallelism: int,
                 max_parallelism: int, key_types: Sequence[str], num_retained: int = 1) -> None:
        self._configure(storage, backend, parallelism, max_parallelism, key_types, num_retained)
        completed = storage.checkpoint_ids()
        if completed:
            raise ConfigurationError(
                f"{storage.url} already holds completed checkpoints (latest: chk-{completed[-1]});"
                f" resume that job with CheckpointCoordinator.recover(...), or use an empty "
                f"directory for a new job"
            )
        if storage.exists(COMPLETED_MARKER_FILE):
            raise lost_checkpoints(storage, storage.checkpoint_dir_ids())
        self._next_id = highest_used_id(storage, storage.list_files(SHARED_DIR)) + 1

    def _configure(self, storage: CheckpointStorage, backend: str, parallelism: int,
                   max_parallelism: int, key_types: Sequence[str], num_retained: int) -> None:
        check_parallelism(parallelism, max_parallelism)
        if not isinstance(num_retained, int) or isinstance(num_retained, bool) \
                or num_retained < 1:
            raise ConfigurationError(
                f"execution.checkpointing.num-retained must be an int >= 1, got {num_retained!r}"
            )
        if not backend or not isinstance(backend, str):
            raise ConfigurationError(f"backend must be a backend name, got {backend!r}")
        if isinstance(key_types, str) or not all(isinstance(t, str) for t in key_types):
            raise ConfigurationError(f"key_types must be a list of type strings, got "
                                     f"{key_types!r}")
        self.storage = storage
        self.backend = backend
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.key_types = list(key_types)
        self.num_retained = num_retained
        self.registry = SharedStateRegistry()
        self.store = CompletedCheckpointStore(num_retained)
        self.recovery_notes: list[str] = []
        self._pending: dict[int, PendingCheckpoint] = {}
        self._next_id = 1
        # Files of snapshots restored in NO_CLAIM or LEGACY mode: the registry drops them once
        # unused, but they stay the user's, so gc must never list them.
        self._not_owned_paths: set[str] = set()
        # chk-<N> dirs whose _metadata is corrupt: kept for inspection until subsumed.
        self._quarantined: set[int] = set()
        # chk-<N>/_aborted tombstones (ids of aborted checkpoints) until a later one completes.
        self._tombstones: set[int] = set()
        # Whether the root's COMPLETED_MARKER_FILE is known to exist (written at most once).
        self._completed_marker = False

    # -- queries -------------------------------------------------------------------------------

    @property
    def latest_completed(self) -> CompletedCheckpoint | None:
        return self.store.latest

    @property
    def retained(self) -> list[CompletedCheckpoint]:
        """Retained completed checkpoints, ascending by id."""
        return self.store.retained

    @property
    def pending(self) -> list[PendingCheckpoint]:
        """Checkpoints triggered and neither completed nor aborted, ascending by id."""
        return [self._pending[i] for i in sorted(self._pending)]

    def restore_handles(self) -> list[KeyedStateHandle]:
        """The handles of the latest completed checkpoint; empty for a new job."""
        latest = self.store.latest
        return list(latest.handles) if latest else []

    # -- one checkpoint ------------------------------------------------------------------------

    def trigger(self, properties: Mapping[str, str] | None = None) -> PendingCheckpoint:
        """Start checkpoint ``N`` = one more than any id this job used (ids are never reused,
        not even those of aborted or crashed checkpoints). ``properties`` (e.g. the batch id)
        go into ``_metadata``."""
        checked = _checked_properties(properties)
        checkpoint_id, self._next_id = self._next_id, self._next_id + 1
        pending = PendingCheckpoint(self.storage, checkpoint_id, time.time_ns() // 1_000_000,
                                    self.parallelism, checked)
        self._pending[checkpoint_id] = pending
        return pending

    def acknowledge(self, pending: PendingCheckpoint, handle: KeyedStateHandle) -> None:
        """Accept subtask ``handle.subtask_index``'s snapshot. Refuses (typed errors) an index
        out of range, a second handle of one subtask, a handle of another checkpoint or backend,
        and a key-group range other than the subtask's."""
        self._check_usable(pending, "acknowledged")
        index, checkpoint_id = handle.subtask_index, pending.checkpoint_id
        check_subtask_index(index, self.parallelism, checkpoint_id)
        if index in pending._acknowledged:
            raise CheckpointProtocolError(
                f"subtask {index} already acknowledged checkpoint {checkpoint_id}; a retried "
                f"task must not report twice (abort the checkpoint and trigger a new one)"
            )
        if handle.checkpoint_id != checkpoint_id:
            raise CheckpointProtocolError(
                f"subtask {index} acknowledged checkpoint {checkpoint_id} with a handle of "
                f"checkpoint {handle.checkpoint_id}; snapshot with the pending checkpoint's id"
            )
        if handle.backend != self.backend:
            raise ConfigurationError(
                f"subtask {index} snapshotted with the {handle.backend!r} backend, the job is "
                f"configured with {self.backend!r}"
            )
        expected = KeyGroupRange.of_operator(self.max_parallelism, self.parallelism, index)
        if handle.key_group_range != expected:
            raise KeyGroupRangeError(
                f"subtask {index} of {self.parallelism} owns {expected} (max parallelism "
                f"{self.max_parallelism}), but its handle for checkpoint {checkpoint_id} covers "
                f"{handle.key_group_range}; the backend was created for another layout"
            )
        pending._acknowledged[index] = handle

    def complete(self, pending: PendingCheckpoint,
                 properties: Mapping[str, str] | None = None) -> CompletedCheckpoint:
        """Commit a fully acknowledged checkpoint and subsume the ones beyond ``num_retained``.
        ``properties`` known only now (e.g. the new watermark) are merged over the trigger's.

        Step 1. Every subtask has acknowledged (else :class:`CheckpointError`).
        Step 2. Every shared file that is not new in this checkpoint is registered by a retained
            checkpoint with the same size and checksum, and private files lie in ``chk-<N>/``;
            otherwise the checkpoint is aborted and :class:`CheckpointAbortedError` names the
            file (a backend built on an unconfirmed or subsumed base: the race of incremental
            checkpoints, ``docs/checkpoints.md``).
        Step 3. ``chk-<N>/_metadata`` is written atomically: the checkpoint is complete.
        Step 4. Its shared files are registered.
        Step 5. Checkpoints beyond ``num_retained`` are subsumed: their ``_metadata``, then
            their ``chk-<M>/`` directory, then the shared files the registry releases.
        Step 6. Older pending checkpoints are aborted (they can never complete), and files
            written for this checkpoint that it does not reference (failed task attempts) are
            deleted.

        Deletion failures after Step 3 are logged, not raised: the checkpoint is complete, and
        :meth:`recover` or ``keyedstate gc`` finds what was left.
        """
        for _ in self._complete_steps(pending, properties):
            pass
        assert pending.completed is not None
        return pending.completed

    def _complete_steps(self, pending: PendingCheckpoint,
                        properties: Mapping[str, str] | None = None) -> Iterator[int]:
        """:meth:`complete` as a generator that yields after each numbered step, so that tests
        stop it there exactly as a crash of the driver would. No yield is inside a ``try``:
        closing the generator early runs no clean-up."""
        checkpoint_id = pending.checkpoint_id
        # Step 1. All p handles are in.
        self._check_usable(pending, "completed")
        missing = [i for i in range(self.parallelism) if i not in pending._acknowledged]
        if missing:
            raise CheckpointProtocolError(
                f"checkpoint {checkpoint_id} can't complete: subtasks {missing} have not "
                f"acknowledged; wait for them or abort the checkpoint"
            )
        pending.properties.update(_checked_properties(properties))
        yield 1
        # Step 2. Refuse a checkpoint that builds on files no retained checkpoint keeps alive:
        # committing it would make a checkpoint that can't be restored.
        problem = self._bad_reference(pending)
        if problem is not None:
            self._abort(pending, problem)
            raise CheckpointAbortedError(f"checkpoint {checkpoint_id} was aborted: {problem}")
        yield 2
        # Step 3. The commit point. On failure the checkpoint may or may not be visible, so it
        # is aborted (which deletes chk-<N>/ with any _metadata): the caller sees "not complete"
        # and storage agrees. Nothing older has been touched yet.
        metadata = CheckpointMetadata(
            checkpoint_id=checkpoint_id, timestamp_ms=pending.timestamp_ms,
            backend=self.backend, parallelism=self.parallelism,
            max_parallelism=self.max_parallelism, key_types=list(self.key_types),
            handles=[pending._acknowledged[i] for i in range(self.parallelism)],
            properties=dict(pending.properties),
        )
        try:
            metadata_path = self.storage.write_metadata(metadata)
        except Exception:
            self._abort(pending, "writing its _metadata failed")
            raise
        completed = CompletedCheckpoint(checkpoint_id, metadata, metadata_path)
        pending.completed = completed
        del self._pending[checkpoint_id]
        self._mark_completed()
        yield 3
        # Step 4. Register only now: an unconfirmed checkpoint must never keep a file alive,
        # and a crash before this point loses nothing (recover registers from _metadata).
        # If registering raises, the caller sees the checkpoint fail, so storage must not
        # hold it complete: it is taken back (aborted as in Step 3, _metadata and all).
        try:
            self.registry.register_all(metadata)
        except BaseException:
            self._take_back(pending)
            raise
        yield 4
        # Step 5. Subsume. _metadata goes first, so a crash half-way leaves an incomplete
        # chk-<M>/ (deleted by recover), never a complete-looking checkpoint missing files.
        # Beside it run listings, which only read (on an object store each request is a round
        # trip the batch waits for): Step 6's of the files named for N (nothing this step
        # deletes is named for N: N references those files) and, on an object store (no
        # folders), each subsumed chk-<M>/'s, whose files are deleted once its _metadata is
        # gone, as the folder's recursive delete did.
        subsumed = self.store.add_checkpoint_and_subsume_oldest(completed)
        listing = bool(subsumed) and is_object_store(self.storage.fs)
        gone: dict[int, bool] = {}
        listed: dict[int, list[str] | None] = {}
        written: list[str] = []

        def discard() -> None:
            for old in subsumed:
                gone[old.checkpoint_id] = discard_completed(self.storage, old, folder=not listing)

        steps: list[Callable[[], None]] = [
            discard, lambda: written.extend(written_for(self.storage, checkpoint_id))]
        if listing:
            steps.append(lambda: listed.update(
                {old.checkpoint_id:
                 list_quietly(self.storage, checkpoint_dir_name(old.checkpoint_id))
                 for old in subsumed}))
        parallel_map(lambda step: step(), steps, self.storage.request_threads)
        for old in subsumed if listing else []:
            found = listed.get(old.checkpoint_id)
            if gone.get(old.checkpoint_id) and found is not None:
                delete_quietly(self.storage, [p for p in found if p != old.metadata_path],
                               f"subsumed checkpoint {old.checkpoint_id}")
            else:  # as without a listing: the folder, _metadata and all
                delete_dir_quietly(self.storage, checkpoint_dir_name(old.checkpoint_id))
        lowest = self.store.lowest_retained_id
        assert lowest is not None
        released = self.registry.unregister_unused_state(lowest)
        delete_quietly(self.storage, [h.path for h in released],
                       f"subsumed by checkpoint {checkpoint_id}")
        for corrupt_id in sorted(i for i in self._quarantined if i < lowest):
            self._quarantined.discard(corrupt_id)
            delete_dir_quietly(self.storage, checkpoint_dir_name(corrupt_id))
        yield 5
        # Step 6. Flink aborts pending checkpoints older than a completed one; a retried or
        # speculative task attempt may have written files this checkpoint does not reference.
        for older_id in sorted(i for i in self._pending if i < checkpoint_id):
            self._abort(self._pending[older_id], f"subsumed by checkpoint {checkpoint_id}")
        referenced = {f.path for f in metadata.files()}
        delete_quietly(self.storage, [p for p in written if p not in referenced],
                       f"unreferenced by checkpoint {checkpoint_id}")
        # A completed id is above every aborted one: their tombstones have done their job.
        for aborted_id in sorted(i for i in self._tombstones if i < checkpoint_id):
            self._tombstones.discard(aborted_id)
            delete_dir_quietly(self.storage, checkpoint_dir_name(aborted_id))
        yield 6

    def abort(self, pending: PendingCheckpoint, reason: str) -> None:
        """Give up a pending checkpoint: delete what it wrote that no completed checkpoint
        references, and its ``chk-<N>/``. Idempotent; a later :meth:`complete` or
        :meth:`acknowledge` raises :class:`CheckpointAbortedError`. Deletion failures are
        logged; leftovers are found by :meth:`recover` and ``keyedstate gc``."""
        if pending.is_aborted:
            return
        self._check_usable(pending, "aborted")
        self._abort(pending, reason)

    def _abort(self, pending: PendingCheckpoint, reason: str) -> None:
        checkpoint_id = pending.checkpoint_id
        # Step 1. Mark it first: whatever happens below, it can't be acknowledged or completed.
        pending.failure_reason = reason
        self._pending.pop(checkpoint_id, None)
        logger.info("checkpoint %d aborted: %s", checkpoint_id, reason)
        # Step 2. What it wrote: shared files named for it (written by any process), what this
        # process's locations tracked, and what acknowledged handles list; minus every
        # registered file, which a completed checkpoint references.
        written = set(written_for(self.storage, checkpoint_id)) | set(pending.written_here())
        for handle in pending._acknowledged.values():
            written.update(f.path for f in handle.files()
                           if checkpoint_id_of_shared_file(f.path) == checkpoint_id)
        # Step 3. Delete them, then chk-<N>/ (its private files; no _metadata unless Step 3 of
        # complete failed ambiguously, and then it must go too).
        delete_quietly(self.storage, (p for p in written if p not in self.registry),
                       f"aborted checkpoint {checkpoint_id}")
        delete_dir_quietly(self.storage, checkpoint_dir_name(checkpoint_id))
        # Step 4. Its tombstone: a restarted job's next id is still above this one.
        self._leave_tombstone(checkpoint_id)

    def _take_back(self, pending: PendingCheckpoint) -> None:
        """Step 4 of :meth:`complete` failed after the commit point: abort the checkpoint after
        all (its files, ``chk-<N>/`` with its ``_metadata``, a tombstone), and, when no other
        checkpoint of this job completed, the root's
        :data:`~keyedstate.storage.layout.COMPLETED_MARKER_FILE` its commit wrote (left, it
        would make the next start take the job for one that lost its checkpoints). A file it
        registered before the failure stays until unused, as any registered file."""
        pending.completed = None
        self._abort(pending, "registering its shared files failed after its _metadata was "
                             "written")
        if self.store.latest is None and self._completed_marker:
            try:
                self.storage.delete([COMPLETED_MARKER_FILE])
                self._completed_marker = False
            except OSError as exc:
                logger.warning("could not delete %s: %s; the job's next start takes it for "
                               "a job that lost its checkpoints",
                               self.storage.url_of(COMPLETED_MARKER_FILE), exc)

    def _leave_tombstone(self, checkpoint_id: int) -> None:
        """Write ``chk-<N>/_aborted`` so that no later start of the job uses id N again (see
        docs/checkpoints.md, "Ids are never reused"). Best effort: without it the id may be
        used again after a restart, which unique file names keep safe."""
        try:
            self.storage.write(f"{checkpoint_dir_name(checkpoint_id)}/{ABORTED_MARKER_FILE}",
                               b"")
            self._tombstones.add(checkpoint_id)
        except OSError as exc:
            logger.warning("could not mark checkpoint %d as aborted: %s; a restarted job may "
                           "use its id again", checkpoint_id, exc)

    def adopt(self, checkpoint_id: int, timestamp_ms: int,
              properties: Mapping[str, str]) -> PendingCheckpoint:
        """Checkpoint ``checkpoint_id``, triggered at ``timestamp_ms`` with ``properties`` by
        another coordinator of this job that will not complete it (the Spark Connect server's
        copy of the driver, ended with its query), as pending here: acknowledged and completed
        (or aborted) as if this coordinator had triggered it. Recover with the id
        ``in_flight`` first (:meth:`recover`). Refuses (:class:`CheckpointProtocolError`) an id
        at or below the latest completed checkpoint, already pending, or never used."""
        latest = self.store.latest
        if (latest is not None and checkpoint_id <= latest.checkpoint_id) \
                or checkpoint_id in self._pending or checkpoint_id >= self._next_id:
            raise CheckpointProtocolError(
                f"checkpoint {checkpoint_id} can't be adopted: the latest completed one is "
                f"{latest.checkpoint_id if latest else None}, pending are {sorted(self._pending)}, "
                f"the next id is {self._next_id}")
        pending = PendingCheckpoint(self.storage, checkpoint_id, timestamp_ms, self.parallelism,
                                    _checked_properties(properties))
        self._pending[checkpoint_id] = pending
        return pending

    def register_restored(self, metadata: CheckpointMetadata, *, claim: bool) -> None:
        """The restore-mode hook: register a snapshot this job starts from, whose files later
        checkpoints may reference. ``claim=False`` (NO_CLAIM, LEGACY): never delete them.
        Paths are relative to this coordinator's root."""
        self.registry.register_all_after_restored(metadata, claim=claim)
        if not claim:
            self._not_owned_paths.update(f.path for f in metadata.files())
        self._next_id = max(self._next_id, metadata.checkpoint_id + 1)

    # -- helpers -------------------------------------------------------------------------------

    def _check_usable(self, pending: PendingCheckpoint, verb: str) -> None:
        if pending.is_aborted:
            raise CheckpointAbortedError(
                f"checkpoint {pending.checkpoint_id} was aborted ({pending.failure_reason}) and "
                f"can't be {verb}; trigger a new checkpoint"
            )
        if pending.is_completed:
            raise CheckpointProtocolError(f"checkpoint {pending.checkpoint_id} is already completed "
                                  f"and can't be {verb}")
        if self._pending.get(pending.checkpoint_id) is not pending:
            raise CheckpointProtocolError(
                f"checkpoint {pending.checkpoint_id} was not triggered by this coordinator (it "
                f"predates a recovery?) and can't be {verb}; trigger a new checkpoint"
            )

    def _bad_reference(self, pending: PendingCheckpoint) -> str | None:
        """Why Step 2 refuses ``pending``, or None."""
        checkpoint_id = pending.checkpoint_id
        private_prefix = checkpoint_dir_name(checkpoint_id) + "/"
        for index, handle in sorted(pending._acknowledged.items()):
            for stream in handle.registered_files():
                if checkpoint_id_of_shared_file(stream.path) == checkpoint_id:
                    continue  # new in this checkpoint
                problem = self.registry.check_reference(stream, unconfirmed=self._pending)
                if problem is not None:
                    return f"subtask {index} references {problem}"
            for stream in handle.private.values():
                if stream.data is not None or stream.path.startswith(SHARED_DIR + "/"):
                    continue  # inline, or a segment of a merged object (checked above)
                if not stream.path.startswith(private_prefix):
                    return (f"subtask {index} lists {stream.path} as a private file, but private "
                            f"files of checkpoint {checkpoint_id} live under {private_prefix} "
                            f"(deleted with it); write them through the pending location")
        return None

    def _mark_completed(self) -> None:
        """Write the root's COMPLETED_MARKER_FILE once (after a checkpoint is complete). Best
        effort: the checkpoint is complete either way, and a missing marker only means that a
        later loss of every ``_metadata`` is taken for a job that never completed one."""
        if self._completed_marker:
            return
        try:
            if not self.storage.exists(COMPLETED_MARKER_FILE):
                self.storage.write(COMPLETED_MARKER_FILE, b"")
            self._completed_marker = True
        except OSError as exc:
            logger.warning("could not write %s: %s; it is written again with the next "
                           "checkpoint", self.storage.url_of(COMPLETED_MARKER_FILE), exc)

    # -- recovery ------------------------------------------------------------------------------

    @classmethod
    def recover(cls, storage: CheckpointStorage, *, backend: str, parallelism: int,
                max_parallelism: int, key_types: Sequence[str], num_retained: int = 1,
                cleanup_orphans: bool = True,
                not_owned: Sequence[CheckpointMetadata] = (),
                in_flight: Collection[int] = ()) -> CheckpointCoordinator:
        """Rebuild the coordinator of a job from ``storage`` alone (after a crash or a stop).

        The newest ``num_retained`` readable ``_metadata`` files are the retained checkpoints;
        a corrupt one is skipped (a warning, and a line in :attr:`recovery_notes`) and kept for
        inspection while newer than the retained ones. Raises before deleting anything:
        :class:`CorruptCheckpointError` when checkpoints exist but none is readable,
        :class:`UnsupportedFormatVersionError` for a newer keyedstate's ``_metadata``,
        :class:`MaxParallelismMismatchError` or :class:`ConfigurationError` when the retained
        checkpoints were written with another max parallelism, backend or key types.
        :class:`MissingCheckpointFileError` when the root's
        :data:`~keyedstate.storage.layout.COMPLETED_MARKER_FILE` says the job completed
        checkpoints but no ``_metadata`` is left (lost, e.g. deleted: never an empty start).
        Incomplete ``chk-<N>/`` (no ``_metadata``) are deleted, older checkpoints subsumed and,
        with ``cleanup_orphans``, shared files no retained checkpoint references deleted (safe:
        one coordinator runs per job). ``not_owned``: snapshots the job was restored from in
        NO_CLAIM or LEGACY mode, whose files are never deleted. An empty root gives a new job.
        An incomplete ``chk-<N>/`` newer than the checkpoint restored is a crash before its
        commit or a lost ``_metadata`` (storage can't tell which): the fall-back to the newest
        complete checkpoint is logged and noted in :attr:`recovery_notes`, as for a corrupt one.
        ``in_flight``: ids of checkpoints in flight that another coordinator of this job
        triggered and that this one is to complete (:meth:`adopt`; the asynchronous mode's
        take-over, :meth:`~keyedstate.runtime.async_loop.AsyncBatchLoop._take_over_in_flight`): their
        ``chk-<N>/`` are kept (pass ``cleanup_orphans=False`` too: their shared files are
        referenced by no retained checkpoint yet).
        """
        self = cls.__new__(cls)
        self._configure(storage, backend, parallelism, max_parallelism, key_types, num_retained)
        # Step 1. What the root holds (reading only; raises before anything is deleted).
        stored = read_stored_checkpoints(storage, num_retained)
        dir_ids, retained, older = stored.dir_ids, stored.retained, stored.older
        unreadable, incomplete = stored.unreadable, stored.incomplete
        # Step 2. The configuration must fit the retained checkpoints.
        for checkpoint in retained:
            check_configuration(checkpoint, storage, backend=backend,
                                max_parallelism=max_parallelism, key_types=self.key_types)
        if retained:
            self._mark_completed()  # roots of jobs from before the marker get it now
        # Step 3. Rebuild the registry from the retained checkpoints, then the older readable
        # ones (so that subsuming them below releases their files as complete() would; one
        # that contradicts a retained checkpoint is left to the orphan clean-up).
        for checkpoint in retained:
            self.registry.register_all(checkpoint.metadata)
        for checkpoint in older:
            try:
                self.registry.register_all(checkpoint.metadata)
            except CorruptCheckpointError as exc:
                self._note(f"checkpoint {checkpoint.checkpoint_id} (subsumed) conflicts with a "
                           f"retained one: {exc}")
        for metadata in not_owned:
            self.register_restored(metadata, claim=False)
        for checkpoint in retained:
            self.store.add_checkpoint_and_subsume_oldest(checkpoint)
        lowest = retained[0].checkpoint_id if retained else None
        # Step 4. A chk-<N>/ without _metadata never committed (or was half subsumed). One
        # newer than the checkpoint restored may also be a completed checkpoint whose
        # _metadata was lost: storage can't tell, so the fall-back is said, never silent.
        # The newest of them, if newer than every retained checkpoint, becomes (or stays) a
        # tombstone: a crash before the next checkpoint writes anything must not give its id
        # out again (step 7).
        newest = retained[-1].checkpoint_id if retained else 0
        for checkpoint_id in incomplete:
            if checkpoint_id in in_flight:
                continue  # another coordinator's checkpoint in flight, to be adopted
            last_used = checkpoint_id == max(incomplete) and checkpoint_id > newest
            tombstone = f"{checkpoint_dir_name(checkpoint_id)}/{ABORTED_MARKER_FILE}"
            if last_used and storage.list_files(checkpoint_dir_name(checkpoint_id)) == [tombstone]:
                self._tombstones.add(checkpoint_id)
                continue
            if retained and checkpoint_id > retained[-1].checkpoint_id:
                self._note(f"chk-{checkpoint_id} has no _metadata: it never completed (a crash "
                           f"before its commit) or its _metadata was lost; recovered from "
                           f"checkpoint {retained[-1].checkpoint_id}, the newest complete one, "
                           f"and deleted chk-{checkpoint_id}/")
            delete_dir_quietly(self.storage, checkpoint_dir_name(checkpoint_id))
            if last_used:
                self._leave_tombstone(checkpoint_id)
        # Step 5. Subsume what is beyond num_retained; keep a corrupt checkpoint newer than the
        # lowest retained one for inspection (deleted once subsumed), never silently.
        for checkpoint in reversed(older):
            discard_completed(self.storage, checkpoint)
        if lowest is not None:
            released = self.registry.unregister_unused_state(lowest)
            delete_quietly(self.storage, (h.path for h in released), "subsumed during recovery")
        for checkpoint_id in sorted(unreadable):
            kept = lowest is not None and checkpoint_id > lowest
            note = f"checkpoint {checkpoint_id} is unreadable ({unreadable[checkpoint_id]}); "
            if checkpoint_id > retained[-1].checkpoint_id:
                note += f"recovered from checkpoint {retained[-1].checkpoint_id} instead; "
            note += (f"chk-{checkpoint_id} is kept for inspection until a newer checkpoint "
                     f"subsumes it" if kept else
                     "it is older than the retained checkpoints and was deleted")
            self._note(note)
            if kept:
                self._quarantined.add(checkpoint_id)
            else:
                delete_dir_quietly(self.storage, checkpoint_dir_name(checkpoint_id))
        # Step 6. Orphans: shared files no retained checkpoint references (a crash between
        # writing and registering or deleting them, a corrupt checkpoint's files).
        shared = storage.list_files(SHARED_DIR)
        if cleanup_orphans:
            protected = set(self.registry) | self._not_owned_paths
            delete_quietly(self.storage, (p for p in shared if p not in protected),
                           "referenced by no retained checkpoint")
        # Step 7. Never reuse an id that names a directory or file already written.
        self._next_id = max([highest_used_id(storage, shared, dir_ids),
                             *(m.checkpoint_id for m in not_owned)]) + 1
        return self

    def _note(self, note: str) -> None:
        logger.warning("%s", note)
        self.recovery_notes.append(note)

    def __repr__(self) -> str:
        latest = self.store.latest
        return (f"CheckpointCoordinator({self.storage.url!r}, latest="
                f"{latest.checkpoint_id if latest else None}, pending={sorted(self._pending)})")

