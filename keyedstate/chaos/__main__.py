"""``python -m keyedstate.chaos``: the ``keyedstate chaos`` command without the CLI wiring."""

from keyedstate.cli_chaos import chaos

if __name__ == "__main__":
    chaos()
