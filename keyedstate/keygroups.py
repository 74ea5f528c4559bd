"""Key groups: the unit of state that moves when a job is rescaled.

The arithmetic is Flink's (``KeyGroupRangeAssignment``), so a Flink user can reason about it
the same way:

- max parallelism defaults to ``min(max(roundUpToPowerOfTwo(p + p // 2), 128), 32768)``;
- subtask ``i`` of ``p`` owns key groups ``[ceil(i*maxP/p), floor(((i+1)*maxP - 1)/p)]``;
- key group ``kg`` belongs to subtask ``kg * p // maxP``.

How a key becomes a key group is in :mod:`keyedstate.keys`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from keyedstate.errors import ConfigurationError, KeyGroupRangeError

#: Flink's bounds: ``KeyGroupRangeAssignment.DEFAULT_LOWER_BOUND_MAX_PARALLELISM`` and
#: ``UPPER_BOUND_MAX_PARALLELISM``.
DEFAULT_LOWER_BOUND_MAX_PARALLELISM = 1 << 7
UPPER_BOUND_MAX_PARALLELISM = 1 << 15


def _round_up_to_power_of_two(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def compute_default_max_parallelism(parallelism: int) -> int:
    """Flink's default max parallelism for an operator of the given parallelism."""
    check_parallelism(parallelism, UPPER_BOUND_MAX_PARALLELISM)
    return min(
        max(_round_up_to_power_of_two(parallelism + parallelism // 2),
            DEFAULT_LOWER_BOUND_MAX_PARALLELISM),
        UPPER_BOUND_MAX_PARALLELISM,
    )


def check_max_parallelism(max_parallelism: int) -> None:
    """Raise :class:`ConfigurationError` unless ``1 <= max_parallelism <= 32768``."""
    if not isinstance(max_parallelism, int) or isinstance(max_parallelism, bool):
        raise ConfigurationError(f"max parallelism must be an int, got {max_parallelism!r}")
    if not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ConfigurationError(
            f"max parallelism {max_parallelism} is out of range: it must be between 1 and "
            f"{UPPER_BOUND_MAX_PARALLELISM}"
        )


def check_parallelism(parallelism: int, max_parallelism: int) -> None:
    """Raise :class:`ConfigurationError` unless ``1 <= parallelism <= max_parallelism``."""
    check_max_parallelism(max_parallelism)
    if not isinstance(parallelism, int) or isinstance(parallelism, bool):
        raise ConfigurationError(f"parallelism must be an int, got {parallelism!r}")
    if not 1 <= parallelism <= max_parallelism:
        raise ConfigurationError(
            f"parallelism {parallelism} is out of range: it must be between 1 and the max "
            f"parallelism {max_parallelism} (raise the max parallelism only with a canonical "
            f"savepoint rewritten by the state processor API)"
        )


@dataclass(frozen=True, slots=True)
class KeyGroupRange:
    """An inclusive range ``[start, end]`` of key groups; empty when ``end < start``."""

    start: int
    end: int

    @classmethod
    def empty(cls) -> KeyGroupRange:
        return cls(0, -1)

    @classmethod
    def of_operator(cls, max_parallelism: int, parallelism: int, index: int) -> KeyGroupRange:
        """The key groups that subtask ``index`` of ``parallelism`` owns (Flink's formula)."""
        check_parallelism(parallelism, max_parallelism)
        if not 0 <= index < parallelism:
            raise ConfigurationError(
                f"subtask index {index} is out of range for parallelism {parallelism}"
            )
        start = (index * max_parallelism + parallelism - 1) // parallelism
        end = ((index + 1) * max_parallelism - 1) // parallelism
        return cls(start, end)

    def __len__(self) -> int:
        return max(0, self.end - self.start + 1)

    def __bool__(self) -> bool:
        return self.end >= self.start

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return KeyGroupRange(start, end) if start <= end else KeyGroupRange.empty()

    def contains_range(self, other: KeyGroupRange) -> bool:
        return not other or (self.start <= other.start and other.end <= self.end)

    def is_split_into(self, parts: Sequence[KeyGroupRange]) -> bool:
        """Whether ``parts`` are non-empty, in order and contiguous, and together exactly
        this range (the key-group shards of a RocksDB backend must be)."""
        expected = self.start
        for part in parts:
            if not part or part.start != expected:
                return False
            expected = part.end + 1
        return bool(parts) and expected == self.end + 1

    def split(self, parts: int) -> list[KeyGroupRange]:
        """This range cut into ``min(parts, len(self))`` contiguous non-empty ranges whose
        lengths differ by at most one (the key-group shards of a fresh RocksDB backend); an
        empty range gives ``[self]``."""
        n = max(1, min(parts, len(self)))
        size = len(self)
        bounds = [self.start + (i * size) // n for i in range(n + 1)]
        return [KeyGroupRange(a, b - 1) for a, b in zip(bounds, bounds[1:])] if size \
            else [self]

    def check_key_group(self, key_group: int) -> None:
        """Raise :class:`KeyGroupRangeError` unless ``key_group`` is in this range."""
        if key_group not in self:
            raise KeyGroupRangeError(
                f"key group {key_group} is not in this subtask's range {self}; the key was "
                f"routed to the wrong subtask"
            )

    def __str__(self) -> str:
        return f"KeyGroupRange[{self.start}, {self.end}]"


def operator_index_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """The subtask that owns ``key_group`` (Flink: ``keyGroupId * parallelism / maxParallelism``)."""
    return key_group * parallelism // max_parallelism


def key_group_prefix_bytes(max_parallelism: int) -> int:
    """Bytes of the big-endian key-group prefix of every RocksDB key: 1 up to 128, else 2."""
    check_max_parallelism(max_parallelism)
    return 1 if max_parallelism <= DEFAULT_LOWER_BOUND_MAX_PARALLELISM else 2


def serialize_key_group(key_group: int, prefix_bytes: int) -> bytes:
    """The key-group prefix as Flink writes it (``CompositeKeySerializationUtils``)."""
    return key_group.to_bytes(prefix_bytes, "big")
