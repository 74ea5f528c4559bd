"""The heap state backend: keyed state as Python objects, FLIP-151 incremental snapshots.

See ``docs/heap-backend.md`` for the journal, the chain of snapshot files and the file format.
"""

from keyedstate.backends.heap.backend import HeapStateBackend
from keyedstate.backends.heap.keyed_backend import HeapKeyedStateBackend, SnapshotChain
from keyedstate.backends.heap.snapshot import HeapSnapshotResult
from keyedstate.backends.heap.timers import HeapInternalTimerService

__all__ = [
    "HeapInternalTimerService",
    "HeapKeyedStateBackend",
    "HeapSnapshotResult",
    "HeapStateBackend",
    "SnapshotChain",
]
