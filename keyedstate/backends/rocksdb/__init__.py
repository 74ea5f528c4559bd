"""The RocksDB state backend (rocksdict): ``load_backend("rocksdb")``.

Keyed state in a local RocksDB per subtask, incremental snapshots of its SST files (seed 003),
restore and rescale by clip + SST ingest (seed 001). See ``docs/rocksdb-backend.md``.
"""

from keyedstate.backends.rocksdb.backend import RocksDBStateBackend
from keyedstate.backends.rocksdb.keyed_backend import RocksDBKeyedStateBackend
from keyedstate.backends.rocksdb.options import RocksDBOptions

__all__ = ["RocksDBKeyedStateBackend", "RocksDBOptions", "RocksDBStateBackend"]
