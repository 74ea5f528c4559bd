"""The package type-checks, and user code gets typed states from typed descriptors.

Runs mypy (seconds): a type error in keyedstate, or a ``get_state`` that stops returning the
descriptor's state class, fails here instead of in a user's editor.
"""

from __future__ import annotations

import os
import textwrap

import pytest

api = pytest.importorskip("mypy.api")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_CODE = '''
from typing import Any, assert_type

from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.state.api import ListState, MapState, ValueState
from keyedstate.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
)


class Sessions(KeyedProcessFunction):
    count = ValueStateDescriptor("count", "bigint", default=0)
    seen = ListStateDescriptor("seen", "string")
    last = MapStateDescriptor("last", "string", "bigint")

    def open(self, ctx: Context) -> None:
        assert_type(ctx.get_state(self.count), ValueState[Any])
        assert_type(ctx.get_state(self.seen), ListState[Any])
        assert_type(ctx.get_state(self.last), MapState[Any, Any])
        ctx.get_state(self.count).update(1)
        ctx.get_state(self.last).put("a", 1)
'''


def _mypy(*args: str) -> tuple[str, int]:
    out, err, status = api.run(["--cache-dir", os.path.join(ROOT, ".mypy_cache"),
                                "--config-file", os.path.join(ROOT, "pyproject.toml"), *args])
    return out + err, status


def test_the_package_type_checks() -> None:
    out, status = _mypy(os.path.join(ROOT, "keyedstate"))
    assert status == 0, out


def test_the_examples_type_check() -> None:
    """The examples are user code as the docs show it: typed, and checked like the package."""
    out, status = _mypy(os.path.join(ROOT, "examples"))
    assert status == 0, out


def test_the_benchmarks_type_check() -> None:
    """``keyedstate bench`` is shipped code too (``keyedstate_benchmarks``)."""
    out, status = _mypy(os.path.join(ROOT, "benchmarks"))
    assert status == 0, out


def test_get_state_is_typed_by_its_descriptor(tmp_path) -> None:
    user = tmp_path / "user_job.py"
    user.write_text(textwrap.dedent(USER_CODE))
    out, status = _mypy(str(user))
    assert status == 0, out
