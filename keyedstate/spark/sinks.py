"""Sinks: where a batch's output goes once its checkpoint is committed.

A sink's :meth:`Sink.commit` may be called more than once for the same batch (a driver that
crashed after the checkpoint commit re-commits on restart), so it must be idempotent by batch
id: the built-in :class:`ParquetSink` replaces the batch's files; a :class:`CallbackSink`
passes the batch id to user code, which must be idempotent by it (Spark's ``foreachBatch``
contract).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from keyedstate.checkpoint.storage import CheckpointStorage, connect


@dataclass(frozen=True)
class StagedOutput:
    """One output of one batch, staged as Parquet files in checkpoint storage."""

    storage: CheckpointStorage
    paths: list[str]
    schema: pa.Schema

    def urls(self) -> list[str]:
        return [self.storage.url_of(p) for p in self.paths]


class Sink(ABC):
    """Receives one output of the job per committed batch."""

    @abstractmethod
    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        """Make the batch's output visible; idempotent by ``batch_id``."""


def read_staged(staged: StagedOutput) -> pa.Table:
    """The batch's output as one Arrow table of ``staged.schema``, read in this process through
    the staging storage's filesystem (any fsspec URL, S3 included)."""
    tables = [pq.read_table(pa.BufferReader(staged.storage.read(relative)))
              for relative in sorted(staged.paths)]
    if not tables:
        return staged.schema.empty_table()
    return pa.concat_tables(tables).cast(staged.schema)


class CallbackSink(Sink):
    """Calls ``fn(dataframe, batch_id)`` with the batch's output as a Spark DataFrame of the
    declared schema (also when the batch has no output rows).

    The staged files are read by the driver (:func:`read_staged`, through the checkpoint
    storage's fsspec filesystem, so any storage works), and the DataFrame is made from that
    one Arrow table: the whole output of a batch goes through the driver's memory once. For
    outputs too large for the driver, use a :class:`ParquetSink` and read its files."""

    def __init__(self, fn: Callable[[Any, int], None]) -> None:
        self.fn = fn

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        from keyedstate.spark.schema import to_spark_schema

        df = spark.createDataFrame(read_staged(staged), schema=to_spark_schema(staged.schema))
        self.fn(df, batch_id)


class ParquetSink(Sink):
    """Exactly-once Parquet files: ``<path>/batch-<id>-part-<n>.parquet``, any fsspec URL.

    A commit first deletes any file of the same batch (a replay), then copies the staged files
    in (a server-side or local copy when both are on one filesystem). A batch with no output
    rows writes no file.
    """

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None) -> None:
        self.path = path.rstrip("/")
        self.storage_options = storage_options or {}

    def commit(self, spark: Any, batch_id: int, staged: StagedOutput) -> None:
        # Listings drive the replay cleanup below: never from a stale cache (see connect).
        fs, root = connect(self.path, self.storage_options)
        fs.makedirs(root, exist_ok=True)
        prefix = f"batch-{batch_id:010d}-part-"
        for existing in fs.ls(root, detail=False):
            if existing.rstrip("/").rsplit("/", 1)[-1].startswith(prefix):
                fs.rm_file(existing)
        source = staged.storage
        for n, relative in enumerate(sorted(staged.paths)):
            target = f"{root}/{prefix}{n:05d}.parquet"
            if type(fs) is type(source.fs):
                fs.copy(source.path(relative), target)
            else:
                fs.pipe_file(target, source.read(relative))
