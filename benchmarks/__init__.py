"""keyedstate benchmarks, run by ``keyedstate bench NAME``. Figures go to docs/benchmarks.md.

This folder is installed as the package ``keyedstate_benchmarks`` (``package-dir`` in
pyproject.toml), so ``keyedstate bench`` imports it like any module, from any directory; the
benchmarks import each other relatively. Result files and plots are written where their
``--out`` / ``--plot`` arguments say (paths relative to the current directory).
"""
