"""DeltaSink: exactly once into a Delta Lake table, through delta-rs (the ``deltalake``
package, ``pip install 'keyedstate[delta]'``; no JVM jar, no Spark write).

Each batch's staged output becomes one Delta commit: readers see all of it or none of it.
The commit records a Delta *application transaction* (``txn`` action) ``app_id`` = the batch's
lineage (the Spark query's id), ``version`` = the batch id, in the same log entry as the data:
a commit finds the table's recorded version for its lineage and skips a batch it already
covers. So a replayed commit (the driver crashed after the Delta commit, before its own
sink-commit marker) adds nothing. See docs/sinks.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import pyarrow as pa

from keyedstate.errors import ConfigurationError, MissingDependencyError, SinkSchemaError
from keyedstate.runtime.batch import StagedOutput

# The commit properties and the app id are shared by the table sinks (sinks.py); the tests
# import COMMIT_* from here as before.
from keyedstate.spark.sinks import (
    COMMIT_BATCH_ID,
    COMMIT_LINEAGE,
    Sink,
    app_id_of,
    branch_properties,
    check_partition_columns,
    staged_batches,
)

if TYPE_CHECKING:
    from deltalake import DeltaTable, Field

    from keyedstate.spark.pyspark_types import Session


def _deltalake() -> ModuleType:
    """The ``deltalake`` module, imported when a DeltaSink is first used (the library and the
    other sinks don't need it)."""
    try:
        return importlib.import_module("deltalake")
    except ImportError as exc:
        raise MissingDependencyError(
            "DeltaSink needs the deltalake package (delta-rs): pip install 'keyedstate[delta]'"
        ) from exc


class DeltaSink(Sink):
    """Appends each batch's output to the Delta table at ``table_uri`` (a local path, or
    ``s3://``, ``gs://``, ``az://``... with delta-rs ``storage_options``, e.g.
    ``AWS_ENDPOINT_URL``, ``AWS_REGION``; not fsspec's options), as one Delta commit per batch
    with output rows (a batch without rows commits nothing).

    - Exactly once: a commit whose batch the table's application transaction for the
      lineage already covers (``transaction_version(lineage) >= batch id``) does nothing; the
      data and the transaction are in one log entry, so there is no window in which one is
      visible without the other. Batch ids of one lineage are committed in increasing order
      (the driver commits batch B before running B + 1), so one number per lineage is enough.
    - One writer per table and lineage: the job's driver. Other writers (other jobs, other
      tools) may append to the same table; their commits don't touch this job's version.
    - Created on first use, with ``partition_by`` (optional partition columns) and the
      output's declared schema. An existing table must have the same columns and Delta types
      (any order), no NOT NULL column the output may leave null, and, when ``partition_by``
      is given, the same partition columns; otherwise :meth:`open` (called by ``start()``)
      raises :class:`~keyedstate.errors.SinkSchemaError` naming both schemas, and nothing is
      written. (delta-rs itself would cast e.g. doubles into a bigint column silently.)
    - Only ``mode="append"``: each batch adds rows; there is no per-batch overwrite.

    Reading: ``deltalake.DeltaTable(uri).to_pyarrow_table()``, Spark with the Delta jar,
    DuckDB's ``delta_scan``, Polars ``read_delta``.
    """

    def __init__(self, table_uri: str, storage_options: Mapping[str, str] | None = None,
                 mode: str = "append", partition_by: Sequence[str] | None = None) -> None:
        if mode != "append":
            raise ConfigurationError(
                f"DeltaSink mode {mode!r} is not supported: each batch is appended "
                f"(mode='append'); an overwrite per batch would keep only the last batch"
            )
        self.table_uri = table_uri.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.mode = mode
        self.partition_by = list(partition_by) if partition_by else None

    def open(self, schema: pa.Schema) -> None:
        """Refuse an existing table that can't take rows of ``schema``, and partition columns
        that are not in ``schema``; no table is created here."""
        check_partition_columns("DeltaSink", self.partition_by, schema)
        table = self._table()
        if table is not None:
            self._check(table, schema)

    def describe(self) -> str:
        return f"DeltaSink at {self.table_uri}"

    def batches_after(self, lineage: str, batch_id: int) -> list[int] | None:
        """Batches of ``lineage`` after ``batch_id`` in the table: none when its application
        transaction for the lineage is at or below ``batch_id``; otherwise the batch ids the
        table's history records for the lineage (``commitInfo``), and at least the
        transaction's version (history may have been cleaned up)."""
        table = self._table()
        if table is None:
            return []
        done = table.transaction_version(app_id_of(lineage))
        if done is None or done <= batch_id:
            return []
        found = {done}
        for commit in table.history():
            if commit.get(COMMIT_LINEAGE) == lineage and COMMIT_BATCH_ID in commit:
                found.add(int(commit[COMMIT_BATCH_ID]))
        return sorted(b for b in found if b > batch_id)

    def commit(self, spark: Session, batch_id: int, staged: StagedOutput) -> None:
        """Step 1. No rows: nothing to commit.
        Step 2. The table exists and its transaction for the lineage covers ``batch_id``:
            an earlier commit of the batch succeeded (a replay); nothing to do. The table is
            checked again (another writer may have changed it since ``start()``).
        Step 3. One Delta commit: every staged file's rows (streamed, one file in memory at a
            time) with the transaction ``(lineage, batch_id)``; it creates the table if absent.
        """
        # Step 1.
        if not staged.paths:
            return
        deltalake = _deltalake()
        app_id = app_id_of(staged.lineage)
        # Step 2.
        table = self._table()
        if table is not None:
            done = table.transaction_version(app_id)
            if done is not None and done >= batch_id:
                return
            self._check(table, staged.schema)
        # Step 3.
        properties = deltalake.CommitProperties(
            app_transactions=[deltalake.Transaction(app_id=app_id, version=batch_id)],
            custom_metadata={COMMIT_LINEAGE: staged.lineage, COMMIT_BATCH_ID: str(batch_id),
                             **branch_properties(staged)})
        reader = pa.RecordBatchReader.from_batches(staged.schema, staged_batches(staged))
        deltalake.write_deltalake(
            table if table is not None else self.table_uri, reader, mode="append",
            partition_by=self.partition_by,
            storage_options=None if table is not None else self.storage_options or None,
            commit_properties=properties)

    def _table(self) -> DeltaTable | None:
        """The table at :attr:`table_uri` as of now, None if there is none yet."""
        deltalake = _deltalake()
        options = self.storage_options or None
        if not deltalake.DeltaTable.is_deltatable(self.table_uri, storage_options=options):
            return None
        return deltalake.DeltaTable(self.table_uri, storage_options=options)

    def _check(self, table: DeltaTable, schema: pa.Schema) -> None:
        """Raise :class:`SinkSchemaError` unless ``table`` takes rows of ``schema`` exactly
        (rules in the class docstring)."""
        deltalake = _deltalake()
        have = {f.name: f for f in table.schema().fields}
        want = {f.name: f for f in deltalake.Schema.from_arrow(schema).fields}
        problems = [f"column {n!r} is missing from the table" for n in want if n not in have]
        problems += [f"the table's column {n!r} is not in the output" for n in have
                     if n not in want]
        for name in want.keys() & have.keys():
            if want[name].type != have[name].type:
                problems.append(f"column {name!r} is {_type(have[name])} in the table, "
                                f"{_type(want[name])} in the output")
            elif not have[name].nullable and want[name].nullable:
                problems.append(f"column {name!r} is NOT NULL in the table, nullable in the "
                                f"output")
        partitions = list(table.metadata().partition_columns)
        if self.partition_by is not None and partitions != self.partition_by:
            problems.append(f"the table is partitioned by {partitions}, the sink by "
                            f"{self.partition_by}")
        if problems:
            raise SinkSchemaError(
                f"the Delta table {self.table_uri} can't take this job's output: "
                f"{'; '.join(sorted(problems))}. Table schema: {_describe(have.values())}; "
                f"output schema: {_describe(want.values())}. Nothing was written: write to "
                f"another table, or change the output schema"
            )


def _type(field: Field) -> str:
    """A Delta type as Delta names it: ``long``, ``timestamp``, ``struct<...>``..."""
    kind = field.type
    return str(kind.type) if type(kind).__name__ == "PrimitiveType" else str(kind)


def _describe(fields: Iterable[Field]) -> str:
    return ", ".join(f"{f.name} {_type(f)}{'' if f.nullable else ' NOT NULL'}" for f in fields)
