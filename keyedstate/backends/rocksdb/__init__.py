"""The RocksDB state backend (rocksdict): ``load_backend("rocksdb")``.

Keyed state in a local RocksDB per subtask, incremental snapshots of its SST files (as in
Flink's incremental checkpoints), restore and rescale by clip + SST ingest (Flink's
``DeleteRange`` rescaling). See ``docs/rocksdb-backend.md``.
"""

from keyedstate.backends.rocksdb.backend import RocksDBStateBackend
from keyedstate.backends.rocksdb.keyed_backend import RocksDBKeyedStateBackend
from keyedstate.backends.rocksdb.options import RocksDBOptions

__all__ = ["RocksDBKeyedStateBackend", "RocksDBOptions", "RocksDBStateBackend"]
