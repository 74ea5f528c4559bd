"""A subtask's failure on its way to the driver (:mod:`keyedstate.runtime.failures`): one line
of data inside whatever text Spark wraps around it, decoded in one place; no Spark needed."""

from __future__ import annotations

import pickle
import re
from typing import Any

from keyedstate.errors import BatchFailedError, CheckpointDiscardedError, TransientStorageError
from keyedstate.runtime.failures import (
    MARKER,
    TaskFailure,
    batch_failure,
    discard_for_client,
    find_discard,
    find_task_failure,
    processor_task_error,
    subtask_failed,
)


def user_function(key: Any) -> None:
    raise ValueError(f"cannot handle {key}")


def raised(fn: Any, *args: Any) -> BaseException:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


def test_subtask_failure_travels_as_one_data_line_inside_any_text():
    exc = raised(user_function, "u1")
    error = subtask_failed(3, 1, "the function raised", exc, "u1", user_code=True)
    head, data = str(error).rsplit("\n", 1)
    assert data.startswith(MARKER) and "\n" not in data
    assert head.startswith("batch 3, subtask 1, key 'u1': the function raised ValueError: "
                           "cannot handle u1\nTraceback (most recent call last):\n")
    assert re.search(r'test_failures\.py", line \d+, in user_function', head)
    assert error.key == "'u1'" and error.subtask == 1
    # what the driver gets: the text inside Spark's own exception, with Spark's text after it
    spark = RuntimeError(f"Job aborted ... Traceback ...\nkeyedstate.errors.{error!s}\n"
                         f" SQLSTATE: 38000\n\tat org.apache.spark.api.python...")
    wrapped = BatchFailedError("the driver's wrapper")
    wrapped.__cause__ = spark
    found = find_task_failure(wrapped)
    assert found == TaskFailure(3, 1, "ValueError", "cannot handle u1", "the function raised",
                                "'u1'", found.traceback if found else "")
    decoded = batch_failure(wrapped, 3)
    assert isinstance(decoded, BatchFailedError) and str(decoded) == head
    assert decoded.batch_id == 3 and "in user_function" in (decoded.user_traceback or "")
    assert pickle.loads(pickle.dumps(decoded)).key == "'u1'"


def test_runtime_errors_travel_without_a_traceback_and_keep_their_type():
    error = subtask_failed(2, 0, "the snapshot failed with", TransientStorageError("503"))
    assert str(error).startswith(
        "batch 2, subtask 0: the snapshot failed with TransientStorageError: 503\n" + MARKER)
    found = find_task_failure(error)
    assert found is not None and found.error == "TransientStorageError" and not found.traceback


def test_driver_failures():
    own = TransientStorageError("throttled")
    assert batch_failure(own, 4) is own  # a keyedstate error raised on the driver, as it is
    sink = raised(user_function, "k")
    error = batch_failure(sink, 4)
    assert str(error).startswith("batch 4: ValueError: cannot handle k\nTraceback")
    assert "in user_function" in str(error) and error.__cause__ is sink


def test_long_messages_and_tracebacks_are_clipped():
    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        raise ValueError("x" * 50_000)

    error = subtask_failed(0, 0, "the function raised", raised(deep, 60), "k", user_code=True)
    head = str(error).rsplit("\n", 1)[0]
    assert len(head) < 3500 and head.count("characters left out") == 2  # message, traceback
    frames = head.split("Traceback (most recent call last):\n", 1)[1]
    assert frames.startswith('  File "') and "test_failures.py" in frames.split("\n")[0]


def test_unknown_text_decodes_to_nothing():
    assert find_task_failure(RuntimeError("no marker")) is None
    assert find_task_failure(RuntimeError(MARKER + "{not json")) is None
    assert find_task_failure(RuntimeError(MARKER + '{"batch_id": 1}')) is None


def test_discarded_checkpoints_travel_to_a_connect_client_with_their_batches():
    """The driver's copy in a Spark Connect server raises a discard with a data line; the
    client rebuilds it, typed, with the discarded batches, from whatever text Spark wraps
    around it. Rebuilt from its ``keyedstate.errors.<Name>:`` line alone, a leaf with fields
    of its own is not rebuilt (its constructor needs them), rather than failing the rebuild."""
    error = CheckpointDiscardedError("checkpoint 3 failed in its asynchronous phase (denied)",
                                     discarded_batches=[1, 2], last_batch_id=0)
    sent = discard_for_client(error)
    spark_text = ("StreamingQueryException: [FOREACH_BATCH_USER_FUNCTION_ERROR] ...\n"
                  f"keyedstate.errors.CheckpointDiscardedError: {sent}\n  at org.apache...")
    rebuilt = find_discard(RuntimeError(spark_text))
    assert isinstance(rebuilt, CheckpointDiscardedError)
    assert (rebuilt.discarded_batches, rebuilt.last_batch_id) == ([1, 2], 0)
    assert str(rebuilt) == str(error)
    assert find_discard(RuntimeError("keyedstate-discarded: {broken")) is None
    only_its_line = RuntimeError(f"keyedstate.errors.CheckpointDiscardedError: {error}")
    assert processor_task_error(only_its_line) is None
