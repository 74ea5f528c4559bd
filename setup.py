"""Which packages the distribution holds (every other setting is in pyproject.toml).

pyproject.toml's declarative ``packages.find`` can't add a package whose folder has another
name, so the list is made here: the library (``keyedstate*``, discovered), plus folders beside
it shipped under an import name of their own, so that the installed ``keyedstate`` command
imports them without touching ``sys.path``.
"""

from setuptools import find_packages, setup

#: import name -> folder
RENAMED = {
    # the example jobs (``keyedstate demo`` runs examples/click_sessions.py)
    "keyedstate_examples": "examples",
}

setup(packages=[*find_packages(include=["keyedstate*"]), *RENAMED], package_dir=RENAMED)
