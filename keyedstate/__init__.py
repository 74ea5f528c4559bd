"""keyedstate: Flink-grade keyed state for stateful stream processing on PySpark.

The engine-independent core is importable without pyspark; the Spark API lives in
:mod:`keyedstate.spark` (``key_by``, ``KeyedProcessFunction``, sinks).
"""

from keyedstate.backends import load_backend
from keyedstate.backends.heap import HeapStateBackend
from keyedstate.backends.rocksdb import RocksDBOptions, RocksDBStateBackend
from keyedstate.checkpoint.coordinator import CheckpointCoordinator, CompletedCheckpoint
from keyedstate.checkpoint.savepoint import create_native_savepoint
from keyedstate.config import JobConfig, LateEvents, RestoreMode
from keyedstate.errors import KeyedStateError
from keyedstate.keygroups import (
    KeyGroupRange,
    compute_default_max_parallelism,
    operator_index_for_key_group,
)
from keyedstate.keys import KeySerializer
from keyedstate.processor.canonical import restore_canonical, write_canonical_savepoint
from keyedstate.runtime.function import Context, KeyedBatch, KeyedProcessFunction
from keyedstate.runtime.local import LocalJob, LocalKeyedOperator
from keyedstate.runtime.local_aggregation import Aggregate, Count, LocalAggregation, Max, Min, Sum
from keyedstate.state.api import AggregatingState, ListState, MapState, ReducingState, ValueState
from keyedstate.state.batch_keys import BatchKeys
from keyedstate.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
)
from keyedstate.state.evolution import SchemaEvolution
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import CheckpointMetadata, KeyedStateHandle
from keyedstate.storage.transfer import TransferOptions

__all__ = [
    "Aggregate", "AggregatingState", "AggregatingStateDescriptor", "BatchKeys", "CheckpointCoordinator",
    "CheckpointMetadata", "CheckpointStorage", "CompletedCheckpoint", "Context", "Count",
    "HeapStateBackend", "JobConfig", "KeyGroupRange", "KeySerializer", "KeyedBatch",
    "KeyedProcessFunction",
    "KeyedStateError", "KeyedStateHandle", "LateEvents", "ListState", "ListStateDescriptor",
    "LocalAggregation", "LocalJob", "LocalKeyedOperator", "MapState", "Max", "Min",
    "MapStateDescriptor", "ReducingState", "ReducingStateDescriptor", "RestoreMode",
    "RocksDBOptions", "RocksDBStateBackend", "SchemaEvolution", "StateTtlConfig", "Sum", "TransferOptions",
    "TtlUpdateType", "ValueState",
    "ValueStateDescriptor", "compute_default_max_parallelism", "create_native_savepoint",
    "load_backend", "operator_index_for_key_group", "restore_canonical",
    "write_canonical_savepoint",
]
