"""Fixtures for the backend contract: every backend by name, through ``load_backend``
(``state_backend``; a test module may override it, as test_rocksdb_cache.py does to run the
contract per cache size), ``harness`` (one job's :class:`~.contract.common.Harness` in
``tmp_path``) and ``make_harness`` (several, each with its own arguments); both close every
backend they made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyedstate.backends import backend_names, load_backend
from keyedstate.backends.base.backend import StateBackend

# The contract's common.py and bulk.py are not test modules (other suites import them too): ask
# pytest to rewrite their asserts (for readable failures); a package name covers its modules.
pytest.register_assert_rewrite("tests.backends.contract", "backends.contract")

#: Every backend the contract runs against (``state.backend.type`` names).
BACKEND_NAMES = backend_names()


@pytest.fixture(params=BACKEND_NAMES)
def state_backend(request: pytest.FixtureRequest) -> StateBackend:
    """A freshly configured backend; the suite runs once per name."""
    return load_backend(request.param)


@pytest.fixture
def harness(state_backend: StateBackend, tmp_path: Path):
    from .contract.common import Harness  # imported after its asserts are set to be rewritten

    h = Harness(state_backend, tmp_path)
    yield h
    h.close_all()


@pytest.fixture
def make_harness(state_backend: StateBackend, tmp_path: Path):
    from .contract.common import Harness

    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        h = Harness(state_backend, tmp_path / f"h{len(made)}", **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close_all()
