"""The contract's fixtures: ``harness`` (one job's :class:`~.common.Harness` in ``tmp_path``)
and ``make_harness`` (several, each with its own arguments); both close every backend they
made. ``state_backend`` (every backend by name) comes from ``tests/backends/conftest.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyedstate.backends.base.backend import StateBackend

from .common import Harness


@pytest.fixture
def harness(state_backend: StateBackend, tmp_path: Path):
    h = Harness(state_backend, tmp_path)
    yield h
    h.close_all()


@pytest.fixture
def make_harness(state_backend: StateBackend, tmp_path: Path):
    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        h = Harness(state_backend, tmp_path / f"h{len(made)}", **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close_all()
