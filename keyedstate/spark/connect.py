"""Spark Connect: what changes when a keyed job's DataFrame comes from a Spark Connect session
(``SparkSession.builder.remote("sc://...")``), and what is refused (docs/spark.md, "Spark
Connect").

A Spark Connect client has no JVM and no ``SparkContext``. Its ``foreachBatch`` function is
pickled (cloudpickle) in the client and run, batch after batch, by one Python process that the
*server* starts next to its Spark driver; the DataFrame that function gets is a Connect
DataFrame of a session of that process. So under Connect:

- ``start()`` runs the job's start-up (access check, restore, claim, recovery) in the client,
  then ships the driver, with the coordinator's state as start-up left it, to the server's
  ``foreachBatch`` process (:func:`shipped`), which runs every batch and completes every
  checkpoint from then on: the coordinator lives next to the Connect server, not in the client.
- What the client's :class:`~keyedstate.spark.query.KeyedQuery` knows of the running job it
  reads from the checkpoint storage (statistics) or from Spark's query (a failure's text).
- In the asynchronous mode the server's copy records each checkpoint in flight in the
  checkpoint storage; Spark ends that copy's process with the query, so the client's stop
  completes what it left in flight from those records, once the query stopped
  (:meth:`~keyedstate.spark.driver.KeyedJobDriver.flush`).
- What needs the running coordinator in the client process is refused with
  :class:`~keyedstate.errors.SparkConnectUnsupportedError`.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Iterable

from keyedstate.errors import (
    KeyedStateError,
    SparkConnectServerError,
    SparkConnectUnsupportedError,
)
from keyedstate.runtime.failures import find_discard, find_task_failure, processor_task_error

if TYPE_CHECKING:
    from keyedstate.spark.pyspark_types import Query, Session, StreamWriter


def is_connect(spark: Session) -> bool:
    """Whether ``spark`` (a SparkSession) is a Spark Connect session. Told by its class, not by
    ``pyspark.sql.utils.is_remote()``: that reads a process-wide switch, and one process may
    hold a classic session and a Connect session."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def task_slots(spark: Session) -> int | None:
    """The cluster's task slots now (classic Spark: ``defaultParallelism``, executors may come
    and go); under Spark Connect, which has no ``SparkContext``, the session's
    ``spark.default.parallelism`` if set, else None (unknown)."""
    if not is_connect(spark):
        return max(1, int(spark.sparkContext.defaultParallelism))
    value = spark.conf.get("spark.default.parallelism", None)
    return max(1, int(value)) if value else None


def shipped(parts: Iterable[tuple[str, object]]) -> None:
    """Check that every part of a job the Connect server's ``foreachBatch`` process needs
    pickles (``parts``: what to call it, the object), as pyspark's Connect client pickles it
    (cloudpickle); raise :class:`SparkConnectUnsupportedError` naming the first that does not
    (a sink holding a lock, an open file or a client of some service), instead of pyspark's
    error naming only ``foreachBatch``."""
    from pyspark.serializers import CloudPickleSerializer

    serializer = CloudPickleSerializer()
    for what, part in parts:
        try:
            serializer.dumps(part)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise SparkConnectUnsupportedError(
                f"{what} can't be pickled ({exc}), and under Spark Connect every batch runs in "
                f"a Python process of the Connect server, which gets the job pickled. Open "
                f"locks, files and connections in the sink's commit (or the function's open), "
                f"not in its constructor"
            ) from exc


def unsupported(what: str, instead: str) -> SparkConnectUnsupportedError:
    """The error for ``what`` (a method of a running job) that needs the coordinator in the
    client process, with the way out (``instead``)."""
    return SparkConnectUnsupportedError(
        f"{what} is not supported over Spark Connect: the job's checkpoint coordinator runs in "
        f"the Connect server's foreachBatch process, not in this client. {instead}")


def remote_failure(exc: BaseException) -> KeyedStateError | None:
    """The keyedstate error that failed a batch in the Connect server, rebuilt from Spark's
    exception ``exc`` (its text is all the client gets): checkpoints in flight discarded
    (the asynchronous mode) and a subtask's failure from their data lines
    (:mod:`keyedstate.runtime.failures`: the discarded batches; the key and the user's
    traceback), else the last ``keyedstate.errors.<Name>:`` line as that type (its first
    line); None when the failure is not keyedstate's."""
    discarded = find_discard(exc)
    if discarded is not None:
        return discarded
    task = find_task_failure(exc)
    if task is not None:
        return task.to_error()
    return processor_task_error(exc)


#: Spark's error class when the Connect server's ``foreachBatch`` process could not start or
#: unpickle the function (raised by ``DataStreamWriter.start()``, before any batch)
RUNNER_FAILURE = "STREAMING_PYTHON_RUNNER_INITIALIZATION_FAILURE"


def started(writer: StreamWriter) -> Query:
    """``writer.start()`` of a Connect client's query; a server that can't load the job raises
    :class:`SparkConnectServerError` with the last line of its Python error."""
    try:
        return writer.start()
    except Exception as exc:
        text = str(exc)
        if RUNNER_FAILURE not in text:
            raise
        lines = [line.strip() for line in text.splitlines()
                 if line.strip() and not line.startswith((" ", "\t"))]
        cause = next((line for line in reversed(lines) if "Error" in line.split(":")[0]),
                     lines[0] if lines else text)
        raise SparkConnectServerError(
            f"the Spark Connect server's Python could not load the job ({cause}). Its "
            f"foreachBatch process unpickles the driver, the KeyedProcessFunction and the "
            f"sinks: keyedstate and the modules they are defined in must be importable there "
            f"(installed in the server's Python, or on the server's PYTHONPATH), with the "
            f"client's Python version"
        ) from exc
