"""pyproject.toml lists the packages it installs (setuptools can't discover a folder under
another import name); the list must stay every ``keyedstate*`` package of the tree plus the
folders shipped under their own name (``package-dir``)."""

from __future__ import annotations

import os
import tomllib

from setuptools import find_packages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setuptools_config() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_listed_packages_are_the_trees_keyedstate_packages_and_the_renamed_folders():
    config = _setuptools_config()
    renamed = config.get("package-dir", {})
    found = find_packages(ROOT, include=["keyedstate", "keyedstate.*"])
    assert sorted(config["packages"]) == sorted([*found, *renamed])


def test_renamed_folders_are_packages():
    for name, folder in _setuptools_config().get("package-dir", {}).items():
        assert os.path.isfile(os.path.join(ROOT, folder, "__init__.py")), name


def test_make_installs_every_optional_extra():
    """``make test`` runs every test, so its install names every extra (``delta`` too: the
    DeltaSink tests need delta-rs)."""
    import re

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    with open(os.path.join(ROOT, "Makefile")) as f:
        [installed] = re.findall(r'pip install --quiet -e "\.\[([a-z0-9,]+)\]"', f.read())
    assert set(installed.split(",")) == extras
