"""The docs site (``mkdocs.yml``, mkdocs-material with mkdocstrings) builds with warnings as
errors, so a broken link or an unrendered reference fails CI, and its reference covers the
public API with a docstring on every object and public member it shows."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_PAGE = os.path.join(ROOT, "docs", "reference", "api.md")


def _referenced() -> list[str]:
    with open(API_PAGE, encoding="utf-8") as f:
        return re.findall(r"^::: ([\w.]+)", f.read(), re.M)


def _resolve(dotted: str) -> Any:
    module, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return importlib.import_module(dotted)


def _public_members(obj: Any) -> list[tuple[str, Any]]:
    members = []
    for name, value in vars(obj).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            members.append((name, value.fget))
        elif isinstance(value, (classmethod, staticmethod)):
            members.append((name, value.__func__))
        elif inspect.isfunction(value):
            members.append((name, value))
    return members


def test_the_site_builds_strict(tmp_path) -> None:
    pytest.importorskip("mkdocstrings_handlers.python")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "SavepointReader" in api and "register_event_time_timer" in api
    cli = (tmp_path / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "keyedstate savepoint create" in cli and "keyedstate checkpoints show" in cli


def test_the_reference_covers_the_spark_api() -> None:
    import keyedstate.spark

    shown = {name.rsplit(".", 1)[-1] for name in _referenced()}
    assert sorted(set(keyedstate.spark.__all__) - shown) == []


def test_every_object_the_reference_shows_has_docstrings() -> None:
    missing = []
    for dotted in _referenced():
        obj = _resolve(dotted)
        if not inspect.getdoc(obj):
            missing.append(dotted)
        if inspect.isclass(obj):
            missing += [f"{dotted}.{name}" for name, member in _public_members(obj)
                        if not inspect.getdoc(member)]
    assert missing == []
