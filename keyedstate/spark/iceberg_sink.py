"""IcebergSink: exactly once into an Apache Iceberg table, through pyiceberg
(``pip install 'keyedstate[iceberg]'``; no JVM jar, no Spark write: the driver writes).

Each batch's staged output becomes one Iceberg snapshot (one ``append``): readers see all of
it or none of it. The snapshot's summary records the batch's lineage (the Spark query's id)
and batch id, as Flink's ``IcebergFilesCommitter`` records its job id and checkpoint id:
before each commit the sink walks the table's current snapshot and its ancestors to the
newest snapshot of its lineage and skips a batch at or below that snapshot's batch id. So a
replayed commit (the driver crashed after the Iceberg commit, before its own sink-commit
marker) adds nothing. See docs/sinks.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Union

import pyarrow as pa

from keyedstate.errors import ConfigurationError, MissingDependencyError, SinkSchemaError
from keyedstate.runtime.batch import StagedOutput, read_staged
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
    from pyiceberg.catalog import Catalog
    from pyiceberg.schema import Schema
    from pyiceberg.table import Table
    from pyiceberg.types import IcebergType, NestedField

    from keyedstate.spark.pyspark_types import Session

#: The catalog name :class:`IcebergSink` loads its catalog properties under (pyiceberg's
#: ``load_catalog(name, **properties)``; also the name it looks up in ``.pyiceberg.yaml``).
DEFAULT_CATALOG_NAME = "keyedstate"

CatalogSpec = Union["Catalog", Mapping[str, str]]


def _pyiceberg_catalog() -> ModuleType:
    """The ``pyiceberg.catalog`` module, imported when an IcebergSink is first used (the
    library and the other sinks don't need pyiceberg)."""
    try:
        return importlib.import_module("pyiceberg.catalog")
    except ImportError as exc:
        raise MissingDependencyError(
            "IcebergSink needs the pyiceberg package: pip install 'keyedstate[iceberg]'"
        ) from exc


def committed_batch_id(table: Table, lineage: str) -> int | None:
    """The newest batch of ``lineage`` (an :func:`~keyedstate.spark.sinks.app_id_of` id) in
    ``table``: the batch id in the summary of the newest snapshot of the lineage among the
    current snapshot and its ancestors; None if there is none. (Flink's
    ``IcebergFilesCommitter.getMaxCommittedCheckpointId``.) Ancestors only: a snapshot rolled
    back out of the table's history no longer counts."""
    from pyiceberg.table.snapshots import ancestors_of

    for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
        summary = snapshot.summary
        if summary is None or summary.get(COMMIT_LINEAGE) != lineage:
            continue
        batch_id = summary.get(COMMIT_BATCH_ID)
        if batch_id is not None:
            return int(batch_id)
    return None


def batches_of(table: Table, lineage: str) -> list[int]:
    """Every batch of ``lineage`` among the current snapshot and its ancestors, ascending."""
    from pyiceberg.table.snapshots import ancestors_of

    found = set()
    for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
        summary = snapshot.summary
        if summary is not None and summary.get(COMMIT_LINEAGE) == lineage:
            batch_id = summary.get(COMMIT_BATCH_ID)
            if batch_id is not None:
                found.add(int(batch_id))
    return sorted(found)


class IcebergSink(Sink):
    """Appends each batch's output to the Iceberg table ``table`` (``"namespace.name"``, or a
    tuple of parts) of ``catalog``, as one snapshot per batch with output rows (a batch
    without rows commits nothing).

    ``catalog`` is either a pyiceberg ``Catalog`` or the properties pyiceberg's
    ``load_catalog(catalog_name, **properties)`` takes, e.g. a SQL catalog on SQLite:
    ``{"type": "sql", "uri": "sqlite:////data/catalog.db", "warehouse": "s3://bucket/wh",
    "s3.endpoint": ..., "s3.region": ...}`` (pyiceberg's property names, not fsspec's),
    loaded under ``catalog_name`` (a SQL catalog keeps the tables of every catalog name in one
    database, apart: a reader must load the catalog under the same name). The sink commits on the driver only (``Sink.commit`` runs in the driver process, never in a
    Spark task), so a ``Catalog`` object need not pickle; given properties, the sink loads the
    catalog on first use and pickles as its arguments.

    - Exactly once: a commit whose batch id is at or below :func:`committed_batch_id` for the
      lineage does nothing; the rows and the summary entries (``keyedstate.lineage``,
      ``keyedstate.batch_id``) are one snapshot, one atomic catalog commit, so there is no
      window in which one is visible without the other. Batch ids of one lineage are
      committed in increasing order (the driver commits batch B before running B + 1), so
      the newest snapshot of the lineage is enough.
    - One writer per table and lineage: the job's driver. Other writers may append to the
      same table (pyiceberg retries a commit that lost a race on fresh metadata). Expiring
      snapshots must keep the newest snapshot of a running job's lineage in the current
      snapshot's ancestry (as for Flink's committer); otherwise a replayed batch is appended
      again.
    - Created on first use (the first commit with rows), with the output's declared schema
      and ``partition_by`` (identity partitions). An existing table must have the same columns
      and Iceberg types (any order), no required column the output may leave null, and, when
      ``partition_by`` is given, exactly identity partitions on those columns; otherwise
      :meth:`open` (called by ``start()``) raises :class:`~keyedstate.errors.SinkSchemaError`
      naming both schemas, and nothing is written. (pyiceberg would promote e.g. ints into a
      long column, and fill a missing optional column with nulls.)
    - Memory: an unpartitioned table is appended from the staged files streamed one file at a
      time; a partitioned one from the batch's output as one Arrow table (pyiceberg 0.12
      appends a stream only to unpartitioned tables).

    Reading: ``catalog.load_table(name).scan().to_pandas()`` (or ``to_arrow``, ``to_duckdb``),
    Spark or Trino with the same catalog, DuckDB's ``iceberg_scan`` on the metadata file.
    """

    def __init__(self, catalog: CatalogSpec, table: str | Sequence[str],
                 partition_by: Sequence[str] | None = None,
                 catalog_name: str = DEFAULT_CATALOG_NAME) -> None:
        identifier = tuple(table.split(".")) if isinstance(table, str) else tuple(table)
        if len(identifier) < 2 or not all(identifier):
            raise ConfigurationError(
                f"IcebergSink table {table!r} must name a namespace and a table, e.g. "
                f"'analytics.counts'"
            )
        self.identifier = identifier
        self.partition_by = list(partition_by) if partition_by else None
        self.catalog_name = catalog_name
        if isinstance(catalog, Mapping):
            self.catalog_properties: dict[str, str] | None = dict(catalog)
            self._catalog: Catalog | None = None
        else:
            self.catalog_properties = None
            self._catalog = catalog

    @property
    def table_name(self) -> str:
        """The table identifier, dotted (``namespace.table``)."""
        return ".".join(self.identifier)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.catalog_properties is not None:
            state["_catalog"] = None  # loaded again from the properties where unpickled
        return state

    def catalog(self) -> Catalog:
        """The catalog: the one given, or loaded (once) from the given properties."""
        if self._catalog is None:
            module = _pyiceberg_catalog()
            assert self.catalog_properties is not None
            self._catalog = module.load_catalog(self.catalog_name, **self.catalog_properties)
        return self._catalog

    def open(self, schema: pa.Schema) -> None:
        """Refuse an existing table that can't take rows of ``schema``, and partition columns
        that are not in ``schema``; no table is created here."""
        check_partition_columns("IcebergSink", self.partition_by, schema)
        table = self._table()
        if table is not None:
            self._check(table, schema)

    def describe(self) -> str:
        return f"IcebergSink table {self.table_name}"

    def batches_after(self, lineage: str, batch_id: int) -> list[int] | None:
        """Batches of ``lineage`` after ``batch_id`` in the current snapshot's ancestry
        (:func:`batches_of`)."""
        table = self._table()
        if table is None:
            return []
        return [b for b in batches_of(table, app_id_of(lineage)) if b > batch_id]

    def commit(self, spark: Session, batch_id: int, staged: StagedOutput) -> None:
        """Step 1. No rows: nothing to commit.
        Step 2. The table exists and its newest snapshot of the lineage holds ``batch_id`` or
            a later batch: an earlier commit of the batch succeeded (a replay); nothing to do.
            The table is checked again (another writer may have changed it since ``start()``).
            No table: create it (an empty table, no snapshot), with the declared schema and
            partitions.
        Step 3. One append, one snapshot: the staged rows with the summary entries
            ``(lineage, batch_id)``.
        """
        # Step 1.
        if not staged.paths:
            return
        lineage = app_id_of(staged.lineage)
        # Step 2.
        table = self._table()
        if table is not None:
            done = committed_batch_id(table, lineage)
            if done is not None and done >= batch_id:
                return
            self._check(table, staged.schema)
        else:
            table = self._create(staged.schema)
        # Step 3.
        rows: pa.Table | pa.RecordBatchReader
        if table.spec().is_unpartitioned():
            rows = pa.RecordBatchReader.from_batches(staged.schema, staged_batches(staged))
        else:
            rows = read_staged(staged)
        table.append(rows, snapshot_properties={COMMIT_LINEAGE: lineage,
                                                COMMIT_BATCH_ID: str(batch_id),
                                                **branch_properties(staged)})

    def _table(self) -> Table | None:
        """The table as of now, None if there is none yet."""
        from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

        try:
            return self.catalog().load_table(self.identifier)
        except (NoSuchTableError, NoSuchNamespaceError):
            return None

    def _create(self, schema: pa.Schema) -> Table:
        """Create the table (and its namespace) in one catalog commit: schema and partition
        spec together, so no table without its partitions is ever visible. A table another
        writer created meanwhile is loaded and checked instead."""
        from pyiceberg.exceptions import TableAlreadyExistsError

        catalog = self.catalog()
        catalog.create_namespace_if_not_exists(self.identifier[:-1])
        try:
            create = catalog.create_table_transaction(self.identifier, schema=schema)
            if self.partition_by:
                with create.update_spec() as spec:
                    for column in self.partition_by:
                        spec.add_identity(column)
            return create.commit_transaction()
        except TableAlreadyExistsError:
            table = catalog.load_table(self.identifier)
            self._check(table, schema)
            return table

    def _check(self, table: Table, schema: pa.Schema) -> None:
        """Raise :class:`SinkSchemaError` unless ``table`` takes rows of ``schema`` exactly
        (rules in the class docstring)."""
        have = {f.name: f for f in table.schema().fields}
        want = {f.name: f for f in _iceberg_schema(schema).fields}
        problems = [f"column {n!r} is missing from the table" for n in want if n not in have]
        problems += [f"the table's column {n!r} is not in the output" for n in have
                     if n not in want]
        for name in want.keys() & have.keys():
            have_type, want_type = _type(have[name].field_type), _type(want[name].field_type)
            if have_type != want_type:
                problems.append(f"column {name!r} is {have_type} in the table, {want_type} "
                                f"in the output")
            elif have[name].required and not want[name].required:
                problems.append(f"column {name!r} is required in the table, optional in the "
                                f"output")
        partitions = _partitions(table)
        wanted = [f"identity({c})" for c in self.partition_by or []]
        if self.partition_by is not None and partitions != wanted:
            problems.append(f"the table is partitioned by [{', '.join(partitions)}], the sink "
                            f"by [{', '.join(wanted)}]")
        if problems:
            raise SinkSchemaError(
                f"the Iceberg table {self.table_name} can't take this job's output: "
                f"{'; '.join(sorted(problems))}. Table schema: {_describe(have.values())}; "
                f"output schema: {_describe(want.values())}. Nothing was written: write to "
                f"another table, or change the output schema"
            )


def _iceberg_schema(schema: pa.Schema) -> Schema:
    """``schema`` as the Iceberg schema a table created from it has (pyiceberg's own
    conversion, the one ``create_table`` applies to an Arrow schema; a private name of
    pyiceberg, hence the extra's upper version bound)."""
    return _pyiceberg_catalog().Catalog._convert_schema_if_needed(schema)


def _type(kind: IcebergType) -> str:
    """An Iceberg type as Iceberg names it, without field ids (which differ between a table
    and a converted schema): ``long``, ``timestamptz``, ``struct<a: int, b: string required>``..."""
    from pyiceberg.types import ListType, MapType, StructType

    if isinstance(kind, StructType):
        return f"struct<{_describe(kind.fields, separator=': ')}>"
    if isinstance(kind, ListType):
        return f"list<{_type(kind.element_type)}{_required(kind.element_required)}>"
    if isinstance(kind, MapType):
        return (f"map<{_type(kind.key_type)}, "
                f"{_type(kind.value_type)}{_required(kind.value_required)}>")
    return str(kind)


def _required(required: bool) -> str:
    return " required" if required else ""


def _describe(fields: Iterable[NestedField], separator: str = " ") -> str:
    """``name type`` per field, ``required`` after a required one's type."""
    return ", ".join(f"{f.name}{separator}{_type(f.field_type)}{_required(f.required)}"
                     for f in fields)


def _partitions(table: Table) -> list[str]:
    """The table's partition fields as ``transform(column)``: ``identity(day)``,
    ``bucket[16](user_id)``..."""
    schema = table.schema()
    return [f"{f.transform}({schema.find_column_name(f.source_id)})"
            for f in table.spec().fields]
