"""Fixtures for the backend contract: every backend by name, through ``load_backend``."""

from __future__ import annotations

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
