"""The notebooks under examples/: committed with their outputs cleared, and executed cell by
cell in a real Jupyter kernel (nbclient + ipykernel), any cell's error failing the test.

A notebook runs as Jupyter runs it: a kernel of this interpreter whose working directory is
the notebook's folder. ``PYTHONPATH`` puts this checkout first, so the kernel and its Spark
workers import this checkout's keyedstate (the venv's editable install may point at another
one), and ``TMPDIR`` keeps what the notebook writes under the test's directory.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "examples", "*.ipynb")))

#: Seconds a cell may take (a Spark session's start, a job of a few batches).
CELL_TIMEOUT_S = 600


def execute(notebook: Any, cwd: str, tmp_dir: str) -> Any:
    """Run every cell of ``notebook`` (an nbformat node) in a new kernel started in ``cwd``;
    returns the notebook with its outputs. A cell that raises raises
    :class:`CellExecutionError` (naming the cell and the error) and stops the run."""
    env = {**os.environ, "TMPDIR": tmp_dir,
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            allow_errors=False, resources={"metadata": {"path": cwd}})
    return client.execute(env=env)


def test_examples_has_a_notebook():
    assert NOTEBOOKS, "no notebook under examples/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_committed_with_outputs_cleared(path):
    """What a reviewer reads is the source: no outputs, execution counts or run metadata."""
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {index} has outputs: clear them"
            assert cell.execution_count is None, f"cell {index} has an execution count"
        assert "execution" not in cell.metadata, f"cell {index} has run metadata"


def test_a_cell_error_fails_the_run(tmp_path):
    """The runner fails on an error (it is not told to allow errors), naming the error."""
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("total = 1 + 1"),
        nbformat.v4.new_code_cell("assert total == 3, 'the check of this cell'"),
        nbformat.v4.new_code_cell("never = 'run'")])
    with pytest.raises(CellExecutionError, match="the check of this cell"):
        execute(notebook, str(tmp_path), str(tmp_path))
    assert notebook.cells[2].outputs == [] and notebook.cells[2].execution_count is None


@pytest.mark.spark
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_without_a_cell_error(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    try:
        execute(notebook, os.path.dirname(path), str(tmp_path))
    except CellExecutionError as exc:
        pytest.fail(f"{os.path.relpath(path, ROOT)}: {exc}", pytrace=False)
