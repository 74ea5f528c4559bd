# Two commands on a fresh machine (Python 3.11+, Java 17+):
#   make demo   creates .venv, installs keyedstate, runs the main job
#   make check  the fast loop (1 min 49 s on 2 cores, one pytest process per core:
#               tests/README.md): lint (import contracts, ruff), types (mypy,
#               tests/test_typing.py) and the unit tests (not marked spark, s3, chaos, slow or
#               integration; property tests draw a quarter of their examples: tests/README.md)
#   make test   installs the test dependencies, runs the whole suite, the tests that need
#               no Spark on every core, then the Spark tests in one process (its browser tests
#               need Chromium, `apt-get install chromium` as root: skipped without it,
#               failed without it under CI=true; .ci/run installs it where it can,
#               docs/checkpoints.md "Testing the page in a browser"; the notebook
#               examples/notebook.ipynb in a Jupyter kernel; the wheel built and installed
#               into a new venv, docs/installing.md)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The pytest processes of make check and of make test's first run (pytest-xdist; `auto`: one
# per core). A module stays in one process (--dist loadfile): its module fixtures are built once.
CHECK_WORKERS ?= auto

.PHONY: demo test check install bench lint docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e ".[test,spark,connect,s3,delta,iceberg,bench,metrics]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/keyedstate demo

# make test in two runs: the tests that need no Spark on every core (as make check), then the
# Spark tests in one process (two Spark sessions on 2 cores would slow each other's timed
# waits). Exit code 5 is "nothing selected" (PYTEST_ARGS naming tests of one kind only).
test: lint
	$(PY) -m pytest -q -n $(CHECK_WORKERS) --dist loadfile -m "not spark" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q -m spark $(PYTEST_ARGS) || [ $$? -eq 5 ]

check: lint
	KEYEDSTATE_TEST_BUDGET=check $(PY) -m pytest -q -n $(CHECK_WORKERS) --dist loadfile -m "not spark and not s3 and not chaos and not slow and not integration" $(PYTEST_ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site
	@echo "the docs site: site/index.html (or: $(PY) -m mkdocs serve)"

bench: $(STAMP)
	$(VENV)/bin/keyedstate bench --help

lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check keyedstate tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
