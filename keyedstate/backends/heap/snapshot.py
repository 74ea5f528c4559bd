"""Heap snapshots (FLIP-151): the journal, the file format and the snapshot strategy.

**Journal.** Each :class:`~keyedstate.backends.heap.state_table.StateTable` records *which* entries
changed in its open segment (marks, never values). ``snapshot(N)`` seals the open segment as
segment N. The changes since the confirmed base are the union of the segments after it plus
the open one; ``notify_checkpoint_complete(N)`` drops segments up to N and makes N's chain the
base; an aborted segment is folded into its successor, so its changes reach the next snapshot.

**Chain (rolling materialization).** Every file holds, per key group, either a diff (one op per
changed entry: PUT of the whole current value, REMOVE, APPEND of the list elements added since
the base, or MAP_DIFF of changed and removed map keys) or an *image* (the key group's whole
content, which replaces it). An incremental snapshot writes the diff of the changed entries
plus images of the key groups whose latest image is oldest, as many as its change is large, so
no checkpoint after the first writes the whole state at once and every key group is imaged
again within ``max_chain_length + 1`` checkpoints (:mod:`.images`). A chain lists the files
from the oldest of the key groups' latest images on; the earlier ones are referenced no more.

**File.** ``MAGIC | section* | footer | u32 footer length | MAGIC``. Each section is one
MessagePack array of entries ``[op, key, namespace, payload]`` for one state and key group (or
``[timestamp, key, namespace]`` timers); the footer (:class:`HeapFileFooter`) indexes the
sections and names the imaged key groups, so a restore decodes only the key groups it owns,
each from its latest image on.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Protocol

import msgspec
import pyarrow as pa

from keyedstate.backends.base.backend import SnapshotResult
from keyedstate.backends.heap.images import KeyGroupRanges, count, format_images
from keyedstate.backends.heap.state_table import REPLACED, EntryKey, KeyGroupMarks, Mark, StateTable
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
#: 2: rolling materialization (footers name their imaged key groups); 1: a full file, then
#: diffs (still read).
FORMAT_VERSION = 2
SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2})
TRAILER = struct.Struct("<I")
TIMERS_KIND = "timers"
OP_PUT, OP_REMOVE, OP_APPEND, OP_MAP_DIFF = 0, 1, 2, 3
FULL, DIFF = "full", "diff"
#: handle.properties key holding the chain's file names, base first, comma-separated.
CHAIN_PROPERTY = "heap.chain"
FORMAT_PROPERTY = "heap.format-version"
#: handle.properties key holding each chain file's imaged key groups (:func:`format_images`),
#: so a restore reads only the files its key groups need before opening any.
IMAGES_PROPERTY = "heap.images"


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
    kind: str  # FULL (every key group of the range imaged) or DIFF
    checkpoint_id: int
    max_parallelism: int
    key_group_start: int
    key_group_end: int
    states: list[FileStateInfo]
    sections: list[Section]
    #: version 2: the key groups whose sections in this file are images (each replaces the
    #: key group's content, timers included; an imaged key group without sections is empty).
    #: Version 1 has none: a FULL file images its whole range, a DIFF file nothing.
    images: KeyGroupRanges | None = None

    def imaged(self) -> KeyGroupRanges:
        """The key groups this file holds images of."""
        if self.images is not None:
            return self.images
        return [(self.key_group_start, self.key_group_end)] if self.kind == FULL else []


_encoder = msgspec.msgpack.Encoder()


def type_schema(serializer: TypeSerializer | None) -> bytes | None:
    if isinstance(serializer, ArrowTypeSerializer):
        return pa.schema([pa.field("v", serializer.arrow_type)]).serialize().to_pybytes()
    return None


def chain_file_name(checkpoint_id: int, kind: str) -> str:
    """Sortable, unique per chain (ids in a chain strictly increase)."""
    return f"{checkpoint_id:012d}-{kind}"


def kind_of(images: KeyGroupRanges, key_groups: KeyGroupRange) -> str:
    """FULL when ``images`` cover every key group of ``key_groups``, else DIFF."""
    return FULL if count(images) >= len(key_groups) else DIFF


def restored_chain_name(position: int, kind: str) -> str:
    """The name of link ``position`` of a chain duplicated from a snapshot the job does not own
    (NO_CLAIM): id 0 sorts before every id of the job, the position keeps the order."""
    return f"{0:012d}-{position:04d}-{kind}"


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
    serialized, because user functions may mutate them in place after the snapshot.
    ``images``: the imaged key groups' entries; ``diffs``: the ops of the other changed ones."""

    index: int
    table_kind: StateKind
    ttl: bool
    encode_value: Callable[[Any], Any]
    encode_user_key: Callable[[Any], Any]
    images: dict[int, dict[EntryKey, Any]] = field(default_factory=dict)
    diffs: dict[int, list[tuple[int, EntryKey, Any]]] = field(default_factory=dict)


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


def capture_state(table: StateTable, index: int, images: Collection[int] | None,
                  marks: KeyGroupMarks | None = None) -> StateCapture:
    """The state's part of one snapshot: the whole content of the key groups in ``images``
    (None: every key group, a full snapshot; copies of the per-key-group dicts at C speed) and
    ops for the entries ``marks`` lists in the other key groups (the cost follows the change,
    not the state size)."""
    freeze, encode = _freezer(table)
    uk = table.user_key_serializer
    cap = StateCapture(index, table.kind, table.ttl_ms is not None, encode,
                       uk.serialize if uk is not None else _identity)
    copy = _copy_stored(table.kind)
    maps = table.maps
    if images is None:
        groups = list(maps.items())
    else:
        groups = [(kg, maps[kg]) for kg in images if kg in maps]
    if copy is _identity and freeze is _identity:
        cap.images = {kg: group.copy() for kg, group in groups}
    elif table.kind is StateKind.MAP:
        cap.images = {kg: {k: dict(m) for k, m in group.items()} for kg, group in groups}
    elif table.kind is StateKind.LIST:
        cap.images = {kg: {k: list(v) for k, v in group.items()} for kg, group in groups}
    else:
        cap.images = {kg: {k: freeze(v) for k, v in group.items()} for kg, group in groups}
    imaged = () if images is None else images
    for kg, entries in (marks or {}).items():
        if images is None or kg in imaged:
            continue  # the image holds the key group's changes
        group = maps.get(kg, {})
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
                ops.append((OP_APPEND, key, stored[mark:]))
        cap.diffs[kg] = ops
    return cap


# -- encoding (asynchronous part) ----------------------------------------------------------------

def _payload_encoder(cap: StateCapture, ttl_ms: int | None,
                     now: int | None) -> Callable[[Any], Any]:
    """Stored value -> MessagePack-ready payload. With ``now`` (images under TTL), expired
    elements and map entries are dropped and a wholly expired value becomes None (left out);
    without it everything is encoded as is (diffs: an empty map put list stays [])."""
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


def encode_image(cap: StateCapture, kg: int, ttl_ms: int | None, now: int) -> bytes | None:
    """One key group's image section (PUT entries only; None when empty). Under TTL with
    ``ttl_ms`` (cleanup in full snapshot on), expired entries are left out, as in a full
    snapshot."""
    put = _payload_encoder(cap, ttl_ms, now)
    entries: list[list[Any]] = []
    for (key, ns), stored in sorted(cap.images[kg].items(), key=_first):
        payload = put(stored)
        if payload is not None:
            entries.append([OP_PUT, key, ns, payload])
    return _encoder.encode(entries) if entries else None


def encode_diff(cap: StateCapture, kg: int) -> bytes | None:
    """One key group's diff section (None when it has no ops)."""
    diff_put = _payload_encoder(cap, None, None)
    entries: list[list[Any]] = []
    for op, (key, ns), arg in sorted(cap.diffs[kg], key=_second):
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
    #: per domain and key group, the timers to write: every timer of an imaged key group (none
    #: written when it has none) and of a key group whose timers changed (written even empty)
    timers: dict[TimeDomain, dict[int, list[tuple[int, bytes, bytes]]]]
    #: the key groups this file images (the whole range for a full snapshot)
    images: KeyGroupRanges
    #: the base chain's files this snapshot still needs (from the oldest latest image on) and
    #: the key groups each images
    base_chain: list[tuple[str, StreamHandle]]
    base_images: list[KeyGroupRanges] = field(default_factory=list)
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
            ttl_ms = self.ttl_ms[cap.index]
            for kg in sorted({*cap.images, *cap.diffs}):
                data = encode_image(cap, kg, ttl_ms, self.now_ms) if kg in cap.images \
                    else encode_diff(cap, kg)
                if data is not None:
                    sections.append(Section(cap.index, kg, len(buf), len(data)))
                    buf += data
        for domain, by_kg in self.timers.items():
            index = len(infos)
            infos.append(FileStateInfo(StateMetaInfo(TIMER_STATE_NAMES[domain], TIMERS_KIND,
                                                     "timer")))
            for kg in sorted(by_kg):
                data = _encoder.encode(sorted(by_kg[kg]))
                sections.append(Section(index, kg, len(buf), len(data)))
                buf += data
        footer = _encoder.encode(HeapFileFooter(
            FORMAT_VERSION, self.kind, self.checkpoint_id, self.max_parallelism,
            self.key_group_range.start, self.key_group_range.end, infos, sections,
            self.images))
        buf += footer
        buf += TRAILER.pack(len(footer))
        buf += MAGIC
        return bytes(buf)

    def write(self, location: CheckpointStorageLocation
              ) -> tuple[KeyedStateHandle, list[tuple[str, StreamHandle]], list[KeyGroupRanges]]:
        """Encode and store the file; returns the handle, its chain and the chain's images."""
        data = self.encode()
        name = chain_file_name(self.checkpoint_id, self.kind)
        base = list(self.base_chain)
        written = len(data)
        if self.duplicate_from is not None and base:
            # Copies get names of their own: the restored chain's names come from another
            # job's checkpoint ids and could clash with this job's next ones.
            copies = location.duplicate_files(self.duplicate_from, base)
            base = [(restored_chain_name(i, kind_of(images, self.key_group_range)), h)
                    for i, (h, images) in enumerate(zip(copies, self.base_images))]
            written += sum(h.length for h in copies)
        (stored,) = location.put_files([StateFile(name, True, data=data, immutable=True)])
        chain = [*base, (name, stored)]
        images = [*self.base_images, self.images]
        properties = {CHAIN_PROPERTY: ",".join(n for n, _ in chain),
                      FORMAT_PROPERTY: str(FORMAT_VERSION),
                      IMAGES_PROPERTY: format_images(images),
                      **location.stats.to_properties()}
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
        return handle, chain, images


class HeapSnapshotResult(SnapshotResult):
    """The synchronous part's product. ``materialize`` writes one file and reports the chain
    (files and their images) to the backend (``on_written``) so the snapshot may become the
    next base once confirmed; ``discard`` reports it will never be one (``on_discarded``)."""

    def __init__(self, job: SnapshotJob, location: CheckpointStorageLocation,
                 sync_duration_s: float,
                 on_written: Callable[[int, list[tuple[str, StreamHandle]],
                                       list[KeyGroupRanges], CheckpointStorage], None],
                 on_discarded: Callable[[int], None]) -> None:
        super().__init__(job.checkpoint_id, sync_duration_s)
        self._job: SnapshotJob | None = job
        self._location = location
        self._on_written = on_written
        self._on_discarded = on_discarded
        self.kind = job.kind
        self.stats.extra["kind"] = job.kind
        self.stats.extra["chain_length"] = len(job.base_chain) + 1
        self.stats.extra["image_key_groups"] = count(job.images)

    def _materialize(self) -> KeyedStateHandle:
        if self._job is None:
            raise CheckpointAbortedError(
                f"snapshot {self.checkpoint_id} of the heap backend was already materialized or "
                f"discarded; call exactly one of materialize() or discard()"
            )
        job, self._job = self._job, None
        start = time.perf_counter()
        handle, chain, images = job.write(self._location)
        self.stats.extra["write_s"] = time.perf_counter() - start
        self.stats.extra.update(self._location.stats.as_dict())
        self._on_written(job.checkpoint_id, chain, images, self._location.storage)
        return handle

    def discard(self) -> None:
        if self._job is not None:
            self._job = None
            self._on_discarded(self.checkpoint_id)
