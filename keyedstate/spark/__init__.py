"""keyedstate on Spark: keyed process functions over Structured Streaming.

The only package that imports pyspark (lazily: importing it does not start Spark).
"""

from keyedstate.runtime.function import Context, KeyedBatch, KeyedProcessFunction, TimerService
from keyedstate.spark.api import KeyedProcessJob, KeyedStream, key_by
from keyedstate.spark.delta_sink import DeltaSink
from keyedstate.spark.driver import BatchStats
from keyedstate.spark.iceberg_sink import IcebergSink
from keyedstate.spark.processor import SavepointReader, SavepointWriter
from keyedstate.spark.query import KeyedQuery
from keyedstate.spark.session import local_session
from keyedstate.spark.sinks import CallbackSink, ParquetSink, Sink

__all__ = [
    "BatchStats", "CallbackSink", "Context", "DeltaSink", "IcebergSink", "KeyedBatch",
    "KeyedProcessFunction", "KeyedProcessJob", "KeyedQuery", "KeyedStream", "ParquetSink",
    "SavepointReader", "SavepointWriter", "Sink", "TimerService", "key_by", "local_session",
]
