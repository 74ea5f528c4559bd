"""A running keyed job (:class:`KeyedQuery`) and the errors a failed batch raises."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from keyedstate.checkpoint.metadata import SnapshotFormat
from keyedstate.checkpoint.savepoint import check_savepoint_target
from keyedstate.checkpoint.storage import CheckpointStorage
from keyedstate.errors import BatchFailedError

if TYPE_CHECKING:
    from keyedstate.spark.job import BatchStats, KeyedJobDriver


class KeyedQuery:
    """A running keyed job: the Spark ``StreamingQuery`` plus keyedstate's statistics.

    A batch that fails stops the query; :meth:`await_termination`,
    :meth:`process_all_available` and :meth:`stop` then raise its error: a
    :class:`~keyedstate.errors.BatchFailedError` naming the batch, the subtask and the key
    with the traceback of the user's code, or the keyedstate error the driver raised (such
    as :class:`~keyedstate.errors.CheckpointProtocolError`) as it is. Its ``__cause__`` is
    Spark's exception (or the driver's own exception). Failures of Spark itself (a source)
    come as Spark raised them.
    """

    def __init__(self, query: Any, driver: KeyedJobDriver) -> None:
        self.query = query
        self.driver = driver

    @property
    def stats(self) -> list[BatchStats]:
        return self.driver.stats

    @property
    def last_progress(self) -> dict[str, Any]:
        """Spark's last progress with keyedstate's last checkpoint statistics."""
        last = self.driver.stats[-1] if self.driver.stats else None
        return {"spark": self.query.lastProgress,
                "keyedstate": None if last is None else last.__dict__}

    def add_listener(self, listener: Callable[[BatchStats], None]) -> None:
        """Call ``listener`` with each batch's statistics, at the end of the batch (on Spark's
        stream thread)."""
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
            return self.query.awaitTermination(timeout)
        except StreamingQueryException as exc:
            self._raise_failure(exc)
            raise  # unreachable: _raise_failure raises

    def _raise_failure(self, exc: BaseException) -> None:
        """Raise the recorded failure of the batch that stopped the query, from ``exc``; else
        re-raise ``exc``."""
        failure = self.driver.failure
        if failure is not None:
            raise failure from (failure.__cause__ or exc)
        raise exc

    def trigger_savepoint(self, target: str,
                          format: SnapshotFormat | str = SnapshotFormat.NATIVE) -> str:
        """Take a savepoint of the running job in ``target`` without stopping it (Flink's
        ``flink savepoint``): the state as of the last completed checkpoint. Returns the path
        or URL of its ``_metadata``. See :meth:`KeyedJobDriver.savepoint`."""
        return self.driver.savepoint(target, format)

    def stop(self, *, drain: bool = False, savepoint: str | None = None,
             format: SnapshotFormat | str = SnapshotFormat.NATIVE) -> str | None:
        """Stop after the batch in flight. With ``drain``, fire every timer first (the last
        checkpoint then marks the job finished). With ``savepoint``, take a savepoint there
        (``format`` native or canonical; after the drain, if both) and return its
        ``_metadata`` path. A ``savepoint`` target that already holds one is refused
        (:class:`SnapshotExistsError`) before the job is stopped. A query that failed raises
        its error (see the class), and neither drains nor takes a savepoint."""
        if savepoint:
            check_savepoint_target(CheckpointStorage(savepoint, self.driver.config.storage_options))
        self.query.stop()
        exc = self.query.exception()
        failure = self.driver.failure
        if failure is not None:
            raise failure from (failure.__cause__ or exc)
        if exc is not None:
            first = str(exc).strip().split("\n", 1)[0][:500]
            raise BatchFailedError(f"the query had failed: {first}") from exc
        spark = self.driver.job.stream.df.sparkSession
        if drain:
            self.driver.drain(spark)
        return self.driver.savepoint(savepoint, format) if savepoint else None
