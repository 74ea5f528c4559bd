"""A latency-shaping fsspec filesystem: an object store's round trips on any filesystem.

``kslatency://<path>`` wraps any fsspec filesystem (``target_protocol``, ``target_options``:
a local directory or the local S3 server) and makes every request take what a
:class:`LatencyModel` says a real store takes: a first-byte latency per request plus, for the
bytes a request moves, ``bytes / bandwidth`` on that request's own stream (each transfer is
one stream: parallel transfers do not share a bandwidth). A request takes the model's time or
the inner filesystem's, whichever is longer: the wrapper sleeps the difference. The local S3
server answers in microseconds and a local disk in less; behind the wrapper a benchmark sees
the round trips a job pays on S3 (docs/object-storage.md, "A latency model for benchmarks")::

    model = parse_latency("s3-standard-same-region")        # or "first_byte_ms=30,mb_per_s=90"
    url, options = behind_latency("/data/ckpt", {}, model)   # or "s3://bucket/job", s3 options
    config = JobConfig(checkpoint_dir=url, storage_options=options, ...)

What it counts: every request by kind (:data:`KINDS`) and by the area of the snapshot root
its path lies in (:func:`~keyedstate.storage.layout.area_of`: ``shared``, ``metadata``,
``staging``, ``commits`` ...), with the bytes it moved, the seconds the model charged and the
wall seconds it took. Each process sums its own (:func:`process_counts`, thread-safe: uploads
run in threads); with ``log_dir`` every process also appends one JSON line per request to
``<log_dir>/requests-<pid>.jsonl`` (:func:`read_request_log`), which is how a benchmark counts
the requests of Spark's Python workers, and how a test sees their overlap: the requests on
the critical path (:func:`round_trips`) and the most in flight at once
(:func:`peak_in_flight`). Tests assert on counts and modeled seconds, which
are exact, never on wall time.

What is one request (as s3fs issues them, simplified): a ``pipe_file``, ``put_file``, or a
file opened for writing and closed is one PUT; ``cat_file``, ``get_file`` or a file opened
for reading is one GET (a streamed read pays the bandwidth as its bytes arrive); ``info``,
``exists``, ``size``, ``isfile``, ``isdir`` one HEAD; ``ls``, ``find``, ``glob`` one LIST per
1,000 entries found (at least one); ``copy`` one server-side copy (a first byte, no transfer:
no byte passes through the client); ``rm_file`` one DELETE; a recursive ``rm`` a LIST and one
DELETE per 1,000 objects (S3's ``DeleteObjects``). ``makedirs`` and ``mkdir`` reach the
inner filesystem unshaped and are counted apart (kind ``mkdir``, never in the totals):
keyedstate sends none to an object store (checkpoint storage skips them where the wrapped
filesystem is one), and over a local directory they are not requests S3 would see.

Test and benchmark machinery, not a production path: the protocol is registered through the
``fsspec.specs`` entry point in ``pyproject.toml`` (every process: drivers, Spark's Python
workers) and, for a process whose installed metadata predates that entry point, when this
module is imported.
"""

from __future__ import annotations

from keyedstate.testing.latency.counts import (
    KINDS,
    STORE_KINDS,
    Cell,
    RequestCounts,
    RequestRecord,
    counts_of,
    peak_in_flight,
    process_counts,
    read_request_log,
    round_trips,
)
from keyedstate.testing.latency.filesystem import PROTOCOL, LatencyFileSystem
from keyedstate.testing.latency.model import (
    DEFAULT_MODEL,
    MODELS,
    NONE,
    LatencyModel,
    behind_latency,
    model_of_options,
    parse_latency,
)

__all__ = ["Cell", "DEFAULT_MODEL", "KINDS", "LatencyFileSystem", "LatencyModel", "MODELS",
           "NONE", "PROTOCOL", "RequestCounts", "RequestRecord", "STORE_KINDS",
           "behind_latency", "counts_of", "model_of_options", "parse_latency",
           "peak_in_flight", "process_counts", "read_request_log", "round_trips"]
