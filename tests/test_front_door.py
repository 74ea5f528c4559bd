"""The package's front door (keyedstate/__init__.py): a curated public API that imports
neither pyspark nor rocksdict until a name needs them, and the names it no longer exports
still importable from it for a while, with a DeprecationWarning naming their module."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

import keyedstate


def test_all_is_the_public_names_and_each_resolves() -> None:
    assert sorted(keyedstate.__all__) == sorted(keyedstate._PUBLIC)
    for name in keyedstate.__all__:
        value = getattr(keyedstate, name)
        assert value.__name__ == name and value.__module__.startswith("keyedstate.")


def test_importing_keyedstate_loads_neither_pyspark_nor_rocksdict() -> None:
    code = ("import sys, json, keyedstate; keyedstate.JobConfig; keyedstate.ValueStateDescriptor; "
            "print(json.dumps(sorted(m for m in ('pyspark', 'rocksdict') if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert json.loads(done.stdout) == []


def test_a_name_no_longer_exported_warns_and_names_its_module() -> None:
    with pytest.warns(DeprecationWarning, match="keyedstate.runtime.local.*LocalJob"):
        operator = keyedstate.LocalKeyedOperator
    from keyedstate.runtime.local import LocalKeyedOperator

    assert operator is LocalKeyedOperator
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from keyedstate.runtime.local import LocalKeyedOperator as again  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        keyedstate.nothing_here  # noqa: B018
