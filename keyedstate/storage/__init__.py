"""Checkpoint storage: what the backends stand on.

- :mod:`~keyedstate.storage.layout`: every on-disk name of a snapshot root and its parser;
- :mod:`~keyedstate.storage.handles`: the ``_metadata`` models and their one serializer;
- :mod:`~keyedstate.storage.filesystem`: fsspec connections and local file helpers;
- :mod:`~keyedstate.storage.checkpoint_storage`: one snapshot root (verified reads, atomic
  ``_metadata``);
- :mod:`~keyedstate.storage.location`: where one subtask writes one snapshot;
- :mod:`~keyedstate.storage.duplication`: copies made by the store itself;
- :mod:`~keyedstate.storage.transfer`: retries, parallel transfers, byte counts;
- :mod:`~keyedstate.storage.cache`: the per-process file cache.

Nothing here imports a backend, the checkpoint protocol, a runtime or pyspark.
"""
