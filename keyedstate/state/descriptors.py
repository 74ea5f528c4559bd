"""State descriptors: a state's name, kind, declared types and TTL (Flink's ``StateDescriptor``).

A descriptor is what user code hands to ``get_state``; it is also what a snapshot records
(:class:`~keyedstate.storage.handles.StateMetaInfo`) so that a restore can check the job
still asks for the same thing. Descriptors pickle (the reduce / aggregate functions with
cloudpickle, as Spark ships them).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Generic, Protocol, TypeVar

from keyedstate.errors import ConfigurationError
from keyedstate.serde import TypeLike, TypeSerializer, serializer_for
from keyedstate.state.api import (
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    State,
    ValueState,
)
from keyedstate.state.evolution import SchemaEvolution

IN = TypeVar("IN")
ACC = TypeVar("ACC")
OUT = TypeVar("OUT")
IN_contra = TypeVar("IN_contra", contravariant=True)
OUT_co = TypeVar("OUT_co", covariant=True)
#: The state class a descriptor gives: ``get_state(ValueStateDescriptor(...))`` is typed
#: ``ValueState``, so user code type-checks and completes without casts.
S = TypeVar("S", bound=State)


class StateKind(StrEnum):
    VALUE = "value"
    LIST = "list"
    MAP = "map"
    REDUCING = "reducing"
    AGGREGATING = "aggregating"


class TtlUpdateType(StrEnum):
    """When a value's last-access timestamp is refreshed (Flink's ``StateTtlConfig.UpdateType``)."""

    ON_CREATE_AND_WRITE = "OnCreateAndWrite"
    ON_READ_AND_WRITE = "OnReadAndWrite"


@dataclass(frozen=True, slots=True)
class StateTtlConfig:
    """Time-to-live of a state's entries, with Flink's semantics.

    An entry expires ``ttl`` after its last-access timestamp, which is set on create and write
    (and also on read with ``ON_READ_AND_WRITE``). Expired entries are never returned
    (``NeverReturnExpired``), left out of full snapshots, and cleaned incrementally: every state
    access also checks up to ``incremental_cleanup_size`` other entries of the same state and
    drops expired ones. The RocksDB backend has no compaction filter (rocksdict exposes none), so
    compaction keeps them (docs/rocksdb-backend.md, *TTL*). The clock is processing time (the
    wall clock of the process accessing the state, unless the backend is given another
    ``time_provider``), as Flink's.
    """

    ttl: _dt.timedelta
    update_type: TtlUpdateType = TtlUpdateType.ON_CREATE_AND_WRITE
    incremental_cleanup_size: int = 5
    cleanup_in_full_snapshot: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.ttl, _dt.timedelta) or self.ttl <= _dt.timedelta(0):
            raise ConfigurationError(f"TTL must be a positive timedelta, got {self.ttl!r}")
        if self.incremental_cleanup_size < 0:
            raise ConfigurationError("incremental_cleanup_size must be >= 0")

    @property
    def ttl_ms(self) -> int:
        """The time to live in milliseconds."""
        return int(self.ttl / _dt.timedelta(milliseconds=1))


class AggregateFunction(Protocol[IN_contra, ACC, OUT_co]):
    """Flink's ``AggregateFunction``: the accumulator must be a value of the declared type."""

    def create_accumulator(self) -> ACC: ...

    def add(self, value: IN_contra, accumulator: ACC) -> ACC: ...

    def get_result(self, accumulator: ACC) -> OUT_co: ...


class StateDescriptor(Generic[S]):
    """Base of all descriptors. ``name`` is unique within a job; ``type`` is a Spark DDL string
    or pyarrow type (typed, schema-checked, canonical-savepoint friendly) or None (pickled).
    ``S`` is the state class ``get_state`` returns for it. ``evolution`` gives the defaults and
    renames that restoring a state recorded with an older type needs (docs/schema-evolution.md);
    without it, added nullable fields read as null and renames are refused."""

    kind: StateKind

    def __init__(self, name: str, type: TypeLike | None = None,
                 ttl: StateTtlConfig | None = None,
                 evolution: SchemaEvolution | None = None) -> None:
        if not isinstance(name, str) or not name or name.startswith("_"):
            raise ConfigurationError(
                f"state name {name!r} is invalid: use a non-empty name not starting with '_' "
                f"(reserved for keyedstate's internal states)"
            )
        self.name = name
        self.type = type
        self.ttl = ttl
        self.evolution = evolution or SchemaEvolution()
        self.value_serializer: TypeSerializer = serializer_for(type)

    @property
    def user_key_serializer(self) -> TypeSerializer | None:
        """The serializer of map keys (map state only; None for other kinds)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.value_serializer.type_string})"


class ValueStateDescriptor(StateDescriptor[ValueState[Any]]):
    """A single value per key and namespace; ``default`` is returned when none is set."""

    kind = StateKind.VALUE

    def __init__(self, name: str, type: TypeLike | None = None, default: Any = None,
                 ttl: StateTtlConfig | None = None,
                 evolution: SchemaEvolution | None = None) -> None:
        super().__init__(name, type, ttl, evolution)
        self.default = default


class ListStateDescriptor(StateDescriptor[ListState[Any]]):
    """A list per key and namespace; ``type`` is the element type."""

    kind = StateKind.LIST


class MapStateDescriptor(StateDescriptor[MapState[Any, Any]]):
    """A map per key and namespace; TTL applies per map entry (as Flink)."""

    kind = StateKind.MAP

    def __init__(self, name: str, key_type: TypeLike | None = None,
                 value_type: TypeLike | None = None, ttl: StateTtlConfig | None = None,
                 evolution: SchemaEvolution | None = None) -> None:
        super().__init__(name, value_type, ttl, evolution)
        self.key_type = key_type
        self._user_key_serializer = serializer_for(key_type)

    @property
    def user_key_serializer(self) -> TypeSerializer:
        """The serializer of this map's keys (from its key type)."""
        return self._user_key_serializer


class ReducingStateDescriptor(StateDescriptor[ReducingState[Any]], Generic[IN]):
    """Keeps ``reduce_function(acc, value)`` of everything added."""

    kind = StateKind.REDUCING

    def __init__(self, name: str, reduce_function: Callable[[IN, IN], IN],
                 type: TypeLike | None = None, ttl: StateTtlConfig | None = None,
                 evolution: SchemaEvolution | None = None) -> None:
        super().__init__(name, type, ttl, evolution)
        if not callable(reduce_function):
            raise ConfigurationError(f"reduce_function of state {name!r} must be callable")
        self.reduce_function = reduce_function


class AggregatingStateDescriptor(StateDescriptor[AggregatingState[Any]],
                                 Generic[IN, ACC, OUT]):
    """Keeps an accumulator; ``type`` is the accumulator's type."""

    kind = StateKind.AGGREGATING

    def __init__(self, name: str, aggregate_function: AggregateFunction[IN, ACC, OUT],
                 accumulator_type: TypeLike | None = None,
                 ttl: StateTtlConfig | None = None,
                 evolution: SchemaEvolution | None = None) -> None:
        super().__init__(name, accumulator_type, ttl, evolution)
        for method in ("create_accumulator", "add", "get_result"):
            if not callable(getattr(aggregate_function, method, None)):
                raise ConfigurationError(
                    f"aggregate_function of state {name!r} lacks a {method}() method"
                )
        self.aggregate_function = aggregate_function
