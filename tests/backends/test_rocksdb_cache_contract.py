"""The backend contract and the Hypothesis state machine with the RocksDB value cache on
(docs/rocksdb-backend.md, "The value cache"): the state machine and its fixed scenario with a
tiny cache (a few entries: every few writes evict, so buffered values are written out all the
time) and a large one (it holds every test's state: every write is buffered until the
snapshot writes it out); the whole contract with the tiny one, whose snapshots also write out
what is buffered and whose reads also find evicted values in RocksDB. The default, off, runs
in ``contract/`` and ``test_state_machine.py``. Marked ``slow``: in ``make test`` only.
"""

from __future__ import annotations

import pytest

from keyedstate.backends.base.backend import StateBackend
from keyedstate.backends.rocksdb import RocksDBStateBackend

from . import test_state_machine as machine

# The whole backend contract (every module of tests/backends/contract/, bulk calls included)
# runs here once per cache size below: its classes and fixtures, imported, are collected in
# this module, where ``state_backend`` is this module's (``harness``: tests/backends/conftest.py).
from .contract.test_bulk import TestBulkStateAccess  # noqa: F401
from .contract.test_isolation import TestIsolation  # noqa: F401
from .contract.test_key_groups import TestKeyGroups  # noqa: F401
from .contract.test_lifecycle import TestLifecycle  # noqa: F401
from .contract.test_list_state import TestListState  # noqa: F401
from .contract.test_map_state import TestMapState  # noqa: F401
from .contract.test_reducing_and_aggregating_state import (  # noqa: F401
    TestReducingAndAggregatingState,
)
from .contract.test_registration import TestRegistration  # noqa: F401
from .contract.test_restore_errors import TestRestoreErrors  # noqa: F401
from .contract.test_snapshots import TestSnapshots  # noqa: F401
from .contract.test_timers import TestTimers  # noqa: F401
from .contract.test_ttl import TestTtl  # noqa: F401
from .contract.test_typed_values import TestTypedAndUntypedValues  # noqa: F401
from .contract.test_value_state import TestValueState  # noqa: F401

pytestmark = pytest.mark.slow

#: Cache sizes the state machine runs with here (the default, off, runs in contract/ and
#: test_state_machine.py): a few entries (an entry is about 180 estimated bytes), so that almost
#: every write evicts, and one that holds every test's state. The contract runs with "tiny".
VARIANTS = {"tiny": 600, "large": 32 << 20}


@pytest.fixture
def state_backend() -> StateBackend:
    """The contract's backend here: the tiny cache (the large one's buffering is a case of
    it, and the contract once more with it took two minutes of CI for no other path)."""
    return RocksDBStateBackend(value_cache_size=VARIANTS["tiny"])


@pytest.mark.parametrize("size", sorted(VARIANTS))
def test_the_model_with_the_cache_tiny_or_large(size: str) -> None:
    machine.test_backend_matches_the_model(RocksDBStateBackend(value_cache_size=VARIANTS[size]))


@pytest.mark.parametrize("size", sorted(VARIANTS))
def test_the_fixed_scenario_with_the_cache_tiny_or_large(size: str) -> None:
    machine.test_fixed_scenario_through_the_machine(
        RocksDBStateBackend(value_cache_size=VARIANTS[size]))
