"""The wire between a Python worker and the driver (keyedstate.runtime.wire): one model, one
schema, one decoder that refuses a report of another version or one it can't read."""

from __future__ import annotations

import msgspec
import pytest

from keyedstate.errors import CheckpointProtocolError, UnsupportedFormatVersionError
from keyedstate.runtime.wire import (
    REPORT_DDL,
    REPORT_SCHEMA,
    WIRE_VERSION,
    FlightRecord,
    SubtaskAck,
    SubtaskFigures,
    SubtaskReport,
    decode_ack,
    decode_flight,
    decode_reports,
    encode_ack,
    encode_flight,
    report_batch,
)
from keyedstate.storage.handles import KeyedStateHandle


def _report(subtask: int = 1) -> SubtaskReport:
    handle = KeyedStateHandle(backend="heap", subtask_index=subtask, key_group_start=0,
                              key_group_end=63, checkpoint_id=4, states=[], shared={},
                              private={}, full_size=10, incremental_size=3)
    figures = SubtaskFigures(
        rows_in=5, function_rows=2, rows_out=1, timers_fired=0, process_s=0.25,
        restore_s=0.0, reused_local_state=True, restored=False, caught_up=False,
        background_catch_up_s=0.125, sync_s=0.001, async_s=0.002, incremental_bytes=3,
        full_bytes=10, worker_pid=42)
    return SubtaskReport(version=WIRE_VERSION, subtask=subtask, token="t", handle=handle,
                         staged={"main": "staging/4/main/part.parquet"}, max_event_time=None,
                         late=2, figures=figures)


def test_a_report_round_trips_through_its_arrow_row() -> None:
    batch = report_batch(_report())
    assert batch.schema == REPORT_SCHEMA and REPORT_DDL == "report binary"
    # Spark hands binary columns to the driver as bytearray.
    rows = [{"report": bytearray(r["report"])} for r in batch.to_pylist()]
    assert decode_reports(rows) == [_report()]


def test_another_version_is_refused_naming_both() -> None:
    other = msgspec.structs.replace(_report(), version=WIRE_VERSION + 1)
    with pytest.raises(UnsupportedFormatVersionError, match="same version on both"):
        decode_reports(report_batch(other).to_pylist())


@pytest.mark.parametrize("data", [b"not json",
                                  b'{"version": %d, "subtask": 0}' % WIRE_VERSION])
def test_an_unreadable_report_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(CheckpointProtocolError):
        decode_reports([{"report": data}])


def test_a_report_of_the_asynchronous_mode_has_no_handle() -> None:
    report = msgspec.structs.replace(_report(), handle=None)
    assert decode_reports(report_batch(report).to_pylist()) == [report]


def test_an_acknowledgement_round_trips_and_refuses_another_version() -> None:
    handle = _report().handle
    ack = SubtaskAck(version=WIRE_VERSION, checkpoint_id=4, subtask=1, token="t",
                     handle=handle, async_s=0.5)
    assert decode_ack(encode_ack(ack), "chk-4/_acks/subtask-1") == ack
    failed = SubtaskAck(version=WIRE_VERSION, checkpoint_id=4, subtask=1, token="t",
                        handle=None, async_s=0.1, error="PermissionError: denied")
    assert decode_ack(encode_ack(failed), "x") == failed
    other = msgspec.structs.replace(ack, version=WIRE_VERSION + 1)
    with pytest.raises(UnsupportedFormatVersionError, match="chk-4/_acks/subtask-1"):
        decode_ack(encode_ack(other), "chk-4/_acks/subtask-1")
    with pytest.raises(CheckpointProtocolError, match="can't be read"):
        decode_ack(b"{}", "chk-4/_acks/subtask-1")


def test_a_record_of_a_checkpoint_in_flight_round_trips_and_refuses_another_version() -> None:
    report = msgspec.structs.replace(_report(), handle=None)
    record = FlightRecord(version=WIRE_VERSION, start_id="s", checkpoint_id=4,
                          timestamp_ms=1_700_000_000_000, properties={"batch_id": "3"},
                          batch_id=3, drain=False, watermark=-5, reports=[report],
                          started_s=1_700_000_000.5, tasks=2)
    where = "chk-4/_acks/flight"
    assert decode_flight(encode_flight(record), where) == record
    other = msgspec.structs.replace(record, version=WIRE_VERSION + 1)
    with pytest.raises(UnsupportedFormatVersionError, match=where):
        decode_flight(encode_flight(other), where)
    with pytest.raises(CheckpointProtocolError, match="can't be read"):
        decode_flight(b'{"version": %d}' % WIRE_VERSION, where)
