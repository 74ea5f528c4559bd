"""State migration on restore: a restored state read through a descriptor of another type
(state schema evolution; the rules are :mod:`keyedstate.state.evolution`, the reference is
docs/schema-evolution.md).

A restored state meets its descriptor in :meth:`KeyedStateBackend.get_state`. Kind and map-key
type never change; the value type may, by the rules, and TTL may be switched on or off.
:func:`plan_migration` resolves it once per state and subtask and gives a
:class:`StateMigration` (None when nothing changed). How a backend applies a type change
(docs/schema-evolution.md, "Eager or lazy"):

- **eager** (the heap backend, and the RocksDB backend with ``state_migration="eager"``):
  every value is migrated when the state is first asked for, as Flink's backends do;
- **lazy** (the RocksDB backend's default): values stay as they are on disk, in the type they
  were written with; :class:`EvolvedSerializer` reads any of the state's recorded types and
  presents the newest, and writes the newest, tagged with its generation. The history of types
  is part of the serializer, so a snapshot taken after a migration restores with the new code
  alone, and a later evolution adds one generation.

:func:`check_restored_states` is the same resolution run by a job's start-up against the
snapshot's ``_metadata`` (before anything is written), so an incompatible change fails the
start, not the first batch.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgspec
import pyarrow as pa

from keyedstate.errors import ConfigurationError, SerializationError, StateTypeMismatchError
from keyedstate.serde import (
    ArrowTypeSerializer,
    PickleSerializer,
    TypeSerializer,
    converters,
    type_from_string,
)
from keyedstate.state.descriptors import StateDescriptor
from keyedstate.state.evolution import WAY_OUT, Resolution, SchemaEvolution
from keyedstate.storage.handles import CheckpointMetadata, StateMetaInfo

logger = logging.getLogger(__name__)
_msgpack_decode = msgspec.msgpack.decode

#: First byte of a value written by an :class:`EvolvedSerializer`, followed by its generation
#: byte. MessagePack never starts an object with 0xC1 ("never used" in its spec) and a pickle
#: starts with 0x80, so untagged bytes are the first generation's.
GENERATION_TAG = 0xC1
#: Generations one lazily migrated state can have (one byte).
MAX_GENERATIONS = 256

_SCHEMA_VALUE = "value"
_SCHEMA_MAP_KEY = "map_key"


# --------------------------------------------------------------------------------------------
# the recorded schema (_metadata format version 3)
# --------------------------------------------------------------------------------------------


def value_schema_text(value: TypeSerializer, user_key: TypeSerializer | None) -> str | None:
    """What ``_metadata`` records as a state's schema: base64 of the Arrow IPC schema message
    of a schema with the field ``value`` (and ``map_key`` for a map state). Arrow's IPC format
    is versioned by Arrow itself and read by every Arrow implementation (``pyarrow.ipc.
    read_schema``); None for an untyped (pickled) state."""
    if not isinstance(value, ArrowTypeSerializer):
        return None
    fields = [pa.field(_SCHEMA_VALUE, value.arrow_type)]
    if isinstance(user_key, ArrowTypeSerializer):
        fields.append(pa.field(_SCHEMA_MAP_KEY, user_key.arrow_type))
    return base64.b64encode(pa.schema(fields).serialize().to_pybytes()).decode("ascii")


def recorded_value_type(meta: StateMetaInfo) -> pa.DataType | None:
    """The Arrow value type ``meta`` records: from its schema (format version 3), else parsed
    from its type string (older snapshots); None when untyped or unreadable (a type string
    that does not round-trip, docs/schema-evolution.md)."""
    if meta.value_schema is not None:
        schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(meta.value_schema)))
        return schema.field(_SCHEMA_VALUE).type
    if meta.value_type == PickleSerializer.type_string:
        return None
    try:
        return type_from_string(meta.value_type)
    except SerializationError:
        return None


# --------------------------------------------------------------------------------------------
# resolution
# --------------------------------------------------------------------------------------------


def _mismatch(name: str, reason: str) -> StateTypeMismatchError:
    return StateTypeMismatchError(
        f"state {name!r} can't be restored with its new descriptor: {reason}. To change it, "
        f"{WAY_OUT}")


def resolve_restored(descriptor: StateDescriptor, restored: StateMetaInfo,
                     old_type: pa.DataType | None) -> Resolution | None:
    """How ``descriptor`` reads the state ``restored`` describes, whose values have the Arrow
    type ``old_type`` (None: untyped or not known). None when the value types are equal (as
    is); else a compatible :class:`Resolution`. Raises :class:`StateTypeMismatchError` for a
    changed kind or map-key type, an untyped state on either side of a change, or an
    incompatible value type; :class:`ConfigurationError` for an evolution naming fields the
    new type lacks. TTL switched on or off is no type change (:attr:`StateMigration.ttl`)."""
    name = descriptor.name
    kind = str(descriptor.kind)
    if kind != restored.kind:
        raise _mismatch(name, f"its kind was {restored.kind}, is now {kind}")
    user_key = descriptor.user_key_serializer
    user_key_type = None if user_key is None else user_key.type_string
    if user_key_type != restored.user_key_type:
        raise _mismatch(name, f"its map key type was {restored.user_key_type}, is now "
                              f"{user_key_type}: a map's key type never changes")
    new = descriptor.value_serializer
    if new.type_string == restored.value_type:
        return None
    if not isinstance(new, ArrowTypeSerializer) or old_type is None:
        raise _mismatch(name, f"its value type was {restored.value_type}, is now "
                              f"{new.type_string}; an untyped (pickled) state never changes type")
    resolution = descriptor.evolution.resolve(name, old_type, new.arrow_type)
    resolution.raise_if_incompatible()
    return resolution


#: :attr:`StateMigration.ttl`: TTL switched on (values stamped with the restore time) or off
#: (timestamps dropped, entries already expired dropped with them).
TTL_ON = "on"
TTL_OFF = "off"


@dataclass(frozen=True)
class StateMigration:
    """A restored state's values, read with ``old`` (the serializer that wrote them), presented
    in the descriptor's type by ``resolution`` (None: the type is unchanged), and ``ttl``
    switched on or off (None: unchanged; ``old_ttl_ms`` is the restored TTL)."""

    old: TypeSerializer
    new: TypeSerializer
    resolution: Resolution | None
    evolution: SchemaEvolution
    ttl: str | None = None
    old_ttl_ms: int | None = None

    def migrate(self, value: Any) -> Any:
        """The new type's value of one old value (as ``old`` decodes it)."""
        return value if self.resolution is None else self.resolution.migrate(value)

    def expired(self, timestamp_ms: int, now_ms: int) -> bool:
        """Whether an entry stamped ``timestamp_ms`` had expired under the restored TTL."""
        return self.old_ttl_ms is not None and timestamp_ms + self.old_ttl_ms <= now_ms

    def evolved_serializer(self) -> EvolvedSerializer:
        """The lazy path's serializer: reads every generation ``old`` reads, and the new type."""
        return EvolvedSerializer.extend(self.old, self.new, self.evolution)


def plan_migration(descriptor: StateDescriptor, restored: StateMetaInfo,
                   old: TypeSerializer) -> StateMigration | None:
    """:func:`resolve_restored` for a backend, which knows the serializer ``old`` that wrote
    the restored values (its exact type: no type string is parsed), and TTL switched on or off.
    None: nothing to do."""
    old_type = old.arrow_type if isinstance(old, (ArrowTypeSerializer, EvolvedSerializer)) \
        else None
    resolution = resolve_restored(descriptor, restored, old_type)
    ttl = None
    if (descriptor.ttl is None) != (restored.ttl_ms is None):
        ttl = TTL_OFF if descriptor.ttl is None else TTL_ON
    if resolution is None and ttl is None:
        return None
    return StateMigration(old, descriptor.value_serializer, resolution, descriptor.evolution,
                          ttl, restored.ttl_ms)


# --------------------------------------------------------------------------------------------
# lazy migration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    """One evolution of a lazily migrated state: generation ``i`` to ``i + 1``, resolved by
    the descriptor's evolution of that time (its entries for this step)."""

    old: pa.DataType
    new: pa.DataType
    evolution: SchemaEvolution


class EvolvedSerializer(TypeSerializer):
    """The serializer of a lazily migrated state: its values on disk have any of the state's
    types (generations), the newest is what it reads and writes.

    Generation 0 is the type the state had before its first lazy migration; its bytes are
    untagged (they were written before). Every later generation's bytes start with
    :data:`GENERATION_TAG` and the generation. :meth:`deserialize` decodes a value with its
    generation's serializer and migrates it through every later step; :meth:`serialize`
    writes the newest generation. Pickles as its types and steps (the migrations are rebuilt).
    """

    def __init__(self, generations: Sequence[ArrowTypeSerializer], steps: Sequence[_Step]
                 ) -> None:
        if len(generations) != len(steps) + 1 or len(generations) > MAX_GENERATIONS:
            raise ConfigurationError(
                f"a lazily migrated state has {len(generations)} types; at most "
                f"{MAX_GENERATIONS} (take a canonical savepoint and restore from it to rewrite "
                f"every value in the newest type)")
        self.generations = tuple(generations)
        self.steps = tuple(steps)
        self.newest = self.generations[-1]
        self.arrow_type = self.newest.arrow_type
        self.type_string = self.newest.type_string
        self._tag = bytes([GENERATION_TAG, len(self.steps)])
        resolutions = [s.evolution.resolve(self.type_string, s.old, s.new)
                       for s in self.steps]
        # _chains[g]: generation g's value in the newest type, None for the newest itself.
        self._chains: list[Any] = []
        for g in range(len(self.generations)):
            todo = resolutions[g:]
            self._chains.append(_chain(todo) if todo else None)
        # The two paths every read takes, inlined (one Python call per value, as a plain
        # ArrowTypeSerializer): the newest generation, and the oldest when its one step only
        # rearranges a struct (migrated on the decoded MessagePack list, decoded once).
        self._last = len(self.steps)
        self._newest_decode = converters(self.arrow_type)[1]
        self._oldest_plain: Any = None
        if len(resolutions) == 1 and resolutions[0].plain_migration is not None:
            self._oldest_plain = resolutions[0].plain_migration

    @classmethod
    def extend(cls, old: TypeSerializer, new: TypeSerializer, evolution: SchemaEvolution
               ) -> EvolvedSerializer:
        """``old`` (a plain serializer: generation 0; or an evolved one) plus one step to
        ``new`` by ``evolution``."""
        assert isinstance(new, ArrowTypeSerializer)
        if isinstance(old, EvolvedSerializer):
            generations, steps = list(old.generations), list(old.steps)
        elif isinstance(old, ArrowTypeSerializer):
            generations, steps = [old], []
        else:
            raise TypeError(f"{old!r} can't be migrated")
        return cls([*generations, new],
                   [*steps, _Step(generations[-1].arrow_type, new.arrow_type, evolution)])

    def serialize(self, value: Any) -> bytes:
        return self._tag + self.newest.serialize(value)

    def deserialize(self, data: bytes) -> Any:
        try:
            if data[0] != GENERATION_TAG:
                if self._oldest_plain is not None:
                    return self._newest_decode(self._oldest_plain(_msgpack_decode(data)))
                return self._chains[0](self.generations[0].deserialize(data))
            generation = data[1]
            if generation == self._last:
                return self._newest_decode(_msgpack_decode(data[2:]))
        except (msgspec.DecodeError, TypeError, ValueError, ArithmeticError, IndexError) as exc:
            raise SerializationError(
                f"stored bytes are not a {self.type_string} of any of the state's "
                f"{len(self.generations)} types: {exc}") from exc
        if generation >= len(self.generations):
            raise SerializationError(
                f"stored value of generation {generation}, the state has "
                f"{len(self.generations)} (bytes of another state or a newer keyedstate)")
        return self._chains[generation](self.generations[generation].deserialize(data[2:]))

    def to_plain(self, value: Any) -> Any:
        return self.newest.to_plain(value)

    def copy(self, value: Any) -> Any:
        return self.newest.copy(value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (EvolvedSerializer, (self.generations, self.steps))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EvolvedSerializer) and other.generations == self.generations \
            and other.steps == self.steps

    def __hash__(self) -> int:
        return hash(self.type_string)

    def __repr__(self) -> str:
        return f"EvolvedSerializer({[g.type_string for g in self.generations]})"


def _chain(resolutions: Sequence[Resolution]) -> Any:
    if len(resolutions) == 1:
        return resolutions[0].migrate
    fns = [r.migrate for r in resolutions]

    def migrate(value: Any) -> Any:
        for fn in fns:
            value = fn(value)
        return value
    return migrate


# --------------------------------------------------------------------------------------------
# job start-up
# --------------------------------------------------------------------------------------------


def check_restored_states(metadata: CheckpointMetadata, descriptors: Iterable[StateDescriptor],
                          drop_states: Sequence[str], where: str) -> list[str]:
    """Check at job start that ``descriptors`` can read the states ``metadata`` records and
    that ``drop_states`` may be dropped; returns the names of the snapshot's states no
    descriptor asks for and that are kept (for the start-up's log). Raises the errors of
    :func:`resolve_restored` (naming ``where``) and :class:`ConfigurationError` for a state
    both declared and listed to drop. Nothing is written."""
    recorded: dict[str, list[StateMetaInfo]] = {}
    for handle in metadata.handles:
        for meta in handle.states:
            known = recorded.setdefault(meta.name, [])
            if meta not in known:
                known.append(meta)
    declared = {d.name: d for d in descriptors}
    both = sorted(set(declared) & set(drop_states))
    if both:
        raise ConfigurationError(
            f"states {both} are both declared by the function and listed in drop_states; "
            f"drop a state only once no descriptor asks for it")
    for name, descriptor in declared.items():
        for meta in recorded.get(name, ()):
            old_type = recorded_value_type(meta)
            if old_type is None and meta.value_type not in (
                    PickleSerializer.type_string, descriptor.value_serializer.type_string):
                # A type string from before format version 3 that does not parse back: the
                # backend, which has the exact type, decides at restore.
                logger.warning("%s: state %r's recorded type %s can't be checked at start",
                               where, name, meta.value_type)
                continue
            try:
                resolve_restored(descriptor, meta, old_type)
            except StateTypeMismatchError as exc:
                raise StateTypeMismatchError(f"{where}: {exc}") from exc
    return sorted(n for n in recorded if n not in declared and n not in drop_states)
