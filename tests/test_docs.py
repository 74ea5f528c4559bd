"""The docs show code that exists: a Python snippet in README.md or docs/ whose first line
names an example (``# examples/<file>.py``) is an excerpt of that file, and every example is
linked from the docs. (The ParquetSink listing of docs/spark.md is checked against a real run
in tests/spark/test_examples.py.)"""

from __future__ import annotations

import glob
import os
import re

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
    examples = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "examples", "*.py"))
                      if os.path.basename(p) not in NOT_EXAMPLES)
    assert examples
    assert [e for e in examples if f"examples/{e}" not in docs] == []
