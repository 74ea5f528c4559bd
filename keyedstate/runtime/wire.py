"""What crosses from a Python worker to the driver: the one home of the wire.

A batch's rows reach a subtask carrying two routing columns (:data:`KG_COLUMN`,
:data:`SUBTASK_COLUMN`: the key group and subtask that Spark's JVM, or the local runtime,
computed for each row). Each subtask answers with one row of :data:`REPORT_SCHEMA` (Spark's
``mapInArrow`` declares it as :data:`REPORT_DDL`, derived from the schema): a
:class:`SubtaskReport`, a frozen, versioned msgspec model, JSON-encoded in the ``report``
column by :func:`report_batch` and decoded by :func:`decode_reports` alone.

The driver and its workers run the same keyedstate (Spark ships no code between them); the
version still tells a mismatch apart from damage: a report of another version is refused with
:class:`~keyedstate.errors.UnsupportedFormatVersionError` naming both versions, one that does
not decode with :class:`~keyedstate.errors.CheckpointProtocolError`. The checkpoint records
what :meth:`SubtaskReport` figures turn into
(:class:`~keyedstate.checkpoint.stats.SubtaskStateStats`), not the report.

In the asynchronous mode (docs/checkpoints.md, "The asynchronous phase") the report carries no
handle: the subtask's process uploads its files after the task and then writes a
:class:`SubtaskAck` to ``chk-<N>/_acks/subtask-<i>`` (:func:`encode_ack`; read back by
:func:`decode_ack` alone), deleted once checkpoint N completes: the wire's one stored message,
versioned like the report. Over Spark Connect the driver that runs the batches is a copy in
the Connect server, whose process ends with the query: it also writes a :class:`FlightRecord`
of each checkpoint in flight to ``chk-<N>/_acks/flight`` (:func:`encode_flight`, read back by
:func:`decode_flight` alone), from which the client completes what the copy left in flight
once the query stopped.

Version 2: ``SubtaskReport.handle`` may be None (asynchronous mode), :class:`SubtaskAck`.
Version 3: :class:`FlightRecord`.
"""

from __future__ import annotations

from typing import Any, Iterable, TypeVar

import msgspec
import pyarrow as pa

from keyedstate.checkpoint.stats import SubtaskStateStats
from keyedstate.errors import CheckpointProtocolError, UnsupportedFormatVersionError
from keyedstate.serde import type_ddl
from keyedstate.storage.handles import KeyedStateHandle

#: the routing columns a subtask's input rows carry: their key group and subtask
KG_COLUMN = "_ks_key_group"
SUBTASK_COLUMN = "_ks_subtask"

#: the version of :class:`SubtaskReport` this keyedstate writes and reads
WIRE_VERSION = 3

#: a subtask's one result row: its report, JSON-encoded
REPORT_SCHEMA = pa.schema([pa.field("report", pa.binary(), nullable=False)])
#: :data:`REPORT_SCHEMA` as Spark DDL (``mapInArrow``'s result schema)
REPORT_DDL = ", ".join(f"{f.name} {type_ddl(f.type)}" for f in REPORT_SCHEMA)


class SubtaskFigures(msgspec.Struct, frozen=True):
    """What one subtask's part of one batch counted and took (seconds)."""

    #: events into the function (on time: late rows are not counted)
    rows_in: int
    #: rows the function received: ``rows_in``, or with a local aggregation one per key
    function_rows: int
    rows_out: int
    timers_fired: int
    #: the function's run (timers, rows, close)
    process_s: float
    #: getting the state before the batch (0 when the live copy was reused)
    restore_s: float
    #: reused the live copy as it was
    reused_local_state: bool
    #: restored from a snapshot (neither this nor reused: a new job's empty state)
    restored: bool
    #: restored by catching a stale live copy up (``restore_s``: only the changes since)
    caught_up: bool
    #: reused a copy its worker caught up in the background: the seconds that took, off the
    #: batch's path (0: none)
    background_catch_up_s: float
    sync_s: float
    async_s: float
    incremental_bytes: int
    full_bytes: int
    worker_pid: int

    def state_stats(self) -> SubtaskStateStats:
        """The subtask's statistics as its checkpoint records them."""
        return SubtaskStateStats.of_seconds(
            sync_s=self.sync_s, async_s=self.async_s, restore_s=self.restore_s,
            reused=self.reused_local_state, restored=self.restored, rows_in=self.rows_in,
            rows_out=self.rows_out, caught_up=self.caught_up,
            background_catch_up_s=self.background_catch_up_s)


class SubtaskReport(msgspec.Struct, frozen=True):
    """One subtask's answer for one batch: its snapshot and what it staged and counted."""

    #: :data:`WIRE_VERSION` of the writer
    version: int
    subtask: int
    #: the token of the live copy the subtask kept (the next batch reuses it if it matches)
    token: str
    #: the snapshot's handle; None in the asynchronous mode (it comes in the subtask's
    #: :class:`SubtaskAck`)
    handle: KeyedStateHandle | None
    #: output tag -> the staged Parquet file (relative to the checkpoint storage)
    staged: dict[str, str]
    #: the largest event time among the subtask's rows (None: none had one)
    max_event_time: int | None
    #: late rows split off (counted, dropped or side output)
    late: int
    figures: SubtaskFigures


class SubtaskAck(msgspec.Struct, frozen=True):
    """One subtask's acknowledgement of one checkpoint in the asynchronous mode, written by its
    process's uploader once the files are durable (``handle``), or once the upload failed
    (``error``, the failure as text; ``handle`` None)."""

    #: :data:`WIRE_VERSION` of the writer
    version: int
    checkpoint_id: int
    subtask: int
    #: the token of the live copy the snapshot was taken of (its report's)
    token: str
    handle: KeyedStateHandle | None
    #: seconds the upload (``materialize``) took, off the batch's path
    async_s: float
    error: str | None = None


class FlightRecord(msgspec.Struct, frozen=True):
    """A checkpoint in flight as the driver that triggered it records it in storage, for
    another process of the job to complete it (the Spark Connect client, once the server's
    copy of the driver ended with the query): what the loop's ``InFlight`` holds but the
    engine's context (:mod:`keyedstate.runtime.inflight`)."""

    #: :data:`WIRE_VERSION` of the writer
    version: int
    #: the start of the job whose loop triggered it (``JobStart.start_id``): a record of
    #: another start is a leftover, never completed
    start_id: str
    checkpoint_id: int
    #: the trigger's time (ms since the epoch) and properties
    timestamp_ms: int
    properties: dict[str, str]
    batch_id: int
    drain: bool
    #: the watermark the batch started with
    watermark: int
    #: the subtasks' reports, in subtask order, without handles (those are in the acks)
    reports: list[SubtaskReport]
    #: when the batch started, in seconds since the epoch (its duration in the statistics)
    started_s: float
    #: the Spark tasks that ran its subtasks (None: one per subtask)
    tasks: int | None = None


class _Version(msgspec.Struct):
    version: int


#: what a stored object decodes to (:func:`_decode_stored`)
T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_version_decoder = msgspec.json.Decoder(_Version)
_report_decoder = msgspec.json.Decoder(SubtaskReport)
_ack_decoder = msgspec.json.Decoder(SubtaskAck)
_flight_decoder = msgspec.json.Decoder(FlightRecord)


def _version_of(data: bytes, what: str) -> int:
    """The wire version ``data`` was written in, checked against :data:`WIRE_VERSION`."""
    try:
        version = _version_decoder.decode(data).version
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointProtocolError(
            f"{what} can't be read ({exc}): not a keyedstate {what.split()[-1]}") from exc
    if version != WIRE_VERSION:
        raise UnsupportedFormatVersionError(
            f"{what} is in wire version {version}, this driver reads version "
            f"{WIRE_VERSION}: the driver and the Python workers run different keyedstate "
            f"versions; install the same version on both")
    return version


def report_batch(report: SubtaskReport) -> pa.RecordBatch:
    """``report`` as the subtask's one result row (:data:`REPORT_SCHEMA`)."""
    return pa.RecordBatch.from_pylist([{"report": _encoder.encode(report)}],
                                      schema=REPORT_SCHEMA)


def decode_reports(rows: Iterable[Any]) -> list[SubtaskReport]:
    """The reports of a batch's result rows (Spark ``Row``s or dicts of
    :data:`REPORT_SCHEMA`), in the order given."""
    reports = []
    for row in rows:
        data = row["report"]
        version = _version_of(data, "a subtask's report")
        try:
            reports.append(_report_decoder.decode(data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CheckpointProtocolError(
                f"a subtask's report (wire version {version}) can't be read: {exc}") from exc
    return reports


def encode_ack(ack: SubtaskAck) -> bytes:
    """``ack`` as the bytes of its acknowledgement object."""
    return _encoder.encode(ack)


def decode_ack(data: bytes, where: str) -> SubtaskAck:
    """The acknowledgement stored at ``where`` (named in errors)."""
    return _decode_stored(_ack_decoder, data, f"the acknowledgement {where}")


def encode_flight(record: FlightRecord) -> bytes:
    """``record`` as the bytes of its object in storage."""
    return _encoder.encode(record)


def decode_flight(data: bytes, where: str) -> FlightRecord:
    """The record of a checkpoint in flight stored at ``where`` (named in errors)."""
    return _decode_stored(_flight_decoder, data, f"the record of a checkpoint in flight {where}")


def _decode_stored(decoder: msgspec.json.Decoder[T], data: bytes, what: str) -> T:
    """``data`` decoded as ``what`` (named in errors): a version this code can't read, or
    bytes that don't decode, raise :class:`CheckpointProtocolError`."""
    version = _version_of(data, what)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointProtocolError(
            f"{what} (wire version {version}) can't be read: {exc}") from exc


__all__ = ["KG_COLUMN", "REPORT_DDL", "REPORT_SCHEMA", "SUBTASK_COLUMN", "FlightRecord",
           "SubtaskAck", "SubtaskFigures", "SubtaskReport", "WIRE_VERSION", "decode_ack",
           "decode_flight", "decode_reports", "encode_ack", "encode_flight", "report_batch"]
