"""Sinks: where a batch's output goes once its checkpoint is committed.

A sink's :meth:`Sink.commit` may be called more than once for the same batch (a driver that
crashed after the checkpoint commit re-commits on restart), so it must be idempotent by the
batch's lineage and id (:class:`StagedOutput`): the built-in :class:`ParquetSink` publishes a
batch once and skips a replay; a :class:`CallbackSink` passes the batch id to user code, which
must be idempotent by it (Spark's ``foreachBatch`` contract).

A job restored from a snapshot into a new Spark checkpoint location is a new lineage, a
*branch* forking from the snapshot's batch of the snapshot's lineage
(:class:`keyedstate.spark.offsets.Branch`); each built-in sink records the parent with every
batch of a branch, and tells the driver at start which batches of the parent it already holds
after the fork (:meth:`Sink.batches_after`): a rollback, refused unless
``keyedstate.sinks.on-rollback: branch``. docs/sinks.md, "Restarts, restores and rollbacks".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from keyedstate.errors import ConfigurationError, MissingCheckpointFileError

# StagedOutput and read_staged are engine-independent (the local runtime reads staged output
# too); imported from here as before.
from keyedstate.runtime.batch import StagedOutput, read_staged
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.duplication import duplicate_object
from keyedstate.storage.filesystem import fsync_path
from keyedstate.storage.transfer import parallel_map

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from keyedstate.spark.pyspark_types import Session

#: ParquetSink layout: ``<path>/<lineage>-batch-<B:010d>/part-<n:05d>.parquet`` and ``_SUCCESS``
SUCCESS_FILE = "_SUCCESS"
#: where a commit on a local disk writes a batch before renaming it into place; hidden from
#: Spark, pyarrow and pandas by its leading underscore
TEMPORARY_DIR = "_temporary"
_LINEAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: The name of a batch's directory (:func:`batch_dir_name`): the lineage (a Spark query's id)
#: if known, and the batch id. docs/spark.md shows these names from a real run; a test checks
#: that page and a real run against the patterns.
BATCH_DIR_PATTERN = re.compile(
    r"^(?:(?P<lineage>[A-Za-z0-9][A-Za-z0-9_.-]*)-)?batch-(?P<batch_id>\d{10,})$")
#: The name of a part in a batch's directory: ``n`` counts the batch's staged files (one per
#: subtask that emitted rows, in subtask order) from 0.
PART_FILE_PATTERN = re.compile(r"^part-(?P<n>\d{5,})\.parquet$")
#: The id a table sink records for batches whose checkpoint records no lineage (a driver
#: built without a Spark checkpoint location, which ``start()`` never does): batch ids alone
#: tell them apart. (:func:`app_id_of`)
UNKNOWN_LINEAGE_APP_ID = "keyedstate"
#: Commit properties a table sink records with each batch it commits (Delta's ``commitInfo``),
#: naming the batch a table version holds.
COMMIT_LINEAGE = "keyedstate.lineage"
COMMIT_BATCH_ID = "keyedstate.batch_id"
#: ... and, for a batch of a branch, the lineage it forks from and the fork batch
COMMIT_PARENT_LINEAGE = "keyedstate.parent_lineage"
COMMIT_FORK_BATCH_ID = "keyedstate.fork_batch_id"


class Sink(ABC):
    """Receives one output of the job per committed batch."""

    def open(self, schema: pa.Schema) -> None:
        """Check, once, that the destination can take rows of ``schema`` (the output's
        declared schema): called by ``start()`` (``KeyedProcessJob.driver``) before the job
        restores anything or commits any output, so that a destination that would refuse the
        rows fails the start rather than a batch whose checkpoint is already complete. Raises
        a :class:`~keyedstate.errors.ConfigurationError` leaf; it must not write the output.
        Default: nothing to check."""
        return None

    @abstractmethod
    def commit(self, spark: Session, batch_id: int, staged: StagedOutput) -> None:
        """Make the batch's output visible; idempotent by ``(staged.lineage, batch_id)``."""

    def batches_after(self, lineage: str, batch_id: int) -> list[int] | None:
        """The batches of ``lineage`` after ``batch_id`` the destination already holds
        (committed, visible to readers), ascending; None when the sink can't tell (the
        default: a user's sink). Called by ``start()`` on a job restored from a snapshot of
        batch ``batch_id`` of ``lineage`` into a new Spark checkpoint location, before it
        restores or writes anything: a non-empty answer is a rollback over published
        output. Reads only."""
        return None

    def describe(self) -> str:
        """The sink and its destination, for messages."""
        return type(self).__name__


class CallbackSink(Sink):
    """Calls ``fn(dataframe, batch_id)`` with the batch's output as a Spark DataFrame of the
    declared schema (also when the batch has no output rows).

    The staged files are read by the driver (:func:`read_staged`, through the checkpoint
    storage's fsspec filesystem, so any storage works), and the DataFrame is made from that
    one Arrow table: the whole output of a batch goes through the driver's memory once. For
    outputs too large for the driver, use a :class:`ParquetSink` and read its files."""

    def __init__(self, fn: Callable[[DataFrame, int], None]) -> None:
        self.fn = fn

    def commit(self, spark: Session, batch_id: int, staged: StagedOutput) -> None:
        from keyedstate.spark.schema import to_spark_schema

        df = spark.createDataFrame(read_staged(staged), schema=to_spark_schema(staged.schema))
        self.fn(df, batch_id)


def branch_properties(staged: StagedOutput) -> dict[str, str]:
    """What a table sink records with a batch of a branch besides its lineage and batch id
    (Delta ``commitInfo``, Iceberg snapshot summary): the parent lineage and the fork batch;
    nothing for a lineage that is no branch."""
    if not staged.parent_lineage:
        return {}
    return {COMMIT_PARENT_LINEAGE: staged.parent_lineage,
            COMMIT_FORK_BATCH_ID: str(staged.fork_batch_id)}


def app_id_of(lineage: str) -> str:
    """The id under which a table sink records a lineage's batches (Delta's application
    transaction id)."""
    return lineage or UNKNOWN_LINEAGE_APP_ID


def check_partition_columns(sink: str, partition_by: list[str] | None,
                            schema: pa.Schema) -> None:
    """Refuse partition columns of a table sink that the output ``schema`` lacks (the table
    sinks' ``open``), with :class:`ConfigurationError` naming the sink."""
    missing = [c for c in partition_by or [] if c not in schema.names]
    if missing:
        raise ConfigurationError(
            f"{sink} partition columns {missing} are not in the output schema "
            f"({', '.join(schema.names)})"
        )


def staged_batches(staged: StagedOutput) -> Iterator[pa.RecordBatch]:
    """The staged files' rows, file by file in path order (one file in memory at a time),
    cast to the declared schema."""
    for relative in sorted(staged.paths):
        table = pq.read_table(pa.BufferReader(staged.storage.read(relative)))
        yield from table.cast(staged.schema).to_batches()


def batch_dir_name(lineage: str, batch_id: int) -> str:
    """The directory of one batch in a :class:`ParquetSink`: ``<lineage>-batch-<B:010d>``
    (``batch-<B:010d>`` when the lineage is unknown)."""
    if lineage and not _LINEAGE.match(lineage):
        raise ConfigurationError(
            f"batch lineage {lineage!r} can't name a directory: use letters, digits, '_', '.' "
            f"and '-', not starting with '_', '.' or '-'"
        )
    name = f"batch-{batch_id:010d}"
    return f"{lineage}-{name}" if lineage else name


class ParquetSink(Sink):
    """Exactly-once Parquet files, any fsspec URL: one directory per batch,
    ``<path>/<lineage>-batch-<B:010d>/part-<n:05d>.parquet``, with a ``_SUCCESS`` file listing
    the parts (:data:`BATCH_DIR_PATTERN`, :data:`PART_FILE_PATTERN`). In a streaming query the
    lineage is the query's id (Spark's ``StreamingQuery.id``, a uuid kept across restarts and
    savepoint restores; not its ``query_name``), the batch id Spark's. Batches of other
    lineages (other jobs writing to ``path``) are never touched; a batch with no output rows
    writes nothing.

    A commit whose batch is already published does nothing (a replay). Otherwise, on a local
    disk (:meth:`_commit_by_rename`) the parts and ``_SUCCESS`` are written into
    ``<path>/_temporary/`` (which stays, empty between commits) and the batch directory
    appears by one atomic rename: a reader of ``path`` sees every part of a batch or none. On
    an object store (no rename, :meth:`_commit_by_marker`) the parts are copied into the batch
    directory one by one, and ``_SUCCESS`` is written last: a reader sees a batch's parts
    appear one by one (and a crashed commit's parts until the restarted job commits the batch
    again); a batch is complete when its ``_SUCCESS`` exists. Parts are copied by the store
    itself (a reflink or kernel copy on one disk, a server-side copy on one object store), else
    streamed.

    Reading everything: ``pd.read_parquet(path)``, ``pyarrow.dataset.dataset(path)``,
    ``spark.read.option("recursiveFileLookup", "true").parquet(path)`` (Spark reads nested
    directories only as ``key=value`` partitions) or DuckDB
    ``read_parquet('<path>/*/*.parquet')`` (``**`` would also read ``_temporary/``). See docs/spark.md, *ParquetSink files*.
    """

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None) -> None:
        self.path = path.rstrip("/")
        self.storage_options = storage_options or {}

    def describe(self) -> str:
        return f"ParquetSink at {self.path}"

    def batches_after(self, lineage: str, batch_id: int) -> list[int] | None:
        """Batches of ``lineage`` after ``batch_id`` published in :attr:`path` (a
        ``<lineage>-batch-<B>`` directory with its ``_SUCCESS``; a crashed commit's parts
        without it are not published)."""
        if not lineage:
            return None
        target = CheckpointStorage(self.path, self.storage_options)
        return sorted(batch.batch_id for batch in _batch_dirs(target)
                      if batch.lineage == lineage and batch.batch_id > batch_id
                      and target.exists(f"{batch.name}/{SUCCESS_FILE}"))

    def commit(self, spark: Session, batch_id: int, staged: StagedOutput) -> None:
        if not staged.paths:
            return
        name = batch_dir_name(staged.lineage, batch_id)
        target = CheckpointStorage(self.path, self.storage_options)
        if target.is_local:
            self._commit_by_rename(target, name, batch_id, staged)
        else:
            self._commit_by_marker(target, name, batch_id, staged)

    def _commit_by_rename(self, target: CheckpointStorage, name: str, batch_id: int,
                          staged: StagedOutput) -> None:
        """Step 1. The batch directory exists: an earlier commit published it whole (the
            rename is atomic); nothing to do.
        Step 2. Delete what crashed commits of this batch left in ``_temporary/``.
        Step 3. Copy the parts into ``_temporary/<name>-<uuid>/``; fsync them.
        Step 4. :meth:`_publish`: ``_SUCCESS`` in there, then one rename to ``<path>/<name>``.
        """
        # Step 1.
        if os.path.isdir(target.path(name)):
            return
        # Step 2.
        temporary = target.path(TEMPORARY_DIR)
        for entry in _list_local(temporary):
            if entry.startswith(f"{name}-"):
                shutil.rmtree(os.path.join(temporary, entry), ignore_errors=True)
        # Step 3.
        written = f"{TEMPORARY_DIR}/{name}-{uuid.uuid4().hex}"
        files = self._copy_parts(target, written, staged)
        for part in files:
            fsync_path(target.path(f"{written}/{part}"))
        # Step 4.
        self._publish(target, written, name, _manifest(staged, batch_id, files))

    def _commit_by_marker(self, target: CheckpointStorage, name: str, batch_id: int,
                          staged: StagedOutput) -> None:
        """Step 1. ``<name>/_SUCCESS`` exists: the batch is complete; nothing to do.
        Step 2. Delete objects under ``<name>/`` that are not parts of this commit (a crashed
            commit of other staged files: only possible without a lineage).
        Step 3. Copy the parts into ``<name>/`` (a crashed commit's parts are overwritten).
        Step 4. :meth:`_publish`: ``<name>/_SUCCESS``, the batch's last object.
        """
        # Step 1.
        if target.exists(f"{name}/{SUCCESS_FILE}"):
            return
        # Step 2.
        parts = {f"{name}/{_part_name(n)}" for n in range(len(staged.paths))}
        target.delete([p for p in target.list_files(name) if p not in parts])
        # Step 3.
        files = self._copy_parts(target, name, staged)
        # Step 4.
        self._publish(target, name, name, _manifest(staged, batch_id, files))

    def _publish(self, target: CheckpointStorage, written: str, name: str,
                 manifest: bytes) -> None:
        """The step that makes the batch visible and complete: ``_SUCCESS`` (``manifest``) in
        ``written``, the directory holding the parts; when that is a temporary directory
        (local disk), it is then renamed to ``name`` in one atomic step, durably."""
        target.write(f"{written}/{SUCCESS_FILE}", manifest)
        if written == name:
            return
        fsync_path(target.path(f"{written}/{SUCCESS_FILE}"))
        fsync_path(target.path(written))
        try:
            os.rename(target.path(written), target.path(name))
        except OSError:
            if not os.path.isdir(target.path(name)):
                raise
            # Another commit of the batch published it first (never within one driver).
            shutil.rmtree(target.path(written), ignore_errors=True)
        fsync_path(target.root)

    @staticmethod
    def _copy_parts(target: CheckpointStorage, directory: str,
                    staged: StagedOutput) -> dict[str, int]:
        """Copy the staged files to ``<directory>/part-<n>.parquet`` (n in staged-path order,
        so a replay writes the same names); returns ``{part name: size}``."""
        relatives = sorted(staged.paths)
        sizes = staged.storage.sizes(relatives)
        missing = [r for r in relatives if sizes[r] is None]
        if missing:
            raise MissingCheckpointFileError(
                f"staged output {staged.storage.url_of(missing[0])} is missing; it was deleted "
                f"outside keyedstate. Restore from another checkpoint or savepoint"
            )

        def copy(item: tuple[int, str]) -> tuple[str, int]:
            n, relative = item
            size = sizes[relative]
            assert size is not None
            # Never a hard link on one disk: output files must not share an inode with the
            # staged file (or with another sink's copy) that a later write could change.
            duplicate_object(staged.storage, relative, target, f"{directory}/{_part_name(n)}",
                             size, link=False)
            return _part_name(n), size

        return dict(parallel_map(copy, list(enumerate(relatives)), target.transfer.threads))


def _part_name(n: int) -> str:
    return f"part-{n:05d}.parquet"


def _manifest(staged: StagedOutput, batch_id: int, files: dict[str, int]) -> bytes:
    """A batch's ``_SUCCESS``: lineage, batch id, (for a branch) the parent lineage and the
    fork batch, and the parts with their sizes."""
    manifest: dict[str, Any] = {"lineage": staged.lineage, "batch_id": batch_id}
    if staged.parent_lineage:
        manifest.update(parent_lineage=staged.parent_lineage,
                        fork_batch_id=staged.fork_batch_id)
    manifest["files"] = [{"name": k, "size": v} for k, v in sorted(files.items())]
    return json.dumps(manifest).encode()


@dataclass(frozen=True)
class _BatchDir:
    name: str
    lineage: str
    batch_id: int


def _batch_dirs(target: CheckpointStorage) -> list[_BatchDir]:
    """The batch directories in a ParquetSink's path (one listing, not recursive)."""
    try:
        entries = target.call(f"listing {target.root}",
                              lambda: target.fs.ls(target.root, detail=False))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        match = BATCH_DIR_PATTERN.match(name)
        if match:
            found.append(_BatchDir(name, match["lineage"] or "", int(match["batch_id"])))
    return found


@dataclass(frozen=True)
class PublishedBatch:
    """One complete batch of a :class:`ParquetSink` (its ``_SUCCESS`` exists), as its
    manifest describes it; ``parts`` are the URLs of the parts the manifest lists."""

    lineage: str
    batch_id: int
    parent_lineage: str
    fork_batch_id: int
    parts: list[str]
    #: the batch's directory and its parts' names, relative to the sink's path
    directory: str = ""
    files: tuple[str, ...] = ()


def published_batches(path: str, storage_options: dict[str, Any] | None = None, *,
                      lineage: str | None = None) -> list[PublishedBatch]:
    """The complete batches in a :class:`ParquetSink`'s ``path`` (of ``lineage`` only, if
    given), by lineage and batch id: those whose ``_SUCCESS`` exists, each with the parts its
    manifest lists. What a reader on an object store reads to see whole batches only (parts
    of a batch being committed, or of a crashed commit, are left out); on a local disk the
    same as listing ``path``."""
    target = CheckpointStorage(path.rstrip("/"), storage_options)
    batches = []
    for found in sorted(_batch_dirs(target), key=lambda b: (b.lineage, b.batch_id)):
        if lineage is not None and found.lineage != lineage:
            continue
        manifest_path = f"{found.name}/{SUCCESS_FILE}"
        if not target.exists(manifest_path):
            continue
        manifest = json.loads(target.read(manifest_path).decode())
        files = tuple(str(f["name"]) for f in manifest["files"])
        batches.append(PublishedBatch(
            lineage=found.lineage, batch_id=found.batch_id,
            parent_lineage=str(manifest.get("parent_lineage", "")),
            fork_batch_id=int(manifest.get("fork_batch_id", -1)),
            parts=[target.url_of(f"{found.name}/{f}") for f in files],
            directory=found.name, files=files))
    return batches


def read_published(path: str, storage_options: dict[str, Any] | None = None, *,
                   lineage: str | None = None) -> pa.Table:
    """Every row of the complete batches in a :class:`ParquetSink`'s ``path``
    (:func:`published_batches`; of ``lineage`` only, if given), read through fsspec with
    ``storage_options``; an empty table when there is none."""
    target = CheckpointStorage(path.rstrip("/"), storage_options)
    tables = [pq.read_table(pa.BufferReader(target.read(f"{batch.directory}/{name}")))
              for batch in published_batches(path, storage_options, lineage=lineage)
              for name in batch.files]
    return pa.concat_tables(tables) if tables else pa.table({})


def _list_local(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []
