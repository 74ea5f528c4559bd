"""Example jobs, runnable locally (no Java) and on Spark; installed as ``keyedstate_examples``."""
