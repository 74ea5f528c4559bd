"""The user's entry point on Spark: ``key_by(df, *columns).process(fn, output_schema)
.sink(...).start(config)`` (Flink's ``keyBy(...).process(...)``). The job it builds runs
through :class:`~keyedstate.spark.driver.KeyedJobDriver`, one checkpoint per micro-batch."""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import pyarrow as pa

from keyedstate.config import LATE_EVENTS_TAG, JobConfig, LateEvents
from keyedstate.errors import ConfigurationError, SparkConnectUnsupportedError
from keyedstate.runtime.function import KeyedProcessFunction
from keyedstate.runtime.local_aggregation import check_local_aggregation
from keyedstate.spark.connect import is_connect, shipped, started
from keyedstate.spark.driver import MAIN_OUTPUT, KeyedJobDriver
from keyedstate.spark.query import KeyedQuery
from keyedstate.spark.schema import to_arrow_schema
from keyedstate.spark.sinks import CallbackSink, Sink
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import SPARK_OFFSETS_DIR

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType


class KeyedStream:
    """A streaming (or batch) DataFrame keyed by one or more columns."""

    def __init__(self, df: DataFrame, key_columns: Sequence[str]) -> None:
        if not key_columns:
            raise ConfigurationError("key_by needs at least one key column")
        missing = [c for c in key_columns if c not in df.columns]
        if missing:
            raise ConfigurationError(
                f"key columns {missing} are not in the DataFrame; its columns are {df.columns}"
            )
        #: the keyed DataFrame; None in the copy a Spark Connect server gets
        #: (:meth:`KeyedProcessJob.without_dataframe`)
        self.df: DataFrame | None = df
        self.key_columns = list(key_columns)

    def dataframe(self) -> DataFrame:
        """The keyed DataFrame. The copy of the job a Spark Connect server runs has none
        (:meth:`KeyedProcessJob.without_dataframe`) and raises
        :class:`~keyedstate.errors.SparkConnectUnsupportedError`: what needs the DataFrame
        (the start, a drain, a savepoint of the running job) runs in the client."""
        if self.df is None:
            raise SparkConnectUnsupportedError(
                f"the keyed job over {self.key_columns} runs in a Spark Connect server, which "
                f"gets it without its DataFrame: start, drain and savepoints of the running "
                f"job are the client's (KeyedQuery)")
        return self.df

    def process(self, function: KeyedProcessFunction, output_schema: str | pa.Schema | StructType,
                side_outputs: Mapping[str, str | pa.Schema | StructType] | None = None
                ) -> KeyedProcessJob:
        """Run ``function`` per key; it emits rows of ``output_schema`` (a DDL string, pyarrow
        schema or StructType) and of the named ``side_outputs`` (``ctx.output(tag, row)``)."""
        if not isinstance(function, KeyedProcessFunction):
            raise ConfigurationError("process() needs a KeyedProcessFunction instance")
        # Its local aggregation against the input here, in the user's call (the start checks
        # it again with the watermark settings).
        check_local_aggregation(function, to_arrow_schema(self.dataframe().schema),
                                self.key_columns, watermark_column=None,
                                late_events=LateEvents.DROP)
        return KeyedProcessJob(self, function, to_arrow_schema(output_schema),
                               {k: to_arrow_schema(v) for k, v in (side_outputs or {}).items()})


def key_by(df: DataFrame, *columns: str) -> KeyedStream:
    """Key a DataFrame by ``columns`` (Flink's ``keyBy``)."""
    return KeyedStream(df, columns)


class KeyedProcessJob:
    """A keyed process function over a keyed stream, with sinks; ``start`` runs it."""

    def __init__(self, stream: KeyedStream, function: KeyedProcessFunction,
                 output_schema: pa.Schema, side_outputs: dict[str, pa.Schema]) -> None:
        self.stream = stream
        self.function = function
        self.output_schema = output_schema
        self.side_outputs = dict(side_outputs)
        self.sinks: dict[str, list[Sink]] = {}

    def sink(self, sink: Sink | Callable[[DataFrame, int], None], output: str = MAIN_OUTPUT
             ) -> KeyedProcessJob:
        """Send ``output`` (the main output, or a side output tag) to ``sink``."""
        if output != MAIN_OUTPUT and output not in self.side_outputs and output != LATE_EVENTS_TAG:
            raise ConfigurationError(
                f"output {output!r} is not declared; declared: {[MAIN_OUTPUT, *self.side_outputs]}"
            )
        self.sinks.setdefault(output, []).append(sink if isinstance(sink, Sink)
                                                 else CallbackSink(sink))
        return self

    def driver(self, config: JobConfig | Mapping[str, Any],
               spark_checkpoint_location: str | None = None) -> KeyedJobDriver:
        """The job's driver. Every sink is opened first (:meth:`Sink.open` with its output's
        schema): a destination that can't take the output is refused before the driver
        restores state or commits output a restored savepoint carries."""
        cfg = config if isinstance(config, JobConfig) else JobConfig.from_mapping(config)
        schemas = {MAIN_OUTPUT: self.output_schema, **self.side_outputs}
        for output, sinks in self.sinks.items():
            # Late rows have the input's schema (the driver's _late_schema).
            schema = (to_arrow_schema(self.stream.dataframe().schema) if output == LATE_EVENTS_TAG
                      else schemas[output])
            for sink in sinks:
                sink.open(schema)
        return KeyedJobDriver(self, cfg, spark_checkpoint_location)

    def without_dataframe(self) -> KeyedProcessJob:
        """A copy of the job whose stream holds no DataFrame (``stream.df`` is None): what a
        Spark Connect server gets. The batches bring their own DataFrame, and a Connect
        DataFrame pickles as its plan with a reference to the client's session that the
        server resolves only while that session is its active one. The function and the sinks
        are the same objects."""
        stream = copy.copy(self.stream)
        stream.df = None
        job = copy.copy(self)
        job.stream = stream
        return job

    def start(self, config: JobConfig | Mapping[str, Any], *,
              spark_checkpoint_location: str | None = None, trigger: Mapping[str, Any] | None = None,
              query_name: str | None = None) -> KeyedQuery:
        """Start the streaming query. Spark keeps the source offsets in
        ``spark_checkpoint_location`` (default: ``<checkpoint dir>/spark`` for a local
        checkpoint directory); keyedstate keeps the state in the checkpoint directory.

        Over Spark Connect (docs/spark.md, "Spark Connect") the start-up runs here, then the
        driver is shipped to the Connect server, which runs every batch: the function and
        every sink must pickle (else :class:`~keyedstate.errors.SparkConnectUnsupportedError`,
        before anything is restored), the server's Python must import keyedstate and the
        modules of the function and the sinks (else
        :class:`~keyedstate.errors.SparkConnectServerError`), and the checkpoint directory
        and the Spark checkpoint location must be reachable from the server and its
        executors too."""
        df = self.stream.dataframe()
        connect = is_connect(df.sparkSession)
        if connect:
            shipped([("the KeyedProcessFunction", self.function),
                     *((f"the sink {type(sink).__name__} of output {output!r}", sink)
                       for output, sinks in self.sinks.items() for sink in sinks)])
        cfg = config if isinstance(config, JobConfig) else JobConfig.from_mapping(config)
        location = spark_checkpoint_location
        if location is None:
            storage = CheckpointStorage(cfg.checkpoint_dir, cfg.storage_options)
            if not storage.is_local:
                raise ConfigurationError(
                    "pass spark_checkpoint_location for a non-local checkpoint directory"
                )
            location = os.path.join(storage.root, SPARK_OFFSETS_DIR)
        driver = self.driver(cfg, location)
        writer = df.writeStream.foreachBatch(driver.process_batch)
        writer = writer.option("checkpointLocation", location)
        if trigger:
            writer = writer.trigger(**trigger)
        if query_name:
            writer = writer.queryName(query_name)
        return KeyedQuery(started(writer) if connect else writer.start(), driver)
