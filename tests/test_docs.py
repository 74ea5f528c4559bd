"""The docs show code that exists: a Python snippet in README.md or docs/ whose first line
names an example (``# examples/<file>.py``) is an excerpt of that file, and every example is
linked from the docs. (The ParquetSink listing of docs/spark.md is checked against a real run
in tests/spark/test_examples.py.)"""

from __future__ import annotations

import glob
import os
import re
import textwrap
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: a fenced Python block whose first line names the example it is an excerpt of
EXCERPT = re.compile(r"```python\n# (examples/[\w/]+\.py)\n(.*?)```", re.S)
#: example modules that are no job of their own
NOT_EXAMPLES = {"__init__.py", "harness.py"}


def _docs() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _excerpts() -> list[tuple[str, str, str]]:
    """(doc, example path, snippet body) of every excerpt in the docs."""
    return [(os.path.relpath(doc, ROOT), m.group(1), m.group(2))
            for doc in _docs() for m in EXCERPT.finditer(_read(doc))]


def excerpt_pattern(body: str) -> re.Pattern[str]:
    """``body`` as consecutive lines of a file, all shifted by the same indentation; a line
    ``...`` stands for any number of lines."""
    parts = []
    indent = r"(?P<indent>[ ]*)"
    for line in body.rstrip("\n").split("\n"):
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        elif not line.strip():
            parts.append(r"[ \t]*\n")
        else:
            parts.append(indent + re.escape(line) + r"\n")
            indent = r"(?P=indent)"
    return re.compile("^" + "".join(parts), re.M)


def test_the_docs_have_excerpts_of_the_examples():
    named = {example for _, example, _ in _excerpts()}
    assert {"examples/card_alerts.py", "examples/page_views.py"} <= named


@pytest.mark.parametrize("doc, example, body", _excerpts(),
                         ids=lambda v: v.split("\n")[0][:40] if isinstance(v, str) else v)
def test_an_excerpt_is_in_its_example(doc, example, body):
    source = _read(os.path.join(ROOT, example))
    assert excerpt_pattern(body).search(source), (
        f"{doc}: a snippet marked '# {example}' is not in {example} (update the snippet from "
        f"the file):\n{body}")


def test_excerpt_pattern_keeps_indentation_and_elides_lines():
    source = "class A:\n    x = 1\n    y = 2\n\n    def f(self):\n        return 3\n"
    assert excerpt_pattern("    x = 1\n...\n    def f(self):\n        return 3\n").search(source)
    assert excerpt_pattern("x = 1\ny = 2\n").search(source)  # shifted as a whole
    assert not excerpt_pattern("x = 1\n    y = 2\n").search(source)  # not as it is there
    assert not excerpt_pattern("    x = 1\n    def f(self):\n").search(source)  # no elision


def test_every_example_is_linked_from_the_docs():
    docs = "".join(_read(d) for d in _docs())
    examples = sorted(os.path.basename(p)
                      for pattern in ("*.py", "*.ipynb")
                      for p in glob.glob(os.path.join(ROOT, "examples", pattern))
                      if os.path.basename(p) not in NOT_EXAMPLES)
    assert examples
    assert [e for e in examples if f"examples/{e}" not in docs] == []


# -- imports, formats and runnable snippets ------------------------------------------------------

#: a fenced Python block anywhere (also indented in a list item)
PYTHON_BLOCK = re.compile(r"^([ \t]*)```python\n(.*?)^[ \t]*```", re.S | re.M)
#: an import of keyedstate (or its examples) in a snippet, parenthesized over lines or not
KEYEDSTATE_IMPORT = re.compile(
    r"^[ \t]*(from (?:keyedstate|keyedstate_examples)[\w.]* import (?:\([^)]*\)|[^\n]+)"
    r"|import (?:keyedstate|keyedstate_examples)[\w.]*)", re.M)


def _python_blocks() -> list[tuple[str, str]]:
    return [(os.path.relpath(doc, ROOT), textwrap.dedent(m.group(2)))
            for doc in _docs() for m in PYTHON_BLOCK.finditer(_read(doc))]


def _doc_imports() -> list[tuple[str, str]]:
    """(doc, import statement) of every keyedstate import in the docs' Python snippets."""
    return [(doc, re.sub(r"#[^\n]*", "", m.group(1)).strip())
            for doc, body in _python_blocks() for m in KEYEDSTATE_IMPORT.finditer(body)]


def test_the_docs_import_from_keyedstate() -> None:
    assert len(_doc_imports()) >= 10
    assert any("keyedstate.checkpoint.resolve" in s for _, s in _doc_imports())


@pytest.mark.parametrize("doc, statement", _doc_imports(), ids=lambda v: v[:60])
def test_every_import_in_the_docs_imports(doc: str, statement: str) -> None:
    """A snippet's ``from keyedstate... import X`` names a module and names that exist (run in a
    fresh namespace: nothing but the import itself)."""
    try:
        exec(compile(statement, doc, "exec"), {})
    except ImportError as exc:
        pytest.fail(f"{doc}: `{statement}` fails: {exc}")


def test_the_docs_name_the_metadata_format_version_writers_write() -> None:
    from keyedstate.storage.handles import FORMAT_VERSION

    stated = [(os.path.relpath(doc, ROOT), int(v)) for doc in _docs()
              for v in re.findall(r'"format_version": (\d+)', _read(doc))]
    assert stated
    assert [(doc, v) for doc, v in stated if v != FORMAT_VERSION] == []
    for doc in _docs():
        assert not re.search(rf"every writer writes version (?!{FORMAT_VERSION})\d",
                             _read(doc)), doc


def test_the_offline_python_savepoint_snippet_runs(tmp_path: Any) -> None:
    """docs/savepoints.md's offline Python savepoint, run on a local job's checkpoint: both
    savepoints are written and restore."""
    from tests.runtime.test_local_job import batches, config, new_job

    ckpt = str(tmp_path / "ckpt")
    with new_job(config(tmp_path)) as job:
        job.process_batch(batches(1)[0])
    [body] = [b for doc, b in _python_blocks()
              if doc == os.path.join("docs", "savepoints.md") and "carry(source)" in b]
    code = (body.replace('"/jobs/clicks/ckpt"', repr(ckpt))
            .replace('"/savepoints/', f'"{tmp_path / "sp"}/'))
    assert code != body
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/savepoints.md", "exec"), scope)
    for name in ("native", "canonical"):
        assert os.path.exists(scope[name]), name
        restored = config(tmp_path, checkpoint_dir=str(tmp_path / f"restored-{name}"),
                          restore_path=scope[name])
        with new_job(restored) as again:
            again.process_batch(batches(2)[1])


#: a test named in the docs: ``[tests/][folder/]test_x.py[::test_name[params]]`` (``name*``:
#: the tests whose names start so)
TEST_REFERENCE = re.compile(r"((?:tests/)?(?:[\w]+/)*test_\w+\.py)(?:::(\w+)(\*?))?")


def _test_files() -> dict[str, list[str]]:
    """Every test module by its file name (a name may stand in several folders)."""
    files: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
        files.setdefault(os.path.basename(path), []).append(os.path.relpath(path, ROOT))
    return files


def _defines(name: str, *, prefix: bool) -> str:
    """A pattern of a module line defining the test or test class ``name`` (``prefix``: or
    any whose name starts with it)."""
    end = "" if prefix else r"\b"
    return rf"^\s*def {name}{end}|^class {name}{end}"


def test_every_test_the_docs_name_exists() -> None:
    """A test the docs cite as evidence (a path, or a module and a test's name) is there: a
    moved or renamed test must take its citations along."""
    files = _test_files()
    missing = []
    for doc in [*_docs(), os.path.join(ROOT, "AGENTS.md"),
                os.path.join(ROOT, "tests", "README.md")]:
        for m in TEST_REFERENCE.finditer(_read(doc)):
            cited, name, prefix = m.group(1), m.group(2), m.group(3)
            where = os.path.relpath(doc, ROOT)
            if cited.startswith("tests/"):
                candidates = [cited] if os.path.isfile(os.path.join(ROOT, cited)) else []
            else:  # a file name, or a path below tests/
                candidates = [p for p in files.get(os.path.basename(cited), [])
                              if p.endswith("/" + cited) or os.path.basename(p) == cited]
            if not candidates:
                missing.append(f"{where}: {cited}")
            elif name and not any(re.search(_defines(name, prefix=bool(prefix)),
                                             _read(os.path.join(ROOT, p)), re.M)
                                  for p in candidates):
                missing.append(f"{where}: {cited}::{name}")
    assert not missing, "the docs cite tests that are not there:\n" + "\n".join(missing)
