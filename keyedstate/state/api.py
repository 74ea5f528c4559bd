"""The state primitives user code sees, scoped to the current key and namespace.

Each backend implements them over its own storage; one contract test suite
(``tests/backends/contract.py``) holds every implementation to the same behaviour. A state
object is bound to its backend's current key (``KeyedStateBackend.set_current_key``) and to
its own current namespace (:meth:`InternalKvState.set_current_namespace`, ``None`` by
default; windows use a window as the namespace).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, Iterable, Iterator, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class State(ABC):
    @abstractmethod
    def clear(self) -> None:
        """Remove the value for the current key and namespace."""

    @abstractmethod
    def set_current_namespace(self, namespace: Any) -> None:
        """Scope later calls to ``namespace`` (an int, str, bytes, None or a tuple of them)."""


class ValueState(State, Generic[V]):
    @abstractmethod
    def value(self) -> V | None:
        """The value, or the descriptor's default when none is set (or it expired)."""

    @abstractmethod
    def update(self, value: V | None) -> None:
        """Set the value; ``None`` clears it (as Flink)."""


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


class MapState(State, Generic[K, V]):
    @abstractmethod
    def get(self, key: K) -> V | None: ...

    @abstractmethod
    def put(self, key: K, value: V) -> None: ...

    @abstractmethod
    def put_all(self, mapping: dict[K, V]) -> None: ...

    @abstractmethod
    def remove(self, key: K) -> None: ...

    @abstractmethod
    def contains(self, key: K) -> bool: ...

    @abstractmethod
    def items(self) -> Iterator[tuple[K, V]]:
        """Live entries (expired ones left out); order is unspecified."""

    def keys(self) -> Iterator[K]:
        return (k for k, _ in self.items())

    def values(self) -> Iterator[V]:
        return (v for _, v in self.items())

    def is_empty(self) -> bool:
        return next(iter(self.items()), None) is None


class ReducingState(State, Generic[V]):
    @abstractmethod
    def get(self) -> V | None:
        """The reduced value, or None when nothing was added."""

    @abstractmethod
    def add(self, value: V) -> None: ...


class AggregatingState(State, Generic[V]):
    @abstractmethod
    def get(self) -> Any:
        """``get_result`` of the accumulator, or None when nothing was added."""

    @abstractmethod
    def add(self, value: V) -> None: ...
