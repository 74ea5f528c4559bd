"""``python -m keyedstate.cli ...``: the ``keyedstate`` command, from any interpreter."""

from keyedstate.cli import main

if __name__ == "__main__":
    main()
