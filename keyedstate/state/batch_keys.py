"""The keys of a bulk state call: many keys at once, each with its canonical bytes and key group.

A vectorized function (``KeyedProcessFunction.process_batch``) gets one :class:`BatchKeys` per
batch, the distinct keys of its subtask's rows, and passes it to the bulk calls of its states
(``ValueState.get_many``, ``update_many``, ``clear_many``, ...). The key bytes and key groups are
exactly those of the per-key path (:meth:`KeySerializer.serialize_with_key_group`), so what a
bulk call stores is what ``set_current_key(key)`` then a per-key call stores.

Flink has no bulk keyed state access; the contract is ours: a bulk call over ``keys`` has the
effect of the per-key call for each key in order, in the state's current namespace.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from keyedstate.errors import ConfigurationError
from keyedstate.keys import KeySerializer


class BatchKeys:
    """Distinct keys in a fixed order (position ``i`` of a bulk call's values belongs to key
    ``i``): the keys (``keys``: scalars for one key column, tuples for several), their
    canonical bytes (``key_bytes``) and key groups (``key_groups``).

    Built by the runtime for each batch, or with :meth:`of` from key values. Distinct means
    distinct key bytes; :meth:`of` checks it, the runtime builds them distinct. Read-only;
    backends may cache per-batch encodings on it (:meth:`cached`).
    """

    __slots__ = ("keys", "key_bytes", "key_groups", "_cache")

    def __init__(self, keys: Sequence[Any], key_bytes: Sequence[bytes],
                 key_groups: Sequence[int]) -> None:
        if not len(keys) == len(key_bytes) == len(key_groups):
            raise ConfigurationError(
                f"BatchKeys needs as many key bytes ({len(key_bytes)}) and key groups "
                f"({len(key_groups)}) as keys ({len(keys)})")
        self.keys: Sequence[Any] = keys
        self.key_bytes: Sequence[bytes] = key_bytes
        self.key_groups: Sequence[int] = key_groups
        self._cache: dict[Any, Any] = {}

    @classmethod
    def of(cls, keys: Iterable[Any], key_serializer: KeySerializer,
           max_parallelism: int) -> BatchKeys:
        """The batch keys of ``keys`` (scalars for one key column, tuples for several), encoded
        by ``key_serializer`` for ``max_parallelism`` as the per-key path encodes them. Raises
        :class:`ConfigurationError` when a key repeats."""
        keys = list(keys)
        pairs = [key_serializer.serialize_with_key_group(k, max_parallelism) for k in keys]
        key_bytes = [b for b, _ in pairs]
        if len(set(key_bytes)) != len(key_bytes):
            first: dict[bytes, int] = {}
            repeated = next(k for i, (k, b) in enumerate(zip(keys, key_bytes))
                            if first.setdefault(b, i) != i)
            raise ConfigurationError(
                f"key {repeated!r} is given twice: the keys of a bulk state call must be "
                f"distinct (merge its values first)")
        return cls(keys, key_bytes, [g for _, g in pairs])

    def __len__(self) -> int:
        return len(self.key_bytes)

    def cached(self, name: Any, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per batch keys and ``name`` (a backend's encodings of
        the keys, shared by every bulk call over them)."""
        value = self._cache.get(name)
        if value is None:
            value = self._cache[name] = build()
        return value

    def __repr__(self) -> str:
        return f"BatchKeys({len(self)} keys)"


def values_of(keys: BatchKeys, values: Any, what: str = "values") -> list[Any]:
    """``values`` (a sequence, a pyarrow array or a numpy array) as a list of Python values,
    one per key; raises :class:`ConfigurationError` when the lengths differ."""
    to_pylist = getattr(values, "to_pylist", None)  # pyarrow
    if to_pylist is None:
        to_pylist = getattr(values, "tolist", None)  # numpy, pandas
    out = to_pylist() if to_pylist is not None else list(values)
    if len(out) != len(keys):
        raise ConfigurationError(
            f"{len(out)} {what} for {len(keys)} keys: a bulk state call takes one per key, in "
            f"the keys' order")
    return out
