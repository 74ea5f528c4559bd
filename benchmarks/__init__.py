"""keyedstate benchmarks, run by ``keyedstate bench NAME``. Figures go to docs/benchmarks.md."""
