"""Restoring the heap backend (Flink's ``HeapRestoreOperation``), with rescaling.

Every handle overlapping this subtask's key groups is replayed, keeping only the key groups
this subtask owns: each key group from the newest file of the chain holding its image on,
applying the later files' diff sections of that key group (each file's footer indexes its
sections by state and key group and names its imaged key groups, so nothing else is decoded;
the handle records the images too, so files older than every needed image are not even read).
An image is the key group's whole content, timers included; a diff's timer section for a key
group replaces that key group's timers. Values are decoded with serializers rebuilt from the
file (the Arrow schema it records), so states nobody registered yet are restored too. Files of
format version 1 (a full file, then diffs) read as a full file imaging every key group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import msgspec
import pyarrow as pa

from keyedstate.backends.base.backend import state_meta_info
from keyedstate.backends.heap.images import KeyGroupRanges, latest_images, parse_images
from keyedstate.backends.heap.snapshot import (
    CHAIN_PROPERTY,
    IMAGES_PROPERTY,
    MAGIC,
    OP_APPEND,
    OP_MAP_DIFF,
    OP_PUT,
    OP_REMOVE,
    SUPPORTED_FORMAT_VERSIONS,
    TIMERS_KIND,
    TRAILER,
    FileStateInfo,
    HeapFileFooter,
)
from keyedstate.backends.heap.state_table import StateTable
from keyedstate.errors import (
    CorruptCheckpointError,
    KeyGroupRangeError,
    MaxParallelismMismatchError,
    SerializationError,
    StateTypeMismatchError,
    UnsupportedFormatVersionError,
)
from keyedstate.keygroups import KeyGroupRange
from keyedstate.serde import ArrowTypeSerializer, PickleSerializer, TypeSerializer
from keyedstate.state.descriptors import StateKind
from keyedstate.state.timers import TIMER_STATE_NAMES
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle, StreamHandle
from keyedstate.storage.transfer import RestorePhases, TransferStats

if TYPE_CHECKING:
    from keyedstate.backends.heap.keyed_backend import HeapKeyedStateBackend

_TIMER_DOMAINS = {name: domain for domain, name in TIMER_STATE_NAMES.items()}


class _Version(msgspec.Struct):
    format_version: int


def read_footer(data: bytes, source: str) -> HeapFileFooter:
    """The footer of a heap snapshot file; typed errors naming ``source`` otherwise."""
    tail = len(MAGIC) + TRAILER.size
    if len(data) < len(MAGIC) + tail or data[:len(MAGIC)] != MAGIC or data[-len(MAGIC):] != MAGIC:
        raise CorruptCheckpointError(
            f"{source} is not a heap state backend snapshot file (bad magic bytes); restore "
            f"from another checkpoint or savepoint"
        )
    (length,) = TRAILER.unpack_from(data, len(data) - tail)
    start = len(data) - tail - length
    if start < len(MAGIC):
        raise CorruptCheckpointError(f"{source} has an invalid footer length {length}")
    raw = memoryview(data)[start:len(data) - tail]
    try:
        version = msgspec.msgpack.decode(raw, type=_Version).format_version
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise UnsupportedFormatVersionError(
                f"{source} has heap format_version {version}, this keyedstate reads "
                f"{sorted(SUPPORTED_FORMAT_VERSIONS)}; upgrade keyedstate to restore it"
            )
        footer = msgspec.msgpack.decode(raw, type=HeapFileFooter)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptCheckpointError(f"{source} has an unreadable footer: {exc}") from exc
    if version >= 2 and footer.images is None:
        raise CorruptCheckpointError(f"{source} (format version {version}) names no imaged "
                                     f"key groups")
    for start, end in footer.imaged():
        if not footer.key_group_start <= start <= end <= footer.key_group_end:
            raise CorruptCheckpointError(
                f"{source} images key groups {start}-{end}, outside its range "
                f"{footer.key_group_start}-{footer.key_group_end}")
    return footer


def images_of(handle: KeyedStateHandle, files: int) -> list[KeyGroupRanges] | None:
    """The imaged key groups of each of the handle's ``files`` chain files as its properties
    record them; None when they don't (format version 1)."""
    text = handle.properties.get(IMAGES_PROPERTY)
    if text is None:
        return None
    try:
        images = parse_images(text)
    except ValueError:
        images = []
    if len(images) != files:
        raise CorruptCheckpointError(
            f"snapshot handle of subtask {handle.subtask_index} (checkpoint "
            f"{handle.checkpoint_id}) records the images of its chain as {text!r}, which does "
            f"not fit its {files} files; the _metadata file was altered. Restore from another "
            f"checkpoint or savepoint"
        )
    return images


def chain_of(handle: KeyedStateHandle) -> list[tuple[str, StreamHandle]]:
    """The handle's chain files, base first (the order recorded in its properties)."""
    names = handle.properties.get(CHAIN_PROPERTY)
    ordered = names.split(",") if names else sorted(handle.shared)
    missing = [n for n in ordered if n not in handle.shared]
    if missing or not ordered:
        raise CorruptCheckpointError(
            f"snapshot handle of subtask {handle.subtask_index} (checkpoint "
            f"{handle.checkpoint_id}) does not reference chain files {missing or ordered}; the "
            f"_metadata file was altered. Restore from another checkpoint or savepoint"
        )
    return [(n, handle.shared[n]) for n in ordered]


def _serializer(type_string: str | None, schema: bytes | None, source: str,
                state: str) -> TypeSerializer | None:
    if type_string is None:
        return None
    if type_string == PickleSerializer.type_string:
        return PickleSerializer()
    try:
        if schema is None:
            raise ValueError("no Arrow schema recorded")
        serializer = ArrowTypeSerializer(pa.ipc.read_schema(pa.py_buffer(schema)).field(0).type)
    except (ValueError, pa.ArrowException) as exc:
        raise CorruptCheckpointError(
            f"{source}: the type of state {state!r} ({type_string}) can't be rebuilt: {exc}"
        ) from exc
    if serializer.type_string != type_string:
        raise CorruptCheckpointError(
            f"{source}: state {state!r} declares type {type_string} but records the schema of "
            f"{serializer.type_string}"
        )
    return serializer


Decode = Callable[[Any], Any]


def _payload_decoder(table: StateTable) -> Decode:
    dec = table.value_serializer.deserialize
    uk = table.user_key_serializer
    dec_uk: Decode = uk.deserialize if uk is not None else (lambda u: u)
    ttl = table.ttl_ms is not None
    if table.kind is StateKind.LIST:
        if ttl:
            return lambda p: [(dec(v), ts) for v, ts in p]
        return lambda p: [dec(v) for v in p]
    if table.kind is StateKind.MAP:
        if ttl:
            return lambda p: {dec_uk(u): (dec(v), ts) for u, v, ts in p}
        return lambda p: {dec_uk(u): dec(v) for u, v in p}
    if ttl:
        return lambda p: (dec(p[0]), p[1])
    return dec


@dataclass
class RestoredBase:
    """A restored chain the next incremental snapshot may build on: in place when ``owned``
    (a shared restore of the job's own snapshot), duplicated by the store into the job's root
    otherwise (NO_CLAIM). ``storage`` holds its files."""

    checkpoint_id: int
    chain: list[tuple[str, StreamHandle]]
    images: list[KeyGroupRanges]
    storage: CheckpointStorage | None = None
    owned: bool = True


class HeapRestoreOperation:
    """Replays ``handles`` into ``backend``'s tables and timer service (numbered steps)."""

    def __init__(self, backend: HeapKeyedStateBackend, handles: Sequence[KeyedStateHandle],
                 storage: CheckpointStorage) -> None:
        self.backend = backend
        self.handles = sorted(handles, key=lambda h: h.key_group_start)
        self.storage = storage
        #: what the restore downloaded or took from the file cache
        self.stats = TransferStats()
        #: how long fetching the files and decoding them took
        self.phases = RestorePhases()

    def restore(self, share_restored_files: bool) -> RestoredBase | None:
        """Restore; returns the chain the next snapshot may extend, or None (full next). The
        files of every handle are fetched together, through one pool, before any is decoded
        (:meth:`~keyedstate.storage.checkpoint_storage.CheckpointStorage.read_all`): a
        rescaled restore of several handles pays the round trips of one batch, not one batch
        per handle; their bytes are in memory together until the replay ends."""
        # Step 1. No key group may come from two handles (the snapshot would be ambiguous).
        mine = self.backend.key_group_range
        covered = KeyGroupRange.empty()
        for handle in self.handles:
            part = handle.key_group_range.intersection(mine)
            if covered and part and part.start <= covered.end:
                raise KeyGroupRangeError(
                    f"snapshot handles overlap at {part}: two subtasks claim the same key "
                    f"groups; the _metadata file is inconsistent. Restore from another checkpoint"
                )
            covered = part or covered
        # Step 2. Fetch the files of every chain at once (each from the oldest of its key
        # groups' newest images on), then replay each chain for the key groups this subtask
        # owns, each key group from its newest image on.
        started = time.perf_counter()
        parts = [handle.key_group_range.intersection(mine) for handle in self.handles]
        chains = [self._files_to_read(handle, part)
                  for handle, part in zip(self.handles, parts)]
        flat = self.storage.read_all([file for chain in chains for _, file in chain],
                                     stats=self.stats)
        self.phases.download_s = time.perf_counter() - started
        restored = []
        for handle, part, chain in zip(self.handles, parts, chains):
            contents, flat = flat[:len(chain)], flat[len(chain):]
            restored.append(self._replay(handle, part, chain, contents))
        for queue in self.backend.timer_queues.values():
            queue.rebuild()
        self.phases.open_s = time.perf_counter() - started - self.phases.download_s
        # Step 3. Only an exact restore of one chain may be the next snapshot's base: in place
        # when shared, duplicated otherwise (id 0: any new snapshot of the job replaces it).
        if len(self.handles) == 1 and self.handles[0].key_group_range == mine:
            handle = self.handles[0]
            files, images = restored[0]
            return RestoredBase(handle.checkpoint_id if share_restored_files else 0,
                                files, images, self.storage, share_restored_files)
        return None

    def catch_up(self, handle: KeyedStateHandle, skip: int) -> None:
        """Apply the files of ``handle``'s chain after its first ``skip`` to tables holding
        the state of those ``skip`` files (a live copy's own chain, see
        ``HeapKeyedStateBackend.catch_up``): a key group imaged after them is cleared and
        rebuilt from its newest image on, the others take every later diff section."""
        key_groups = handle.key_group_range.intersection(self.backend.key_group_range)
        files = self._files_to_read(handle, key_groups, skip)
        started = time.perf_counter()
        contents = self.storage.read_all([file for _, file in files], stats=self.stats)
        self.phases.download_s = time.perf_counter() - started
        self._replay(handle, key_groups, files, contents, skip=skip)
        for queue in self.backend.timer_queues.values():
            queue.rebuild()
        self.phases.open_s = time.perf_counter() - started - self.phases.download_s

    @staticmethod
    def _files_to_read(handle: KeyedStateHandle, key_groups: KeyGroupRange, skip: int = 0
                       ) -> list[tuple[str, StreamHandle]]:
        """The files of ``handle``'s chain a replay of ``key_groups`` reads: from the oldest
        of the key groups' newest images on (all of them when the handle does not record
        images: format version 1); with ``skip``, those after the first ``skip``."""
        chain = chain_of(handle)
        recorded = images_of(handle, len(chain))
        first = skip
        if recorded is not None and key_groups and not skip:
            first = max(0, min(latest_images(recorded, key_groups)))
        return chain[first:]

    def _replay(self, handle: KeyedStateHandle, key_groups: KeyGroupRange,
                files: list[tuple[str, StreamHandle]], contents: Sequence[bytes],
                skip: int = 0) -> tuple[list[tuple[str, StreamHandle]], list[KeyGroupRanges]]:
        """Replay ``files`` of ``handle``'s chain (:meth:`_files_to_read`), whose bytes are
        ``contents``, for ``key_groups``; returns the files and their images. With ``skip``,
        on top of the state the first ``skip`` files hold (catch-up)."""
        chain = chain_of(handle)
        recorded = images_of(handle, len(chain))
        first = len(chain) - len(files)
        # Step 2b. Each file's footer, in chain order.
        footers = []
        for (_, file), data in zip(files, contents):
            source = self.storage.describe(file)
            footer = read_footer(data, source)
            if footer.max_parallelism != self.backend.max_parallelism:
                raise MaxParallelismMismatchError(
                    f"{source} was written with max parallelism {footer.max_parallelism}, the "
                    f"job runs with {self.backend.max_parallelism}; restore with the original "
                    f"max parallelism"
                )
            footers.append(footer)
        # Step 2c. Each key group's newest image, from the footers (checked against the
        # handle's record); every key group needs one.
        images = [footer.imaged() for footer in footers]
        names = [n for n, _ in files]
        if recorded is not None and images != recorded[first:]:
            raise CorruptCheckpointError(
                f"the chain files {names} of subtask {handle.subtask_index} (checkpoint "
                f"{handle.checkpoint_id}) image other key groups than its handle records; the "
                f"_metadata file or the files were altered. Restore from another checkpoint"
            )
        latest = latest_images(images, key_groups)
        if skip:
            # Catching up: a key group imaged since is rebuilt from that image; one that is
            # not (-1) keeps the live content and takes every later diff section.
            for kg, position in zip(key_groups, latest):
                if position >= 0:
                    self._clear_key_group(kg)
        elif key_groups and min(latest) < 0:
            missing = key_groups.start + latest.index(-1)
            raise CorruptCheckpointError(
                f"no file of the chain {names} of subtask {handle.subtask_index} (checkpoint "
                f"{handle.checkpoint_id}) holds an image of key group {missing}; restore from "
                f"another checkpoint or savepoint"
            )
        # Step 2d. Apply each file's sections of the key groups whose image it holds or
        # follows; an image is the first thing applied of its key group (the backend starts
        # empty), so it is the key group's whole content.
        for position, ((_, file), data, footer) in enumerate(zip(files, contents, footers)):
            self._apply_file(data, footer, self.storage.describe(file), key_groups,
                             [p <= position for p in latest])
        return files, images

    def _clear_key_group(self, key_group: int) -> None:
        """Drop a key group's entries from every table and its timers (before its image)."""
        for table in self.backend.tables.values():
            table.maps.pop(key_group, None)
        for queue in self.backend.timer_queues.values():
            queue.restore_key_group(key_group, ())

    def _apply_file(self, data: bytes, footer: HeapFileFooter, source: str,
                    key_groups: KeyGroupRange, applies: list[bool]) -> None:
        """Apply the sections of ``key_groups`` whose ``applies`` flag (per key group, from the
        range's start) is set."""
        tables = [None if i.meta.kind == TIMERS_KIND else self._table_for(i, source)
                  for i in footer.states]
        view = memoryview(data)
        decoders: dict[int, Decode] = {}
        first = key_groups.start
        for section in footer.sections:
            if section.key_group not in key_groups or not applies[section.key_group - first]:
                continue
            if not 0 <= section.state < len(footer.states) or \
                    section.offset + section.length > len(data) - len(MAGIC):
                raise CorruptCheckpointError(f"{source} has a section index out of bounds")
            info = footer.states[section.state]
            raw = view[section.offset:section.offset + section.length]
            try:
                entries = msgspec.msgpack.decode(raw)
                table = tables[section.state]
                if table is None:
                    self.backend.timer_queues[_TIMER_DOMAINS[info.meta.name]].restore_key_group(
                        section.key_group, [(ts, k, ns) for ts, k, ns in entries])
                    continue
                decode = decoders.get(section.state)
                if decode is None:
                    decode = decoders[section.state] = _payload_decoder(table)
                self._apply_entries(table, section.key_group, entries, decode)
            except (msgspec.DecodeError, SerializationError, ValueError, TypeError,
                    KeyError) as exc:
                raise CorruptCheckpointError(
                    f"{source}: state {info.meta.name!r}, key group {section.key_group} can't be "
                    f"decoded ({exc}); restore from another checkpoint or savepoint"
                ) from exc

    def _table_for(self, info: FileStateInfo, source: str) -> StateTable:
        meta = info.meta
        table = self.backend.tables.get(meta.name)
        if table is not None:
            old = table.meta
            if (old.kind, old.value_type, old.user_key_type, old.ttl_ms is None) != \
                    (meta.kind, meta.value_type, meta.user_key_type, meta.ttl_ms is None):
                raise StateTypeMismatchError(
                    f"{source}: state {meta.name!r} is {meta.kind} of {meta.value_type} here but "
                    f"{old.kind} of {old.value_type} in another file of the same snapshot"
                )
            return table
        value = _serializer(meta.value_type, info.value_schema, source, meta.name)
        assert value is not None
        user_key = _serializer(meta.user_key_type, info.user_key_schema, source, meta.name)
        # The schema recorded from the serializers (a file written before format version 3
        # of _metadata has none).
        meta = state_meta_info(meta.name, meta.kind, value, user_key, meta.ttl_ms)
        table = StateTable(meta, value, user_key)
        self.backend.tables[meta.name] = table
        return table

    @staticmethod
    def _apply_entries(table: StateTable, key_group: int, entries: list[Any],
                       decode: Decode) -> None:
        group = table.maps.get(key_group)
        if group is None:
            group = table.maps[key_group] = {}
        uk = table.user_key_serializer
        for op, key_bytes, ns, payload in entries:
            key = (key_bytes, ns)
            if op == OP_PUT:
                group[key] = decode(payload)
            elif op == OP_REMOVE:
                group.pop(key, None)
            elif op == OP_APPEND:
                existing = group.get(key)
                if existing is None:
                    group[key] = decode(payload)
                else:
                    existing.extend(decode(payload))
            elif op == OP_MAP_DIFF:
                puts, removed = payload
                existing = group.get(key)
                if existing is None:
                    existing = group[key] = {}
                existing.update(decode(puts))
                for user_key in removed:
                    existing.pop(user_key if uk is None else uk.deserialize(user_key), None)
                if not existing:
                    del group[key]
            else:
                raise ValueError(f"unknown op {op}")
        if not group:
            del table.maps[key_group]
