"""A running keyed job (:class:`KeyedQuery`): its errors, and a stop that never cuts a batch off.

Spark's ``StreamingQuery.stop()`` marks the query terminated, cancels its jobs and interrupts
its stream thread. Called while a batch runs keyedstate work, it cuts the batch off (its
checkpoint is aborted, so nothing is lost, but the work is), and Spark then matches the
batch's error text against a pattern whose matcher recurses once per character: on a long
Python traceback it overflows the stack and prints a 1,000-line ``StackOverflowError``.
So :meth:`KeyedQuery.stop` calls it only when no batch runs keyedstate work, through the
driver's :class:`StopGate` (every batch passes it first, in ``process_batch``):

1. Mark the gate stopping.
2. Wait, up to the stop's ``timeout``, until one of: the batch in flight finished and the next
   one arrived at the gate (where it waits); Spark is between triggers (no batch planned or
   running); the query ended by itself.
3. Call ``StreamingQuery.stop()``. A batch waiting at the gate, or arriving after it, is not
   run: it raises an interruption that Spark takes for its own stop (:func:`interruption`),
   so Spark records the batch neither as done (it is planned again on restart) nor as a
   failure.

A batch already cut off by a direct ``query.query.stop()`` raises the same interruption
instead of its long error, so that stop is quiet too (the batch runs again on restart).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from keyedstate.checkpoint.savepoint import check_savepoint_target
from keyedstate.errors import BatchFailedError, ConfigurationError, StopTimeoutError
from keyedstate.spark.connect import is_connect, remote_failure, unsupported
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import SnapshotFormat

if TYPE_CHECKING:
    from keyedstate.spark.driver import BatchStats, KeyedJobDriver
    from keyedstate.spark.pyspark_types import Query

#: How long :meth:`KeyedQuery.stop` waits for the batch in flight by default, in seconds.
STOP_TIMEOUT_S = 60.0
#: How often the stop and a batch waiting at the gate look at the query's state.
POLL_S = 0.02
#: A batch waits at the gate at most this long for Spark to stop the query, then runs (a stop
#: that never reached Spark must not hold the query forever).
GATE_WAIT_S = 600.0


def interruption(batch_id: int, what: str) -> Exception:
    """What ``foreachBatch`` raises for a batch that a stop cut off or refused: a
    ``Py4JJavaError`` of a ``java.lang.InterruptedException`` without stack frames. Spark
    takes an error of a ``foreachBatch`` function for an interruption by its stop when the
    text names one (``StreamExecution.PROXY_ERROR``, SPARK-39218): then it logs nothing,
    records no exception and does not commit the batch. The text must stay short: that
    pattern's matcher recurses per character and overflows the stream thread's stack on a
    few thousand (measured: ~1,700), so neither the JVM's stack (5,000 characters from the
    stream thread) nor the batch's own error goes along. Should a Spark version not take it
    for a stop, the query ends with this short error, which :class:`KeyedQuery` does not
    report as a failure."""
    message = f"keyedstate: batch {batch_id} {what}: the query was stopped"
    try:
        from py4j.protocol import Py4JJavaError
        from pyspark import SparkContext

        jvm, gateway = SparkContext._jvm, SparkContext._gateway
        assert jvm is not None and gateway is not None
        error = jvm.java.lang.InterruptedException(message)
        error.setStackTrace(gateway.new_array(jvm.java.lang.StackTraceElement, 0))
        return Py4JJavaError("An error occurred while calling foreachBatch.\n", error)
    except Exception:  # noqa: BLE001 - no JVM to build it in: a short error still stops Spark
        return BatchFailedError(message, batch_id=batch_id)


class StopGate:
    """Where a batch meets a stop (steps in the module docstring). One per driver: batches
    pass it on Spark's stream thread (:meth:`enter`, :meth:`cut_off`), :meth:`stop` runs on
    the caller's thread."""

    def __init__(self) -> None:
        #: the Spark ``StreamingQuery``, once started (batches before it pass as usual)
        self.query: Query | None = None
        #: batches a stop refused or cut off: not failures, they run again on restart
        self.interrupted: list[int] = []
        self._stopping = threading.Event()
        #: a batch waits at the gate for Spark to stop the query
        self._waiting = threading.Event()
        #: the thread that runs the batches (a stop called from it could never see the end
        #: of the batch it is part of)
        self._batch_thread: int | None = None

    def spark_stopped(self) -> bool:
        """Whether Spark has stopped the query (its ``stop()`` marks it before interrupting)."""
        query = self.query
        return query is not None and not query.isActive

    # -- Spark's stream thread -----------------------------------------------------------------

    def enter(self, batch_id: int) -> None:
        """Before a batch runs: while a stop is under way, wait for Spark to stop the query;
        once it has, refuse the batch (raise :func:`interruption`)."""
        self._batch_thread = threading.get_ident()
        if self._stopping.is_set():
            self._waiting.set()
            try:
                deadline = time.monotonic() + GATE_WAIT_S
                while (self._stopping.is_set() and not self.spark_stopped()
                       and time.monotonic() < deadline):
                    time.sleep(POLL_S)
            finally:
                self._waiting.clear()
        if self.spark_stopped():
            self.interrupted.append(batch_id)
            raise interruption(batch_id, "was not run")

    def cut_off(self, batch_id: int) -> Exception | None:
        """After a batch failed: the interruption to raise instead when Spark's stop cut it
        off (a direct ``query.query.stop()``), else None (a failure of its own)."""
        if not self.spark_stopped():
            return None
        self.interrupted.append(batch_id)
        return interruption(batch_id, "was interrupted")

    # -- the caller's thread -------------------------------------------------------------------

    def stop(self, timeout: float | None) -> None:
        """Stop the Spark query once no batch runs keyedstate work; past ``timeout`` seconds
        (None: no limit) raise :class:`StopTimeoutError` and leave the query running."""
        query = self.query
        assert query is not None, "KeyedQuery sets the query before its stop() can be called"
        if threading.get_ident() == self._batch_thread:
            raise ConfigurationError(
                "stop() was called from inside a batch (a listener or a sink runs on Spark's "
                "stream thread): the batch can't end while it waits; call stop() from another "
                "thread")
        # Step 1. Batches that arrive from now on wait at the gate.
        self._stopping.set()
        try:
            # Step 2. Wait for a moment when no batch runs keyedstate work.
            deadline = None if timeout is None else time.monotonic() + timeout
            while not (self._waiting.is_set() or not query.isActive
                       or not query.status["isTriggerActive"]):
                if deadline is not None and time.monotonic() >= deadline:
                    raise StopTimeoutError(
                        f"the batch in flight did not finish within the stop's timeout of "
                        f"{timeout:g} s; the query keeps running. Call stop() again with a "
                        f"longer timeout (None waits as long as it takes), or interrupt the "
                        f"batch with query.query.stop(): it then runs again from the last "
                        f"checkpoint on restart")
                self._waiting.wait(POLL_S)
        except BaseException:
            self._stopping.clear()  # a batch waiting at the gate runs
            raise
        # Step 3. Spark marks the query stopped: a batch at the gate is refused.
        query.stop()


class KeyedQuery:
    """A running keyed job: the Spark ``StreamingQuery`` plus keyedstate's statistics.

    A batch that fails stops the query; :meth:`await_termination`,
    :meth:`process_all_available` and :meth:`stop` then raise its error: a
    :class:`~keyedstate.errors.BatchFailedError` naming the batch, the subtask and the key
    with the traceback of the user's code, or the keyedstate error the driver raised (such
    as :class:`~keyedstate.errors.CheckpointProtocolError`) as it is. Its ``__cause__`` is
    Spark's exception (or the driver's own exception). Failures of Spark itself (a source)
    come as Spark raised them.

    Over Spark Connect (:mod:`keyedstate.spark.connect`) the driver that runs the batches is a
    copy in the Connect server: :attr:`stats` are read from the checkpoints, a failure is
    rebuilt from the text of Spark's exception, and what needs the running coordinator here
    (:meth:`add_listener`, :meth:`trigger_savepoint`, a stop with ``drain``) raises
    :class:`~keyedstate.errors.SparkConnectUnsupportedError`.
    """

    def __init__(self, query: Query, driver: KeyedJobDriver) -> None:
        self.query = query
        self.driver = driver
        #: the batches run in a Spark Connect server, not in this process
        self.connect = is_connect(driver.job.stream.dataframe().sparkSession)
        driver.gate.query = query

    @property
    def stats(self) -> list[BatchStats]:
        """The statistics of the batches this job ran since its start, oldest first. Over
        Spark Connect, those its checkpoints recorded (the latest checkpoint's history, see
        :meth:`KeyedJobDriver.recorded_stats`)."""
        return self.driver.recorded_stats() if self.connect else self.driver.stats

    @property
    def last_progress(self) -> dict[str, Any]:
        """Spark's last progress with keyedstate's last checkpoint statistics."""
        stats = self.stats
        last = stats[-1] if stats else None
        return {"spark": self.query.lastProgress,
                "keyedstate": None if last is None else last.__dict__}

    def add_listener(self, listener: Callable[[BatchStats], None]) -> None:
        """Call ``listener`` with each batch's statistics, at the end of the batch (on Spark's
        stream thread: it must not call :meth:`stop`). Not over Spark Connect: the batches
        end in the Connect server's process."""
        if self.connect:
            raise unsupported("add_listener()", "Read query.stats (read from the checkpoints) "
                              "or Spark's query progress (query.query.lastProgress) instead.")
        self.driver.listeners.append(listener)

    def process_all_available(self) -> None:
        """Block until every input available now is processed (Spark's
        ``processAllAvailable``); a failed batch raises its error (see the class)."""
        from pyspark.errors import StreamingQueryException

        try:
            self.query.processAllAvailable()
        except StreamingQueryException as exc:
            self._raise_failure(exc)

    def await_termination(self, timeout: float | None = None) -> bool | None:
        """Wait for the query to end (Spark's ``awaitTermination``: with ``timeout``, whether
        it ended within it); a failed batch raises its error (see the class)."""
        from pyspark.errors import StreamingQueryException

        try:
            # pyspark annotates timeout as int, but takes seconds as any number (both the
            # classic and the Connect query send int(timeout * 1000) ms).
            return self.query.awaitTermination(timeout)  # type: ignore[arg-type]
        except StreamingQueryException as exc:
            self._raise_failure(exc)
            return True if timeout is not None else None

    def _raise_failure(self, exc: BaseException) -> None:
        """Raise the recorded failure of the batch that stopped the query, from ``exc``; return
        when the query only ended by a stop that refused a batch; else re-raise ``exc``."""
        failure = self.driver.failure or (remote_failure(exc) if self.connect else None)
        if failure is not None:
            raise failure from (failure.__cause__ or exc)
        if self.driver.gate.interrupted:
            return
        raise exc

    def trigger_savepoint(self, target: str,
                          format: SnapshotFormat | str = SnapshotFormat.NATIVE) -> str:
        """Take a savepoint of the running job in ``target`` without stopping it (Flink's
        ``flink savepoint``): the state as of the last completed checkpoint. Returns the path
        or URL of its ``_metadata``. See :meth:`KeyedJobDriver.savepoint`. Not over Spark
        Connect (the coordinator, whose lock keeps the checkpoint from being subsumed
        meanwhile, runs in the Connect server): use ``stop(savepoint=...)``."""
        if self.connect:
            raise unsupported("trigger_savepoint() of a running job",
                              "Stop the job with stop(savepoint=...) and start it again from "
                              "the savepoint.")
        return self.driver.savepoint(target, format)

    def stop(self, *, drain: bool = False, savepoint: str | None = None,
             format: SnapshotFormat | str = SnapshotFormat.NATIVE,
             timeout: float | None = STOP_TIMEOUT_S) -> str | None:
        """Stop after the batch in flight: it finishes (its checkpoint and its sinks' commit)
        and no other batch starts keyedstate work (one Spark has planned is not run and is
        planned again on restart; see the module docstring). ``timeout`` bounds the wait for
        the batch in flight, in seconds (None: no limit); past it,
        :class:`~keyedstate.errors.StopTimeoutError` is raised and the query keeps running.

        With ``drain``, fire every timer first (the last checkpoint then marks the job
        finished). With ``savepoint``, take a savepoint there (``format`` native or
        canonical; after the drain, if both) and return its ``_metadata`` path. A
        ``savepoint`` target that already holds one is refused
        (:class:`SnapshotExistsError`) before the job is stopped. A query that failed raises
        its error (see the class), and neither drains nor takes a savepoint.

        Over Spark Connect, the asynchronous mode's checkpoints in flight are completed here
        once the query has stopped, from what the server's copy of the driver recorded in the
        checkpoint storage, and their sinks commit here, with this client's session
        (:meth:`KeyedJobDriver.flush`). The savepoint is taken here then, from the job's
        latest checkpoint, as ``keyedstate savepoint create`` does: it carries any output of
        that batch the sinks had not committed (the job restored from it commits it first).
        ``drain`` is refused before the job is stopped: its batch would run in this process
        while the coordinator's state is in the Connect server."""
        if drain and self.connect:
            raise unsupported("stop(drain=True)",
                              "Stop without drain (the timers fire after a restart), or run "
                              "the job on a classic SparkSession to drain it.")
        if savepoint:
            check_savepoint_target(CheckpointStorage(savepoint, self.driver.config.storage_options))
        if self.query.isActive:
            self.driver.gate.stop(timeout)
        self.query.stop()  # a query that ended by itself: Spark's clean-up
        exc = self.query.exception()
        failure = self.driver.failure or (
            remote_failure(exc) if self.connect and exc is not None else None)
        if failure is not None:
            raise failure from (failure.__cause__ or exc)
        if exc is not None and not self.driver.gate.interrupted:
            first = str(exc).strip().split("\n", 1)[0][:500]
            raise BatchFailedError(f"the query had failed: {first}") from exc
        spark = self.driver.job.stream.dataframe().sparkSession
        # The asynchronous mode: the last batches' checkpoints complete and their sinks
        # commit before the stop returns (and before a drain or a savepoint); over Spark
        # Connect here, from what the server's copy of the driver recorded.
        self.driver.flush()
        if drain:
            self.driver.drain(spark)
        if savepoint and self.connect:
            return self.driver.offline_savepoint(savepoint, format)
        return self.driver.savepoint(savepoint, format) if savepoint else None
