"""Heap snapshots (FLIP-151): the journal, the file format and the snapshot strategy.

**Journal.** Each :class:`~keyedstate.backends.heap.states.StateTable` records *which* entries
changed in its open segment (marks, never values). ``snapshot(N)`` seals the open segment as
segment N. The changes since the confirmed base are the union of the segments after it plus
the open one; ``notify_checkpoint_complete(N)`` drops segments up to N and makes N's chain the
base; an aborted segment is folded into its successor, so its changes reach the next snapshot.

**Chain.** A full file, then up to ``max_chain_length`` diff files, each referenced in place by
every later handle of the chain. A diff holds, per changed entry, one op: PUT (the whole current
value), REMOVE, APPEND (list elements added since the base) or MAP_DIFF (changed and removed map
keys).

**File.** ``MAGIC | section* | footer | u32 footer length | MAGIC``. Each section is one
MessagePack array of entries ``[op, key, namespace, payload]`` for one state and key group (or
``[timestamp, key, namespace]`` timers); the footer (:class:`HeapFileFooter`) indexes the
sections, so a restore decodes only the key groups it owns.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import msgspec
import pyarrow as pa

from keyedstate.backends.base.backend import SnapshotResult
from keyedstate.backends.heap.states import REPLACED, EntryKey, KeyGroupMarks, Mark, StateTable
from keyedstate.errors import CheckpointAbortedError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.serde import ArrowTypeSerializer, TypeSerializer
from keyedstate.state.descriptors import StateKind
from keyedstate.state.timers import TIMER_STATE_NAMES, TimeDomain
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle, StateMetaInfo, StreamHandle
from keyedstate.storage.location import CheckpointStorageLocation, StateFile
from keyedstate.storage.transfer import RESTORE_PREFIX, TransferStats

# -- file format ---------------------------------------------------------------------------------

MAGIC = b"KSHEAP\x00\x01"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = frozenset({1})
TRAILER = struct.Struct("<I")
TIMERS_KIND = "timers"
OP_PUT, OP_REMOVE, OP_APPEND, OP_MAP_DIFF = 0, 1, 2, 3
FULL, DIFF = "full", "diff"
#: handle.properties key holding the chain's file names, base first, comma-separated.
CHAIN_PROPERTY = "heap.chain"
FORMAT_PROPERTY = "heap.format-version"


class FileStateInfo(msgspec.Struct, frozen=True):
    """A state as a file records it; the Arrow schema lets a restore decode typed values of a
    state whose descriptor is not registered yet."""

    meta: StateMetaInfo
    value_schema: bytes | None = None
    user_key_schema: bytes | None = None


class Section(msgspec.Struct, frozen=True, array_like=True):
    state: int  # index into HeapFileFooter.states
    key_group: int
    offset: int
    length: int


class HeapFileFooter(msgspec.Struct, frozen=True):
    format_version: int
    kind: str  # FULL or DIFF
    checkpoint_id: int
    max_parallelism: int
    key_group_start: int
    key_group_end: int
    states: list[FileStateInfo]
    sections: list[Section]


_encoder = msgspec.msgpack.Encoder()


def type_schema(serializer: TypeSerializer | None) -> bytes | None:
    if isinstance(serializer, ArrowTypeSerializer):
        return pa.schema([pa.field("v", serializer.arrow_type)]).serialize().to_pybytes()
    return None


def chain_file_name(checkpoint_id: int, kind: str) -> str:
    """Sortable, unique per chain (ids in a chain strictly increase)."""
    return f"{checkpoint_id:012d}-{kind}"


def restored_chain_name(position: int) -> str:
    """The name of link ``position`` of a chain duplicated from a snapshot the job does not own
    (NO_CLAIM): id 0 sorts before every id of the job, the position keeps the order."""
    return f"{0:012d}-{position:04d}-{FULL if position == 0 else DIFF}"


# -- journal -------------------------------------------------------------------------------------

def _copy_mark(mark: Mark) -> Mark:
    return set(mark) if type(mark) is set else mark


def _merge_mark(older: Mark, newer: Mark) -> Mark:
    if older == REPLACED or newer == REPLACED:
        return REPLACED
    if type(older) is int:
        return older  # appended since the older start
    return older | newer  # type: ignore[operator]


def merge_marks(into: KeyGroupMarks, newer: KeyGroupMarks, copy: bool) -> None:
    """Fold ``newer`` (later changes) into ``into`` (earlier ones), in place."""
    for kg, entries in newer.items():
        target = into.get(kg)
        if target is None:
            into[kg] = {k: _copy_mark(m) for k, m in entries.items()} if copy else entries
            continue
        for key, mark in entries.items():
            old = target.get(key)
            target[key] = (_copy_mark(mark) if copy else mark) if old is None \
                else _merge_mark(old, mark)


class Journaled(Protocol):
    """What the journal needs of a table: state tables and timer queues both qualify."""

    name: str
    marks: Any  # KeyGroupMarks | None


@dataclass
class Segment:
    checkpoint_id: int
    marks: dict[str, KeyGroupMarks]


class Journal:
    """Changes since the confirmed base: one sealed segment per snapshot still able to become a
    base, plus each table's open marks. Not tracking until a base can exist (saves memory)."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.tracking = False

    def start(self, tables: Iterable[Journaled]) -> None:
        self.tracking = True
        for table in tables:
            if table.marks is None:
                table.marks = {}

    def changes(self, tables: Iterable[Journaled]) -> dict[str, KeyGroupMarks]:
        """Union of all segments and the open marks, per state (read-only views when a state
        changed in one segment only)."""
        result: dict[str, KeyGroupMarks] = {}
        owned: set[str] = set()
        layers = [s.marks for s in self.segments]
        layers.append({t.name: t.marks for t in tables if t.marks})
        for layer in layers:
            for name, marks in layer.items():
                if name not in result:
                    result[name] = marks
                    continue
                if name not in owned:  # copy before the first merge: segments stay intact
                    fresh: KeyGroupMarks = {}
                    merge_marks(fresh, result[name], copy=True)
                    result[name] = fresh
                    owned.add(name)
                merge_marks(result[name], marks, copy=True)
        return result

    def seal(self, checkpoint_id: int, tables: Iterable[Journaled]) -> None:
        marks: dict[str, KeyGroupMarks] = {}
        for table in tables:
            if table.marks:
                marks[table.name] = table.marks
            table.marks = {}
        self.segments.append(Segment(checkpoint_id, marks))

    def fold(self, checkpoint_id: int, tables: Iterable[Journaled]) -> None:
        """Segment ``checkpoint_id`` will never be a base's: move its changes to the next one."""
        idx = next((i for i, s in enumerate(self.segments) if s.checkpoint_id == checkpoint_id),
                   None)
        if idx is None:
            return
        folded = self.segments.pop(idx)
        if idx < len(self.segments):
            successor = self.segments[idx]
            for name, marks in folded.marks.items():
                later = successor.marks.get(name)
                successor.marks[name] = marks
                if later:
                    merge_marks(marks, later, copy=False)
            return
        by_name = {t.name: t for t in tables}
        for name, marks in folded.marks.items():
            table = by_name[name]
            later, table.marks = table.marks, marks
            if later:
                merge_marks(marks, later, copy=False)

    def prune(self, potential_bases: Iterable[int]) -> None:
        """Drop segments no potential base (confirmed base, pending snapshots) comes before:
        a segment holds the changes *up to* its snapshot, needed only on top of an older base."""
        lowest = min(potential_bases, default=None)
        if lowest is None:
            self.segments.clear()
        else:
            self.segments = [s for s in self.segments if s.checkpoint_id > lowest]


# -- capture (synchronous part) ------------------------------------------------------------------

def _identity(v: Any) -> Any:
    return v


def _first(item: tuple[Any, ...]) -> Any:
    return item[0]


def _second(item: tuple[Any, ...]) -> Any:
    return item[1]


@dataclass
class StateCapture:
    """A frozen view of one state: containers copied; reducing and aggregating values already
    serialized, because user functions may mutate them in place after the snapshot."""

    index: int
    table_kind: StateKind
    ttl: bool
    encode_value: Callable[[Any], Any]
    encode_user_key: Callable[[Any], Any]
    groups: dict[int, Any] = field(default_factory=dict)  # full: {key: stored}; diff: [ops]


def _freezer(table: StateTable) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """(freeze now, encode later) for the table's stored values (TTL tuples included)."""
    if table.kind in (StateKind.REDUCING, StateKind.AGGREGATING):
        ser = table.value_serializer.serialize
        if table.ttl_ms is not None:
            return (lambda s: (ser(s[0]), s[1])), _identity
        return ser, _identity
    return _identity, table.value_serializer.serialize


def _copy_stored(kind: StateKind) -> Callable[[Any], Any]:
    if kind is StateKind.LIST:
        return list
    if kind is StateKind.MAP:
        return dict
    return _identity


def capture_full(table: StateTable, index: int) -> StateCapture:
    freeze, encode = _freezer(table)
    uk = table.user_key_serializer
    cap = StateCapture(index, table.kind, table.ttl_ms is not None, encode,
                       uk.serialize if uk is not None else _identity)
    copy = _copy_stored(table.kind)
    if copy is _identity and freeze is _identity:
        cap.groups = {kg: group.copy() for kg, group in table.maps.items()}
    elif table.kind is StateKind.MAP:
        cap.groups = {kg: {k: dict(m) for k, m in group.items()}
                      for kg, group in table.maps.items()}
    elif table.kind is StateKind.LIST:
        cap.groups = {kg: {k: list(v) for k, v in group.items()}
                      for kg, group in table.maps.items()}
    else:
        cap.groups = {kg: {k: freeze(v) for k, v in group.items()}
                      for kg, group in table.maps.items()}
    return cap


def capture_diff(table: StateTable, index: int, marks: KeyGroupMarks) -> StateCapture:
    """Ops for the changed entries only: the cost follows the change, not the state size."""
    freeze, encode = _freezer(table)
    uk = table.user_key_serializer
    cap = StateCapture(index, table.kind, table.ttl_ms is not None, encode,
                       uk.serialize if uk is not None else _identity)
    copy = _copy_stored(table.kind)
    for kg, entries in marks.items():
        group = table.maps.get(kg, {})
        ops: list[tuple[int, EntryKey, Any]] = []
        for key, mark in entries.items():
            stored = group.get(key)
            if stored is None:
                ops.append((OP_REMOVE, key, None))
            elif type(mark) is set:
                puts = {u: stored[u] for u in mark if u in stored}
                ops.append((OP_MAP_DIFF, key, (puts, [u for u in mark if u not in stored])))
            elif mark == REPLACED:
                ops.append((OP_PUT, key, freeze(copy(stored))))
            else:
                ops.append((OP_APPEND, key, stored[mark:]))  # type: ignore[misc]
        cap.groups[kg] = ops
    return cap


# -- encoding (asynchronous part) ----------------------------------------------------------------

def _payload_encoder(cap: StateCapture, ttl_ms: int | None,
                     now: int | None) -> Callable[[Any], Any]:
    """Stored value -> MessagePack-ready payload. With ``now`` (full snapshots under TTL),
    expired elements and map entries are dropped and a wholly expired value becomes None (left
    out); without it everything is encoded as is (diffs: an empty map put list stays [])."""
    enc, enc_uk = cap.encode_value, cap.encode_user_key
    if not cap.ttl:
        if cap.table_kind is StateKind.LIST:
            return lambda s: [enc(v) for v in s]
        if cap.table_kind is StateKind.MAP:
            return lambda s: [[enc_uk(u), enc(v)] for u, v in s.items()]
        return enc
    if now is None or ttl_ms is None:
        if cap.table_kind is StateKind.LIST:
            return lambda s: [[enc(v), ts] for v, ts in s]
        if cap.table_kind is StateKind.MAP:
            return lambda s: [[enc_uk(u), enc(v), ts] for u, (v, ts) in s.items()]
        return lambda s: [enc(s[0]), s[1]]
    horizon = now - ttl_ms  # live while last_access > now - ttl (state.ttl.is_expired)
    if cap.table_kind is StateKind.LIST:
        return lambda s: [[enc(v), ts] for v, ts in s if ts > horizon] or None
    if cap.table_kind is StateKind.MAP:
        return lambda s: [[enc_uk(u), enc(v), ts] for u, (v, ts) in s.items()
                          if ts > horizon] or None
    return lambda s: [enc(s[0]), s[1]] if s[1] > horizon else None


def encode_section(cap: StateCapture, kg: int, full: bool, ttl_ms: int | None,
                   now: int | None) -> bytes | None:
    put = _payload_encoder(cap, ttl_ms, now if full else None)
    entries: list[list[Any]] = []
    if full:
        for (key, ns), stored in sorted(cap.groups[kg].items(), key=_first):
            payload = put(stored)
            if payload is not None:
                entries.append([OP_PUT, key, ns, payload])
    else:
        diff_put = _payload_encoder(cap, None, None)
        for op, (key, ns), arg in sorted(cap.groups[kg], key=_second):
            if op == OP_MAP_DIFF:
                puts, removed = arg
                payload = [diff_put(puts), [cap.encode_user_key(u) for u in removed]]
            elif op == OP_REMOVE:
                payload = None
            else:
                payload = diff_put(arg)
            entries.append([op, key, ns, payload])
    return _encoder.encode(entries) if entries else None


@dataclass
class SnapshotJob:
    """Everything the asynchronous part needs, detached from the live tables."""

    checkpoint_id: int
    kind: str
    subtask_index: int
    key_group_range: KeyGroupRange
    max_parallelism: int
    now_ms: int
    infos: list[FileStateInfo]
    ttl_ms: list[int | None]
    captures: list[StateCapture]
    timers: dict[TimeDomain, dict[int, list[tuple[int, bytes, bytes]]]]
    base_chain: list[tuple[str, StreamHandle]]
    #: the store to duplicate ``base_chain`` from (a snapshot the job does not own, or another
    #: root); None: reference it in place
    duplicate_from: CheckpointStorage | None = None
    #: what the restore before this snapshot moved (reported once, in this handle)
    restore_stats: TransferStats | None = None

    def encode(self) -> bytes:
        buf = bytearray(MAGIC)
        sections: list[Section] = []
        infos = list(self.infos)
        for cap in self.captures:
            for kg in sorted(cap.groups):
                data = encode_section(cap, kg, self.kind == FULL, self.ttl_ms[cap.index],
                                      self.now_ms)
                if data is not None:
                    sections.append(Section(cap.index, kg, len(buf), len(data)))
                    buf += data
        for domain, by_kg in self.timers.items():
            # A diff writes a changed key group's timers whole, even when none are left.
            index = len(infos)
            infos.append(FileStateInfo(StateMetaInfo(TIMER_STATE_NAMES[domain], TIMERS_KIND,
                                                     "timer")))
            for kg in sorted(by_kg):
                data = _encoder.encode(sorted(by_kg[kg]))
                sections.append(Section(index, kg, len(buf), len(data)))
                buf += data
        footer = _encoder.encode(HeapFileFooter(
            FORMAT_VERSION, self.kind, self.checkpoint_id, self.max_parallelism,
            self.key_group_range.start, self.key_group_range.end, infos, sections))
        buf += footer
        buf += TRAILER.pack(len(footer))
        buf += MAGIC
        return bytes(buf)

    def write(self, location: CheckpointStorageLocation) -> tuple[KeyedStateHandle,
                                                                  list[tuple[str, StreamHandle]]]:
        data = self.encode()
        name = chain_file_name(self.checkpoint_id, self.kind)
        base = list(self.base_chain)
        written = len(data)
        if self.duplicate_from is not None and base:
            # Copies get names of their own: the restored chain's names come from another
            # job's checkpoint ids and could clash with this job's next ones.
            copies = location.duplicate_files(self.duplicate_from, base)
            base = [(restored_chain_name(i), h) for i, h in enumerate(copies)]
            written += sum(h.length for h in copies)
        (stored,) = location.put_files([StateFile(name, True, data=data, immutable=True)])
        chain = [*base, (name, stored)]
        properties = {CHAIN_PROPERTY: ",".join(n for n, _ in chain),
                      FORMAT_PROPERTY: str(FORMAT_VERSION), **location.stats.to_properties()}
        if self.restore_stats is not None:
            properties.update(self.restore_stats.to_properties(RESTORE_PREFIX))
        handle = KeyedStateHandle(
            backend="heap",
            subtask_index=self.subtask_index,
            key_group_start=self.key_group_range.start,
            key_group_end=self.key_group_range.end,
            checkpoint_id=self.checkpoint_id,
            states=[i.meta for i in self.infos],
            shared=dict(chain),
            private={},
            full_size=sum(h.length for _, h in chain),
            incremental_size=written,
            properties=properties,
        )
        return handle, chain


class HeapSnapshotResult(SnapshotResult):
    """The synchronous part's product. ``materialize`` writes one file and reports the chain to
    the backend (``on_written``) so the snapshot may become the next base once confirmed;
    ``discard`` reports it will never be one (``on_discarded``)."""

    def __init__(self, job: SnapshotJob, location: CheckpointStorageLocation,
                 sync_duration_s: float,
                 on_written: Callable[[int, list[tuple[str, StreamHandle]],
                                       CheckpointStorage], None],
                 on_discarded: Callable[[int], None]) -> None:
        super().__init__(job.checkpoint_id, sync_duration_s)
        self._job: SnapshotJob | None = job
        self._location = location
        self._on_written = on_written
        self._on_discarded = on_discarded
        self.kind = job.kind
        self.stats.extra["kind"] = job.kind
        self.stats.extra["chain_length"] = len(job.base_chain) + 1

    def _materialize(self) -> KeyedStateHandle:
        if self._job is None:
            raise CheckpointAbortedError(
                f"snapshot {self.checkpoint_id} of the heap backend was already materialized or "
                f"discarded; call exactly one of materialize() or discard()"
            )
        job, self._job = self._job, None
        start = time.perf_counter()
        handle, chain = job.write(self._location)
        self.stats.extra["write_s"] = time.perf_counter() - start
        self.stats.extra.update(self._location.stats.as_dict())
        self._on_written(job.checkpoint_id, chain, self._location.storage)
        return handle

    def discard(self) -> None:
        if self._job is not None:
            self._job = None
            self._on_discarded(self.checkpoint_id)
