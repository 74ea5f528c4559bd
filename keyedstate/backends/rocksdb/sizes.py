"""Per-state sizes of a RocksDB snapshot (``keyedstate checkpoints show``)."""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict

from keyedstate.backends.base.backend import OTHER_FILES
from keyedstate.backends.rocksdb.native import native
from keyedstate.backends.rocksdb.options import DEFAULT_COLUMN_FAMILY, RocksDBOptions
from keyedstate.backends.rocksdb.restore import open_db_read_only
from keyedstate.backends.rocksdb.snapshot import split_instances
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle


def state_sizes(storage: CheckpointStorage, handle: KeyedStateHandle) -> dict[str, int]:
    """RocksDB's ``rocksdb.total-sst-files-size`` of each state's column family in one
    subtask's files (opened read-only: symbolic links to the SST files on a local disk, a
    download otherwise; nothing is written into the snapshot),
    plus :data:`OTHER_FILES` (MANIFEST, OPTIONS, ...)."""
    sizes: dict[str, int] = defaultdict(int)
    options = RocksDBOptions()
    # A handle of several RocksDB instances (key-group shards): each is a DB of its own.
    for instance in split_instances(handle):
        with tempfile.TemporaryDirectory(prefix="keyedstate-inspect-") as work:
            for name, stream in instance.files.items():
                local = os.path.join(work, os.path.basename(name))
                if (storage.is_local and stream.data is None and stream.segment is None
                        and name.endswith(".sst")):
                    # Only SST files are linked: RocksDB never writes one, but opening a DB
                    # (read-only too) rewrites others, e.g. rocksdict's config: through a link
                    # that would write into the snapshot. The rest are small: copied.
                    os.symlink(os.path.abspath(storage.path(stream.path)), local)
                else:
                    storage.download(stream, local)
            what = f"opening subtask {handle.subtask_index}'s RocksDB files read-only"
            db, names = open_db_read_only(work, options, what)
            with native(what):
                try:
                    for cf_name in names:
                        size = db.get_column_family(cf_name).property_int_value(
                            "rocksdb.total-sst-files-size") or 0
                        if size or cf_name != DEFAULT_COLUMN_FAMILY:
                            sizes[cf_name] += size
                finally:
                    db.close()
    out = dict(sizes)
    out[OTHER_FILES] = handle.full_size - sum(out.values())
    return out
