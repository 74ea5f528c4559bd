"""keyedstate: Flink-grade keyed state for stateful stream processing on PySpark.

The public API of a job's author, importable without pyspark or rocksdict: ``import
keyedstate`` loads neither (every name below is imported on first use). The Spark API lives in
:mod:`keyedstate.spark` (``key_by``, sinks, ``SavepointReader``); everything else (the
checkpoint protocol, storage, backends' internals) is importable from its own module and is
not part of this front door. docs/reference/api.md is the reference.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyedstate.backends.heap import HeapStateBackend
    from keyedstate.backends.rocksdb import RocksDBOptions, RocksDBStateBackend
    from keyedstate.config import JobConfig, LateEvents, OnRollback, RestoreMode, SourcePositions
    from keyedstate.errors import KeyedStateError
    from keyedstate.runtime.function import Context, KeyedBatch, KeyedProcessFunction, TimerService
    from keyedstate.runtime.local import LocalJob
    from keyedstate.runtime.local_aggregation import (
        Aggregate,
        Count,
        LocalAggregation,
        Max,
        Min,
        Sum,
    )
    from keyedstate.state.api import (
        AggregatingState,
        ListState,
        MapState,
        ReducingState,
        ValueState,
    )
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

#: name -> the module it is imported from on first use
_PUBLIC: dict[str, str] = {
    # a job's function
    "KeyedProcessFunction": "keyedstate.runtime.function",
    "Context": "keyedstate.runtime.function",
    "KeyedBatch": "keyedstate.runtime.function",
    "TimerService": "keyedstate.runtime.function",
    # state and its descriptors
    "ValueStateDescriptor": "keyedstate.state.descriptors",
    "ListStateDescriptor": "keyedstate.state.descriptors",
    "MapStateDescriptor": "keyedstate.state.descriptors",
    "ReducingStateDescriptor": "keyedstate.state.descriptors",
    "AggregatingStateDescriptor": "keyedstate.state.descriptors",
    "StateTtlConfig": "keyedstate.state.descriptors",
    "TtlUpdateType": "keyedstate.state.descriptors",
    "SchemaEvolution": "keyedstate.state.evolution",
    "ValueState": "keyedstate.state.api",
    "ListState": "keyedstate.state.api",
    "MapState": "keyedstate.state.api",
    "ReducingState": "keyedstate.state.api",
    "AggregatingState": "keyedstate.state.api",
    "BatchKeys": "keyedstate.state.batch_keys",
    # two-phase aggregation
    "LocalAggregation": "keyedstate.runtime.local_aggregation",
    "Aggregate": "keyedstate.runtime.local_aggregation",
    "Count": "keyedstate.runtime.local_aggregation",
    "Sum": "keyedstate.runtime.local_aggregation",
    "Min": "keyedstate.runtime.local_aggregation",
    "Max": "keyedstate.runtime.local_aggregation",
    # configuration and backends
    "JobConfig": "keyedstate.config",
    "LateEvents": "keyedstate.config",
    "RestoreMode": "keyedstate.config",
    "SourcePositions": "keyedstate.config",
    "OnRollback": "keyedstate.config",
    "RocksDBOptions": "keyedstate.backends.rocksdb",
    "RocksDBStateBackend": "keyedstate.backends.rocksdb",
    "HeapStateBackend": "keyedstate.backends.heap",
    # running a job without Spark, and errors
    "LocalJob": "keyedstate.runtime.local",
    "KeyedStateError": "keyedstate.errors",
}

#: Names this package exported before its front door was curated: still importable from here
#: for a while, with a DeprecationWarning naming the module to import them from.
_MOVED: dict[str, str] = {
    "LocalKeyedOperator": "keyedstate.runtime.local",
    "CheckpointCoordinator": "keyedstate.checkpoint.coordinator",
    "CompletedCheckpoint": "keyedstate.checkpoint.coordinator",
    "create_native_savepoint": "keyedstate.checkpoint.savepoint",
    "KeyGroupRange": "keyedstate.keygroups",
    "compute_default_max_parallelism": "keyedstate.keygroups",
    "operator_index_for_key_group": "keyedstate.keygroups",
    "KeySerializer": "keyedstate.keys",
    "load_backend": "keyedstate.backends",
    "restore_canonical": "keyedstate.processor.canonical",
    "write_canonical_savepoint": "keyedstate.processor.canonical",
    "CheckpointStorage": "keyedstate.storage.checkpoint_storage",
    "CheckpointMetadata": "keyedstate.storage.handles",
    "KeyedStateHandle": "keyedstate.storage.handles",
    "TransferOptions": "keyedstate.storage.transfer",
}

#: the public names, each in :data:`_PUBLIC` (a test checks they agree)
__all__ = [
    "Aggregate", "AggregatingState", "AggregatingStateDescriptor", "BatchKeys", "Context", "Count",
    "HeapStateBackend", "JobConfig", "KeyedBatch", "KeyedProcessFunction", "KeyedStateError",
    "LateEvents", "ListState", "ListStateDescriptor", "LocalAggregation", "LocalJob", "MapState",
    "MapStateDescriptor", "Max", "Min", "OnRollback", "ReducingState", "ReducingStateDescriptor",
    "RestoreMode", "RocksDBOptions", "RocksDBStateBackend", "SchemaEvolution", "SourcePositions",
    "StateTtlConfig", "Sum", "TimerService", "TtlUpdateType", "ValueState", "ValueStateDescriptor",
]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _MOVED:
        hint = ("; a job runs in-process with keyedstate.LocalJob"
                if name == "LocalKeyedOperator" else "")
        warnings.warn(f"keyedstate.{name} is not part of the public API any more: import it "
                      f"from {_MOVED[name]}{hint}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    else:
        raise AttributeError(f"module 'keyedstate' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return [*globals(), *__all__]
