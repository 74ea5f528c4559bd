"""The state primitives user code sees, scoped to the current key and namespace.

Each backend implements them over its own storage; one contract test suite
(``tests/backends/contract/``) holds every implementation to the same behaviour. A state
object is bound to its backend's current key (``KeyedStateBackend.set_current_key``) and to
its own current namespace (:meth:`InternalKvState.set_current_namespace`, ``None`` by
default; windows use a window as the namespace).

**Bulk calls** (``get_many``, ``update_many``, ``add_many``, ``clear_many``, ...) take many keys
at once (:class:`~keyedstate.state.batch_keys.BatchKeys`, the distinct keys of a batch) for a
vectorized function (``KeyedProcessFunction.process_batch``). Contract: a bulk call has exactly
the effect of setting each key current in order and making the per-key call, in the state's
current namespace (stored bytes, TTL timestamps and expiry included), and returns the per-key
results in the keys' order; it neither uses nor changes the backend's current key. ``values``
are one per key (a sequence, a pyarrow array or a numpy array). A bulk call that raises leaves
the state of its keys unspecified (the runtime then fails the batch and restarts from the last
checkpoint). Keys outside the backend's key-group range raise ``KeyGroupRangeError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, Iterable, Iterator, Sequence, TypeVar

from keyedstate.state.batch_keys import BatchKeys

K = TypeVar("K")
V = TypeVar("V")


class State(ABC):
    @abstractmethod
    def clear(self) -> None:
        """Remove the value for the current key and namespace."""

    @abstractmethod
    def set_current_namespace(self, namespace: Any) -> None:
        """Scope later calls to ``namespace`` (an int, str, bytes, None or a tuple of them)."""

    @abstractmethod
    def clear_many(self, keys: BatchKeys) -> None:
        """:meth:`clear` for each of ``keys``."""


class ValueState(State, Generic[V]):
    @abstractmethod
    def value(self) -> V | None:
        """The value, or the descriptor's default when none is set (or it expired)."""

    @abstractmethod
    def update(self, value: V | None) -> None:
        """Set the value; ``None`` clears it (as Flink)."""

    @abstractmethod
    def get_many(self, keys: BatchKeys) -> list[V | None]:
        """:meth:`value` of each of ``keys``, in their order."""

    @abstractmethod
    def update_many(self, keys: BatchKeys, values: Sequence[V | None]) -> None:
        """:meth:`update` of each of ``keys`` with its value (``None`` clears)."""


class ListState(State, Generic[V]):
    @abstractmethod
    def get(self) -> list[V]:
        """All elements in insertion order; an empty list when there are none."""

    @abstractmethod
    def add(self, value: V) -> None:
        """Append one element (journaled as an append in incremental snapshots)."""

    @abstractmethod
    def add_all(self, values: Iterable[V]) -> None:
        """Append the elements in order."""

    @abstractmethod
    def update(self, values: Iterable[V]) -> None:
        """Replace all elements; an empty iterable clears the list."""

    @abstractmethod
    def get_many(self, keys: BatchKeys) -> list[list[V]]:
        """:meth:`get` of each of ``keys``, in their order."""

    @abstractmethod
    def add_many(self, keys: BatchKeys, elements: Sequence[Iterable[V]]) -> None:
        """:meth:`add_all` of each of ``keys`` with its elements (one iterable per key)."""


class MapState(State, Generic[K, V]):
    @abstractmethod
    def get(self, key: K) -> V | None:
        """The value under map key ``key``, or None when absent or expired."""

    @abstractmethod
    def get_many(self, keys: BatchKeys, user_keys: Sequence[K]) -> list[V | None]:
        """:meth:`get` of one map key per key: ``user_keys[i]`` in the map of ``keys``' key
        ``i``."""

    @abstractmethod
    def put_many(self, keys: BatchKeys, user_keys: Sequence[K], values: Sequence[V]) -> None:
        """:meth:`put` of one map entry per key: ``user_keys[i] -> values[i]`` into the map of
        ``keys``' key ``i``."""

    @abstractmethod
    def put(self, key: K, value: V) -> None:
        """Map ``key`` to ``value`` (replacing an earlier value)."""

    @abstractmethod
    def put_all(self, mapping: dict[K, V]) -> None:
        """Put every entry of ``mapping``."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """Remove map key ``key`` (nothing if absent)."""

    @abstractmethod
    def contains(self, key: K) -> bool:
        """Whether map key ``key`` has a live (unexpired) value."""

    @abstractmethod
    def items(self) -> Iterator[tuple[K, V]]:
        """Live entries (expired ones left out); order is unspecified."""

    def keys(self) -> Iterator[K]:
        """Live map keys (expired ones left out); order is unspecified."""
        return (k for k, _ in self.items())

    def values(self) -> Iterator[V]:
        """Live values (expired ones left out); order is unspecified."""
        return (v for _, v in self.items())

    def is_empty(self) -> bool:
        """Whether the map has no live entry."""
        return next(iter(self.items()), None) is None


class ReducingState(State, Generic[V]):
    @abstractmethod
    def get(self) -> V | None:
        """The reduced value, or None when nothing was added."""

    @abstractmethod
    def add(self, value: V) -> None:
        """Reduce ``value`` into the state with the descriptor's reduce function."""

    @abstractmethod
    def get_many(self, keys: BatchKeys) -> list[V | None]:
        """:meth:`get` of each of ``keys``, in their order."""

    @abstractmethod
    def add_many(self, keys: BatchKeys, values: Sequence[V]) -> None:
        """:meth:`add` of one value per key (reduce a key's inputs of the batch to one value
        first: the reduce function is associative)."""


class AggregatingState(State, Generic[V]):
    @abstractmethod
    def get(self) -> Any:
        """``get_result`` of the accumulator, or None when nothing was added."""

    @abstractmethod
    def add(self, value: V) -> None:
        """Add ``value`` to the accumulator with the descriptor's aggregate function."""

    @abstractmethod
    def get_many(self, keys: BatchKeys) -> list[Any]:
        """:meth:`get` of each of ``keys``, in their order."""

    @abstractmethod
    def add_many(self, keys: BatchKeys, values: Sequence[V]) -> None:
        """:meth:`add` of one input per key (call it again for a key's further inputs)."""
