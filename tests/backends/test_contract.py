"""Every backend in ``keyedstate.backends`` passes the contract (``state_backend`` is
parametrized over their names in ``conftest.py``)."""

from __future__ import annotations

from .contract import StateBackendContract


class TestStateBackendContract(StateBackendContract):
    """Heap and RocksDB, held to the same contract."""
