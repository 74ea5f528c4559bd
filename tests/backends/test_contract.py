"""Every backend in ``keyedstate.backends`` passes the contract (``state_backend`` is
parametrized over their names in ``conftest.py``), bulk state calls included."""

from __future__ import annotations

from .contract import StateBackendContract
from .contract_bulk import BulkStateAccessContract


class TestStateBackendContract(StateBackendContract, BulkStateAccessContract):
    """Heap and RocksDB, held to the same contract."""
