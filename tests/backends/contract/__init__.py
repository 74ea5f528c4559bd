"""The contract every state backend passes (Flink's ``StateBackendTestBase``), one module per
idea: a state kind (``test_value_state``, ``test_list_state``, ``test_map_state``,
``test_reducing_and_aggregating_state``), ``test_bulk`` (bulk calls equal per-key calls),
``test_isolation``, ``test_typed_values``, ``test_registration``, ``test_ttl``,
``test_timers``, ``test_snapshots``, ``test_restore_errors``, ``test_key_groups`` (key-group
ranges and rescaling), ``test_lifecycle``.

Every test runs once per backend: the ``state_backend`` fixture (``tests/backends/conftest.py``)
is parametrized over ``keyedstate.backends.backend_names()``, so a new backend is held to the
whole contract as soon as ``load_backend`` knows it. The shared machinery (the ``Harness``,
``dump``, ``write``) is in ``common.py``, the bulk calls' script in ``bulk.py``, the fixtures in
``conftest.py``; other suites (the state machine, canonical savepoints, migration, RocksDB)
import them from there.
"""
