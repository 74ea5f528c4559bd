"""The package as it is built and installed.

pyproject.toml lists the packages it installs (setuptools can't discover a folder under
another import name); the list must stay every ``keyedstate*`` package of the tree plus the
folders shipped under their own name (``package-dir``). The slow test builds the sdist and the
wheel and runs the installed wheel from a new venv, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest
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



def test_the_cli_prints_the_installed_version_under_its_own_name():
    """``keyedstate --version``, also as ``python -m keyedstate.cli``: the distribution's
    version from importlib.metadata."""
    import importlib.metadata

    from click.testing import CliRunner

    from keyedstate.cli import main

    shown = CliRunner().invoke(main, ["--version"])
    assert shown.exit_code == 0
    assert shown.output == f"keyedstate, version {importlib.metadata.version('keyedstate')}\n"


def test_the_metadata_an_index_expects():
    """License file and expression, a changelog entry for this version, typed."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert f.read().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        assert f"\n## [{project['version']}] - " in f.read()
    assert "Typing :: Typed" in project["classifiers"]
    assert os.path.isfile(os.path.join(ROOT, "keyedstate", "py.typed"))


# The package as an index gets it and a user installs it ----------------------------------------

#: A user's job, run by the installed package from a directory outside the checkout: two
#: batches of the local runtime, a restart from the checkpoint, the counts checked.
LOCAL_JOB = '''
import os
import sys
import tempfile

import keyedstate
from keyedstate import JobConfig, KeyedProcessFunction, LocalJob, ValueStateDescriptor


class CountPerKey(KeyedProcessFunction):
    count = ValueStateDescriptor("count", "bigint", default=0)

    def open(self, ctx):
        self.state = ctx.get_state(self.count)

    def process_key(self, key, rows, ctx):
        self.state.update(self.state.value() + rows.num_rows)
        yield {"key": key, "count": self.state.value()}


def job(directory):
    return LocalJob(CountPerKey(), key_columns=["key"], input_schema="key bigint",
                    output_schema="key bigint, count bigint",
                    config=JobConfig(checkpoint_dir=directory, parallelism=2))


def counts(output):
    return dict(zip(output["main"].column("key").to_pylist(),
                    output["main"].column("count").to_pylist()))


directory = os.path.join(tempfile.mkdtemp(), "checkpoints")
first = job(directory)
assert counts(first.process_batch([{"key": 1}, {"key": 2}, {"key": 1}])) == {1: 2, 2: 1}
first.stop()
again = job(directory)  # restarted from its checkpoint
assert counts(again.process_batch([{"key": 1}, {"key": 3}])) == {1: 3, 3: 1}
again.stop()
print(os.path.dirname(keyedstate.__file__))
'''


def _run(args: list[str], cwd: str, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.slow
def test_the_built_wheel_installs_into_a_new_venv_and_runs_from_another_directory(tmp_path):
    """Build the sdist and, from it, the wheel (``python -m build``, as a release would),
    install the wheel, not editable, into a new venv without the system's site-packages, and
    run the CLI and a local job from a directory outside the checkout."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    dist, elsewhere = tmp_path / "dist", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Step 1. The sdist, then the wheel built from it: what an index would hold.
    _run([sys.executable, "-m", "build", "--outdir", str(dist), ROOT], cwd=ROOT)
    [sdist] = dist.glob(f"keyedstate-{version}.tar.gz")
    [wheel] = dist.glob(f"keyedstate-{version}-py3-none-any.whl")
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "keyedstate/py.typed",
            "examples/notebook.ipynb"} <= in_sdist
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
        metadata = whl.read(f"keyedstate-{version}.dist-info/METADATA").decode()
    assert {"keyedstate/py.typed", "keyedstate_examples/notebook.ipynb",
            f"keyedstate-{version}.dist-info/licenses/LICENSE"} <= in_wheel
    assert "License-Expression: Apache-2.0" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    assert "Project-URL" not in metadata  # none until the project has a public address
    # Step 2. A new venv (its own site-packages only), the wheel and its core dependencies.
    # Nothing of the checkout on the path from here on: with the checkout on PYTHONPATH (the
    # Spark tests put it there for their workers) pip finds its keyedstate.egg-info, takes
    # keyedstate for installed and installs nothing.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=str(elsewhere), env=env)
    bin_dir = venv / "bin"
    _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet",
          "--disable-pip-version-check", str(wheel)], cwd=str(elsewhere), env=env)
    # Step 3. From another directory.
    shown = _run([str(bin_dir / "keyedstate"), "--version"], cwd=str(elsewhere), env=env)
    assert shown.stdout.strip() == f"keyedstate, version {version}"
    helped = _run([str(bin_dir / "keyedstate"), "--help"], cwd=str(elsewhere), env=env)
    assert "demo" in helped.stdout and "savepoint" in helped.stdout
    script = elsewhere / "count_job.py"
    script.write_text(LOCAL_JOB)
    ran = _run([str(bin_dir / "python"), str(script)], cwd=str(elsewhere), env=env)
    installed = ran.stdout.strip().splitlines()[-1]
    assert installed.startswith(str(venv)), installed  # the wheel's copy, not the checkout's
    assert os.path.isfile(os.path.join(installed, "py.typed"))
