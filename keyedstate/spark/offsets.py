"""Spark's source positions: the offset log of a streaming query, carried with savepoints.

Structured Streaming keeps a query's source positions in its checkpoint location (the
``spark_checkpoint_location`` of :meth:`~keyedstate.spark.api.KeyedProcessJob.start`)::

    metadata              {"id": "<query id>"}: the query's identity, kept across restarts
    offsets/<B>           the source offsets batch B reads up to (written before B runs)
    commits/<B>           batch B is done (written after ``foreachBatch`` returned)
    sources/<n>/...       per-source logs (the file source's list of seen files, the rate
                          source's start time)
    keyedstate-branch.json  keyedstate's own: the location was seeded from a snapshot
                          (:class:`Branch`: its query id, the parent query id, the fork batch)

A batch id means something only within one such log. A keyedstate checkpoint records the batch
it covers; for it to be restored with Flink's guarantee (the source resumes exactly after the
snapshot's batch), the log must come along. So a savepoint carries a copy of the log up to its
batch (:func:`capture`), and a job restored from it in a new checkpoint location seeds that
location with the copy before Spark starts (:func:`seed`). The seeded location gets a query id
of its own: the restored job is a new *branch* of the lineage (its batch ids after the fork
may collide with batches the old query published after the snapshot, and a sink keyed by
(query id, batch id) must not take them for replays); :class:`Branch` records the parent.
Nothing here imports pyspark: the log is read and written as files, through fsspec
(``s3a://`` is read as ``s3://``).

Spark's own stateful operators keep state under ``state/``: it is not carried (keyedstate
holds the job's state); a query with such operators upstream of ``key_by`` restores only in
its own location.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from keyedstate.checkpoint.savepoint import CONTEXT_DIR
from keyedstate.errors import SourcePositionsError
from keyedstate.storage.checkpoint_storage import CheckpointStorage

log = logging.getLogger("keyedstate")

#: Files and directories of a Spark checkpoint location.
QUERY_METADATA = "metadata"
OFFSETS = "offsets"
COMMITS = "commits"
SOURCES = "sources"
#: Where a savepoint keeps its copy of the log (relative to the savepoint's root).
SOURCE_LOG_DIR = f"{CONTEXT_DIR}/spark-source"
#: ``_metadata`` properties: the copy's directory, and the query id the batch ids belong to.
PROP_SOURCE_LOG = "spark_source_log"
PROP_QUERY_ID = "spark_query_id"
#: ``_metadata`` property: the Spark checkpoint location (offset log) of the query.
PROP_SPARK_CHECKPOINT_LOCATION = "spark_checkpoint_location"
#: ``_metadata`` properties of a branch's checkpoints: the parent query id and the fork batch.
PROP_PARENT_QUERY_ID = "spark_parent_query_id"
PROP_FORK_BATCH_ID = "spark_fork_batch_id"
#: keyedstate's file in a seeded Spark checkpoint location (:class:`Branch`); Spark reads only
#: ``metadata``, ``offsets``, ``commits``, ``sources`` and ``state`` there.
BRANCH_FILE = "keyedstate-branch.json"
BRANCH_FORMAT_VERSION = 1


def _storage(location: str, storage_options: Mapping[str, Any] | None) -> CheckpointStorage:
    """The location through fsspec: Spark's Hadoop name ``s3a://`` is s3fs's ``s3://``; the
    job's storage options apply to a remote location (a local one takes none)."""
    url = "s3://" + location[len("s3a://"):] if location.startswith("s3a://") else location
    local = "://" not in url or url.startswith("file://")
    return CheckpointStorage(url, None if local else storage_options)


def _is_log_file(relative: str) -> bool:
    """Hadoop writes a hidden ``.<name>.crc`` beside each file on a local disk; it is
    optional on read, and a copy never needs it (a stale one would fail the read)."""
    return not any(part.startswith(".") for part in relative.split("/"))


@dataclass(frozen=True)
class Branch:
    """A query seeded from a snapshot: ``query_id`` (fresh, its own lineage) forks from batch
    ``fork_batch_id`` of query ``parent_query_id``. Stored as :data:`BRANCH_FILE`, a versioned
    JSON object decoded by :meth:`decode` alone."""

    query_id: str
    parent_query_id: str
    fork_batch_id: int
    #: the copy of the log it was seeded from (a savepoint's, or the parent's location)
    seeded_from: str = ""

    def encode(self) -> bytes:
        return json.dumps({"version": BRANCH_FORMAT_VERSION, "query_id": self.query_id,
                           "parent_query_id": self.parent_query_id,
                           "fork_batch_id": self.fork_batch_id,
                           "seeded_from": self.seeded_from}).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> Branch:
        """The branch in ``data`` (the file at ``where``); :class:`SourcePositionsError` for a
        file of another version or shape."""
        try:
            raw = json.loads(data.decode())
            if raw.get("version") != BRANCH_FORMAT_VERSION:
                raise ValueError(f"version {raw.get('version')!r}, expected "
                                 f"{BRANCH_FORMAT_VERSION}")
            return cls(str(raw["query_id"]), str(raw["parent_query_id"]),
                       int(raw["fork_batch_id"]), str(raw.get("seeded_from", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SourcePositionsError(
                f"{where} is not a keyedstate branch record this version reads ({exc}); it "
                f"was written by another keyedstate version or changed by hand. Start the "
                f"restored job with a new, empty spark_checkpoint_location"
            ) from exc

    def properties(self) -> dict[str, str]:
        """The ``_metadata`` properties naming the parent (recorded by each checkpoint)."""
        return {PROP_PARENT_QUERY_ID: self.parent_query_id,
                PROP_FORK_BATCH_ID: str(self.fork_batch_id)}


@dataclass(frozen=True)
class OffsetLog:
    """A Spark checkpoint location, or a snapshot's copy of one (the same layout)."""

    storage: CheckpointStorage

    @classmethod
    def at(cls, location: str, storage_options: Mapping[str, Any] | None = None) -> OffsetLog:
        return cls(_storage(location, storage_options))

    @property
    def url(self) -> str:
        return self.storage.url

    def batches(self, folder: str) -> list[int]:
        """Batch ids with a file in ``offsets`` or ``commits``, ascending."""
        return sorted(int(name.rsplit("/", 1)[-1]) for name in self.storage.list_files(folder)
                      if _is_log_file(name) and name.rsplit("/", 1)[-1].isdigit())

    def query_id(self) -> str | None:
        """The query's id (Spark writes it when the query first starts)."""
        if not self.storage.exists(QUERY_METADATA):
            return None
        return str(json.loads(self.storage.read(QUERY_METADATA).decode().strip())["id"])

    def branch(self) -> Branch | None:
        """The branch record of a location seeded from a snapshot (:func:`seed`), None
        for a query Spark started itself."""
        if not self.storage.exists(BRANCH_FILE):
            return None
        return Branch.decode(self.storage.read(BRANCH_FILE), self.storage.url_of(BRANCH_FILE))

    def last_committed(self) -> int:
        """The last batch Spark recorded as done, -1 if none."""
        committed = self.batches(COMMITS)
        return committed[-1] if committed else -1

    def _replace(self, relative: str, data: bytes) -> None:
        folder, _, name = relative.rpartition("/")
        self.storage.delete([f"{folder}/.{name}.crc"])
        self.storage.write(relative, data)

    def record_no_data_batch(self, batch_id: int) -> None:
        """Record ``batch_id`` as a done batch that read nothing (what Spark writes for its
        no-data batches): its offsets are the previous batch's, so the next batch reads from
        where that one ended. A plan Spark wrote for ``batch_id`` and never ran is replaced.
        Used for a drain, which consumes a batch id of its own."""
        previous = batch_id - 1
        self._replace(f"{OFFSETS}/{batch_id}", self.storage.read(f"{OFFSETS}/{previous}"))
        self._replace(f"{COMMITS}/{batch_id}", self.storage.read(f"{COMMITS}/{previous}"))


def rewind(location: OffsetLog, batch_id: int) -> list[int]:
    """Make Spark run the batches after ``batch_id`` again in ``location`` (the asynchronous
    mode's restart, docs/checkpoints.md "The asynchronous phase": Spark recorded them as done
    while their checkpoints never completed): delete ``commits/<b>`` for b > ``batch_id`` and
    ``offsets/<b>`` for b > ``batch_id`` + 1 (Hadoop's ``.crc`` files with them). Spark then
    runs ``batch_id`` + 1 again with its logged offsets (a batch whose offsets are logged and
    whose commit is not) and plans the later ones afresh. A file source's log entries after
    the log offset that batch reads up to are deleted too (as :func:`copy_log` leaves them
    out): they list the files it found for the later plans, and kept, the first new plan
    would take them all at once whatever its ``maxFilesPerTrigger``; deleted, the source finds
    the files again and plans them as before. A compaction (``<k>.compact``) after that offset
    is kept (it holds the entries before it too): the later plans then differ, the input is
    still read once. Returns the batch ids whose commits were deleted. Commits go first,
    the newest first: a crash half-way leaves a log Spark reads the same way."""
    undone = [b for b in location.batches(COMMITS) if b > batch_id]
    unplanned = [b for b in location.batches(OFFSETS) if b > batch_id + 1]
    for folder, batches in ((COMMITS, undone), (OFFSETS, unplanned)):
        for b in sorted(batches, reverse=True):
            location.storage.delete([f"{folder}/{b}", f"{folder}/.{b}.crc"])
    rerun = f"{OFFSETS}/{batch_id + 1}"
    if undone and location.storage.exists(rerun):
        read_up_to = _file_source_offsets(location.storage.read(rerun))
        later = [f for f in location.storage.list_files(SOURCES)
                 if _is_log_file(f) and not f.endswith(".compact")
                 and not _source_file(f, read_up_to)]
        for relative in sorted(later, reverse=True):
            folder, _, name = relative.rpartition("/")
            location.storage.delete([relative, f"{folder}/.{name}.crc"])
    return undone


def copy_log(source: OffsetLog, batch_id: int, target: CheckpointStorage,
             folder: str = "", *, with_query_id: bool = True) -> None:
    """Copy ``source``'s log up to ``batch_id`` into ``target`` (under ``folder``).

    Copied: ``offsets`` and ``commits`` of batches up to ``batch_id`` (a plan for a later
    batch, or a later batch of a job that went on, is left out: the query resumes after
    ``batch_id`` and plans again), every source's log, a file source's only up to the log
    offset ``offsets/<batch_id>`` records for it (:func:`_source_file`), and the query id last (a location with it and
    without offsets would be a new query). The batch is complete in keyedstate's state, so the
    copy records it as done even when Spark had not yet written ``commits/<batch_id>`` (a
    snapshot taken while the batch committed). Without ``with_query_id`` the query id is left
    for the caller to write (:func:`seed`: a fresh one). Raises :class:`SourcePositionsError`
    when the log lacks the batch's offsets."""
    if batch_id not in source.batches(OFFSETS):
        raise SourcePositionsError(
            f"{source.url} has no offsets of batch {batch_id}: a savepoint's copy of Spark's "
            f"offset log that is missing or incomplete (its context/ folder was removed), or "
            f"not the Spark checkpoint location of the job whose snapshot covers batch "
            f"{batch_id}"
        )
    committed = source.batches(COMMITS)
    files = [f for f in source.storage.list_files() if _is_log_file(f)]
    read_up_to = _file_source_offsets(source.storage.read(f"{OFFSETS}/{batch_id}"))
    keep = [f for f in files if _source_file(f, read_up_to) or _batch_file(f, OFFSETS, batch_id)
            or _batch_file(f, COMMITS, batch_id)]
    prefix = f"{folder}/" if folder else ""
    for relative in keep:
        target.write(prefix + relative, source.storage.read(relative))
    if batch_id not in committed:
        template = (source.storage.read(f"{COMMITS}/{committed[-1]}") if committed
                    else b'v1\n{"nextBatchWatermarkMs":0}')
        target.write(f"{prefix}{COMMITS}/{batch_id}", template)
    if with_query_id and source.storage.exists(QUERY_METADATA):
        target.write(prefix + QUERY_METADATA, source.storage.read(QUERY_METADATA))


def capture(source: OffsetLog, batch_id: int, target: CheckpointStorage,
            folder: str = SOURCE_LOG_DIR) -> dict[str, str]:
    """Copy ``source``'s log up to ``batch_id`` into ``target/folder`` (a savepoint being
    written, :func:`copy_log`) and return the ``_metadata`` properties naming the copy."""
    copy_log(source, batch_id, target, folder)
    props = {PROP_SOURCE_LOG: folder}
    query_id = source.query_id()
    if query_id:
        props[PROP_QUERY_ID] = query_id
    return props


def _file_source_offsets(offsets: bytes) -> dict[int, int]:
    """Per source index, the log offset a file source had read up to in a batch's
    ``offsets/<B>`` file (``v1``, the batch's metadata, then one offset per source in the
    order of ``sources/<n>``; a file source's is ``{"logOffset": N}``). Other sources' offsets
    are left out: their logs are copied whole."""
    found: dict[int, int] = {}
    for index, line in enumerate(offsets.decode().splitlines()[2:]):
        try:
            offset = json.loads(line)
        except ValueError:
            continue  # "-": a source without an offset yet
        if isinstance(offset, dict) and isinstance(offset.get("logOffset"), int):
            found[index] = offset["logOffset"]
    return found


def _source_file(relative: str, read_up_to: Mapping[int, int]) -> bool:
    """Whether ``relative`` is a source-log file a copy keeps: any file of a source not in
    ``read_up_to``; of a file source, the entries (``<k>``, and the compactions ``<k>.compact``
    that hold every entry up to ``k``) up to its log offset. A file source's later entries
    (files the parent query found after the batch: its next plans, or a job that went on)
    are left out, or the resumed query would read them all in its first batch, whatever its
    ``maxFilesPerTrigger``, instead of planning its batches as the parent did."""
    parts = relative.split("/")
    if parts[0] != SOURCES:
        return False
    if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) not in read_up_to:
        return True
    entry = parts[2].removesuffix(".compact")
    return not entry.isdigit() or int(entry) <= read_up_to[int(parts[1])]


def _batch_file(relative: str, folder: str, up_to: int) -> bool:
    head, _, name = relative.rpartition("/")
    return head == folder and name.isdigit() and int(name) <= up_to


def seeded_branch(location: OffsetLog, parent: str, batch_id: int) -> Branch | None:
    """The branch ``location`` was seeded as from batch ``batch_id`` of query ``parent``
    (:func:`seed`), None if it was not (empty, or another query's location)."""
    branch = location.branch()
    if (branch is None or branch.query_id != location.query_id()
            or branch.parent_query_id != parent or branch.fork_batch_id != batch_id):
        return None
    return branch


def seed(location: OffsetLog, carried: OffsetLog, batch_id: int, *,
         ahead: int = 0) -> Branch | None:
    """Make ``location`` (a new job's Spark checkpoint location) resume exactly after
    ``batch_id`` by copying ``carried`` (a snapshot's copy of the log, or the location of the
    job that wrote it) into it, up to that batch (:func:`copy_log`), as a new branch: the
    location's query id is a fresh one, and :data:`BRANCH_FILE` records it with the parent
    (``carried``'s query id) and the fork batch ``batch_id``. Returns the branch (None: the
    location is the parent query's own, step 1).

    Step 1. A location already seeded as this branch (its branch record names the same parent
        and fork batch and its query id; a start that crashed before the first checkpoint:
        Spark may have planned batches after ``batch_id`` since, none of them done, or, in
        the asynchronous mode, up to ``ahead`` done whose checkpoints never completed, which
        the driver then rewinds) is left as it is; so is the parent query's own location, not
        past ``batch_id`` (no branch: the parent query goes on there).
    Step 2. A location holding a query's ``metadata`` otherwise raises
        :class:`SourcePositionsError`: Spark would resume from positions the state does not
        match.
    Step 3. Copy the log (empty location, or a seed cut short: ``metadata`` is written last),
        then the branch record, then ``metadata`` with the fresh id.
    """
    parent = carried.query_id() or ""
    current = location.query_id()
    # Step 1.
    if current is not None:
        done = location.last_committed()
        if done <= batch_id + ahead:
            branch = seeded_branch(location, parent, batch_id)
            if branch is not None:
                return branch
        if done <= batch_id and current == parent:
            return None  # the parent's own location (named otherwise): its query goes on
        # Step 2.
        raise SourcePositionsError(
            f"the Spark checkpoint location {location.url} holds another query's source "
            f"positions (query {current}, batches done up to {location.last_committed()}), "
            f"not those of the restored snapshot (query {parent or '?'}, batch "
            f"{batch_id}); start the restored job with a new, empty spark_checkpoint_location"
        )
    # Step 3.
    branch = Branch(query_id=str(uuid.uuid4()), parent_query_id=parent,
                    fork_batch_id=batch_id, seeded_from=carried.url)
    copy_log(carried, batch_id, location.storage, with_query_id=False)
    # metadata last: a location with metadata is a seeded one. The branch record before it.
    location.storage.write(BRANCH_FILE, branch.encode())
    location.storage.write(QUERY_METADATA, json.dumps({"id": branch.query_id}).encode())
    log.info("seeded the Spark checkpoint location %s from %s: the query resumes after "
             "batch %d as query %s, a branch of query %s", location.url, carried.url,
             batch_id, branch.query_id, parent or "(unknown)")
    return branch
