"""What every ``keyedstate`` command shares: its ``--json`` and ``--storage-options`` options,
byte formats, and how an error ends a command (message and exit status).

Errors (the one mapping from errors to exit statuses): a command runs its work inside
:func:`reported_errors`; a :class:`~keyedstate.errors.KeyedStateError` leaf or an ``OSError``
(storage) ends it with ``Error: <ErrorType>: <message>`` on stderr and exit status
:data:`EXIT_FAILED`. The leaf's name is part of the message because scripts and the tests
match on it (``SnapshotExistsError``, ``CorruptCheckpointError``, ...). Exit status 2 is click's
own, for a wrong option or argument (``--storage-options`` that is not a JSON object
included). Any other exception is a bug and keeps its traceback. A command whose result is partial
(a listing with an unreadable checkpoint) prints the whole result first, then ends the same way
(:func:`partial_result`).

JSON (``--json``): :func:`echo_json` writes strict JSON (RFC 8259): a float that is not finite
(NaN, infinity) is written as ``null``, never as the bare ``NaN`` Python's ``json`` allows. The
shape of each command's JSON is documented in docs/cli.md ("JSON output").
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import click
from rich.console import Console

from keyedstate.errors import KeyedStateError

#: Exit status of a command that failed with a typed error (see the module docstring).
EXIT_FAILED = 1

#: The errors a command reports as a message instead of a traceback: every typed
#: keyedstate error, and storage's own ``OSError`` (fsspec raises those untranslated).
REPORTED_ERRORS: tuple[type[BaseException], ...] = (KeyedStateError, OSError)

#: Progress bars, spinners and logs go to stderr, so stdout holds only the result.
stderr = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


class CommandFailedError(click.ClickException):
    """A command ended by a reported error: click prints ``Error: <message>`` and exits with
    :data:`EXIT_FAILED`."""

    exit_code = EXIT_FAILED


def failure_of(exc: BaseException) -> CommandFailedError:
    """The message and exit status a reported error ends a command with."""
    return CommandFailedError(f"{type(exc).__name__}: {exc}")


@contextmanager
def reported_errors() -> Iterator[None]:
    """Run a command's work: a :data:`REPORTED_ERRORS` error becomes :func:`failure_of` it
    (chained, so ``--traceback``-style debugging still sees the cause)."""
    try:
        yield
    except REPORTED_ERRORS as exc:
        raise failure_of(exc) from exc


def partial_result(what: str) -> CommandFailedError:
    """The failure a command ends with after printing a result that left something out
    (``what`` names it and the way out): exit status :data:`EXIT_FAILED`."""
    return CommandFailedError(what)


def json_option(help: str = "Print JSON instead of tables.") -> Callable[[F], F]:
    """``--json`` (parameter ``as_json``): print the result as JSON on stdout."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def storage_options_option(
    help: str = 'fsspec options as a JSON object, e.g. \'{"endpoint_url": '
                '"http://localhost:9000"}\'.',
) -> Callable[[F], F]:
    """``--storage-options JSON`` (parameter ``storage_options``, parsed by
    :func:`parse_storage_options`)."""
    return click.option("--storage-options", "storage_options", default=None, metavar="JSON",
                        help=help)


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """``--storage-options JSON``: the fsspec options as a dict ({} when not given); anything
    but a JSON object is a ``click.BadParameter`` naming the option."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--storage-options") from exc
    if not isinstance(options, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--storage-options")
    return options


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, infinity) replaced by None, in dicts, lists
    and tuples at any depth: what :func:`echo_json` writes is valid JSON for any parser."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def echo_json(value: Any) -> None:
    """``value`` as indented, strict JSON on stdout (:func:`strict_json`; ``str()`` of what
    JSON has no type for)."""
    click.echo(json.dumps(strict_json(value), indent=2, default=str, allow_nan=False))


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB (one decimal above bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
