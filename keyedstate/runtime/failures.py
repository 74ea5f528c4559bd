"""Batch failures: how a subtask's error travels from a Spark task to the driver, and the one
place where the driver decodes what failed.

A Spark task fails with text only: Spark turns the Python worker's exception into the message
of a JVM exception and hands the driver a few thousand characters of it inside its own. So a
subtask raises :class:`~keyedstate.errors.BatchFailedError` whose message is readable in
Spark's logs and ends with one line of data, :data:`MARKER` and a :class:`TaskFailure` as JSON:
the batch, the subtask, the key, the error and the traceback of the user's code.
:func:`batch_failure` finds that line in whatever the driver caught and builds the error a
user sees. The state processor's Spark jobs run no subtask and carry no data line: for them
:func:`processor_task_error` rebuilds the keyedstate error from the Python traceback Spark
quotes. A :class:`~keyedstate.errors.CheckpointDiscardedError` that the driver's copy in a
Spark Connect server raises to its client ends with a data line of its own
(:data:`DISCARD_MARKER`, :func:`discard_for_client` and :func:`find_discard`): the discarded
batches travel with it. Nothing else reads Spark's text.

The user's traceback starts at the user's code: the leading frames of keyedstate's runtime
(the modules in :data:`RUNTIME_FILES`) are dropped, the frames below it are kept.
"""

from __future__ import annotations

import json
import os
import re
import traceback
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

from keyedstate import errors as _errors
from keyedstate.errors import BatchFailedError, CheckpointDiscardedError, KeyedStateError

#: Starts the data line of a subtask's error (the rest of the line is a TaskFailure as JSON).
MARKER = "keyedstate-task-failure: "
#: Where the runtime's own frames come from: a traceback shown to users starts below them.
RUNTIME_FILES = frozenset(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name)
    for name in ("spark/api.py", "spark/driver.py", "spark/query.py", "spark/tasks.py",
                 "runtime/subtask.py", "runtime/function.py"))
#: Starts the data line of a discarded checkpoint's error sent to a Spark Connect client (the
#: rest of the line: its message and fields as JSON).
DISCARD_MARKER = "keyedstate-discarded: "
#: Longest error message and traceback carried (a message may embed a whole DataFrame).
MAX_MESSAGE_CHARS = 1000
MAX_TRACEBACK_CHARS = 2000
#: A key as passed when the function was not called for a key (``open``, ``close``).
NO_KEY: Any = object()
#: The last line of a Python traceback whose exception is a keyedstate error, as Spark quotes it.
_ERROR_LINE = re.compile(r"keyedstate\.errors\.(\w+): ([^\n]*)")


@dataclass(frozen=True)
class TaskFailure:
    """What failed in one subtask of one batch, as it travels to the driver."""

    batch_id: int
    subtask: int
    #: the error's class name (``ValueError``, ``TransientStorageError``)
    error: str
    message: str
    #: what was being done, as it precedes the error in the message: "the function raised",
    #: "restoring the state failed with"
    what: str
    #: the key's ``repr``; None when no key was current
    key: str | None = None
    #: the user's frames (:func:`user_traceback`); empty for the runtime's own errors
    traceback: str = ""

    def describe(self) -> str:
        """The message users read: where, what, and the user's traceback."""
        where = f"batch {self.batch_id}, subtask {self.subtask}"
        if self.key is not None:
            where += f", key {self.key}"
        text = f"{where}: {self.what} {self.error}: {self.message}"
        return f"{text}\n{self.traceback}".rstrip("\n") if self.traceback else text

    def encode(self) -> str:
        """The data line (JSON: one line whatever the text holds)."""
        return MARKER + json.dumps(asdict(self))

    def to_error(self) -> BatchFailedError:
        return BatchFailedError(self.describe(), batch_id=self.batch_id, subtask=self.subtask,
                                key=self.key, user_traceback=self.traceback or None)


def subtask_failed(batch_id: int, subtask: int, what: str, exc: BaseException,
                   key: Any = NO_KEY, *, user_code: bool = False) -> BatchFailedError:
    """The error a subtask raises (in the executor) for ``exc``; with ``user_code``, the
    traceback of the user's frames goes along."""
    failure = TaskFailure(
        batch_id=batch_id, subtask=subtask, error=type(exc).__name__,
        message=_clip(str(exc), MAX_MESSAGE_CHARS), what=what,
        key=None if key is NO_KEY else _clip(repr(key), 200),
        traceback=user_traceback(exc) if user_code else "")
    return BatchFailedError(f"{failure.describe()}\n{failure.encode()}", batch_id=batch_id,
                            subtask=subtask, key=failure.key,
                            user_traceback=failure.traceback or None)


def find_task_failure(exc: BaseException) -> TaskFailure | None:
    """The subtask failure carried by ``exc`` or an exception it was raised from (Spark's
    exception around the task's), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = _decode(_text(current))
        if found is not None:
            return found
        current = current.__cause__ or current.__context__
    return None


def batch_failure(exc: BaseException, batch_id: int) -> KeyedStateError:
    """The error that stopped batch ``batch_id``, as users get it from the query: a subtask's
    failure as a :class:`BatchFailedError` (decoded from Spark's exception); a keyedstate
    error raised on the driver as it is; anything else raised on the driver (a sink, Spark) as
    a :class:`BatchFailedError` naming the batch, with the traceback from the first frame
    outside the runtime (``__cause__``: the exception itself). A
    :class:`CheckpointDiscardedError` (the asynchronous mode) is raised as it is, even when a
    subtask's failure revealed it: which batches were discarded is what the user acts on."""
    if isinstance(exc, CheckpointDiscardedError):
        return exc
    task = find_task_failure(exc)
    if task is not None:
        return task.to_error()
    if isinstance(exc, KeyedStateError):
        return exc
    tb = user_traceback(exc)
    error = BatchFailedError(
        f"batch {batch_id}: {type(exc).__name__}: {_clip(str(exc), MAX_MESSAGE_CHARS)}\n{tb}"
        .rstrip("\n"), batch_id=batch_id, user_traceback=tb or None)
    error.__cause__ = exc
    return error


def for_spark(failure: KeyedStateError) -> BatchFailedError:
    """The short error ``foreachBatch`` raises to Spark for ``failure``: what Spark's log and
    ``StreamingQuery.exception()`` show (not Spark's exception around a task's, again)."""
    if isinstance(failure, BatchFailedError):
        return BatchFailedError(str(failure), batch_id=failure.batch_id, subtask=failure.subtask,
                                key=failure.key, user_traceback=failure.user_traceback)
    return BatchFailedError(f"{type(failure).__name__}: {failure}")


def processor_task_error(exc: BaseException) -> KeyedStateError | None:
    """The keyedstate error a state processor's Spark task raised, from Spark's failure
    ``exc``: the last ``keyedstate.errors.<Name>: <message>`` line naming a
    :class:`KeyedStateError` leaf, rebuilt as that type (the message's first line only);
    None when there is none."""
    for m in reversed(list(_ERROR_LINE.finditer(_text(exc)))):
        cls = getattr(_errors, m.group(1), None)
        if isinstance(cls, type) and issubclass(cls, KeyedStateError):
            try:
                return cls(m.group(2))
            except TypeError:  # a leaf with fields of its own: not rebuilt from its text
                continue
    return None


def user_traceback(exc: BaseException) -> str:
    """``exc`` formatted as Python does, from the first frame outside the runtime: the user
    function's frame, then the frames below it (chained exceptions included), clipped to
    :data:`MAX_TRACEBACK_CHARS` (the first frames and the last ones kept)."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in RUNTIME_FILES:
        tb = tb.tb_next
    if tb is None:
        return ""
    text = "".join(traceback.TracebackException(type(exc), exc, tb).format())
    return _clip(text, MAX_TRACEBACK_CHARS)


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}\n  [... {len(text) - limit} characters left out ...]\n" \
        f"{text[len(text) - (limit - head):]}"


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ (or a gone JVM) hides nothing of ours
        return ""


def discard_for_client(error: CheckpointDiscardedError) -> CheckpointDiscardedError:
    """``error`` as the driver's copy in a Spark Connect server raises it: its message ends
    with a data line carrying the message and the discarded batches, which the client decodes
    (:func:`find_discard`) from the text Spark hands it."""
    data = {"message": _clip(str(error), MAX_MESSAGE_CHARS),
            "discarded_batches": list(error.discarded_batches),
            "last_batch_id": error.last_batch_id}
    return CheckpointDiscardedError(f"{error}\n{DISCARD_MARKER}{json.dumps(data)}",
                                    discarded_batches=list(error.discarded_batches),
                                    last_batch_id=error.last_batch_id)


def find_discard(exc: BaseException) -> CheckpointDiscardedError | None:
    """The :class:`CheckpointDiscardedError` whose data line (:func:`discard_for_client`) the
    text of ``exc`` or of an exception it was raised from carries, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = _text(current)
        at = text.rfind(DISCARD_MARKER)
        if at >= 0:
            try:
                data, _ = json.JSONDecoder().raw_decode(text, at + len(DISCARD_MARKER))
                return CheckpointDiscardedError(
                    str(data["message"]),
                    discarded_batches=[int(b) for b in data["discarded_batches"]],
                    last_batch_id=int(data["last_batch_id"]))
            except (ValueError, TypeError, KeyError):
                pass
        current = current.__cause__ or current.__context__
    return None


def _decode(text: str) -> TaskFailure | None:
    at = text.rfind(MARKER)
    if at < 0:
        return None
    try:
        # raw_decode: Spark may append its own text after the line
        data, _ = json.JSONDecoder().raw_decode(text, at + len(MARKER))
        return TaskFailure(**data)
    except (ValueError, TypeError):
        return None
