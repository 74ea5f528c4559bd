"""Rolling materialization of the heap backend: which key groups a snapshot images.

A heap chain file holds, per key group, a diff or an *image* (the key group's whole content).
No incremental snapshot images everything: each images the key groups whose latest image is
oldest, until the imaged entries reach the entries it changed (the cost of a checkpoint follows
its change, about twice the diff at most, plus one key group) and at least ``ceil(key groups /
(max_chain_length + 1))`` key groups (so every key group is imaged again within
``max_chain_length + 1`` snapshots, which bounds the chain). The chain then lists the files
from the oldest of the key groups' latest images on: the older ones are needed no more.

Imaged key groups are written as inclusive ``(start, end)`` ranges (:data:`KeyGroupRanges`), in
each file's footer and, for the whole chain, in the handle's properties
(:func:`format_images`), so a restore knows which files its key groups need before reading any.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from keyedstate.backends.heap.state_table import KeyGroupMarks, StateTable
from keyedstate.backends.heap.timers import TimerQueue
from keyedstate.keygroups import KeyGroupRange

#: Inclusive ``(start, end)`` key-group ranges, sorted and disjoint.
KeyGroupRanges = list[tuple[int, int]]


def ranges_of(key_groups: Iterable[int]) -> KeyGroupRanges:
    """Key groups as inclusive ranges: ``[0, 1, 2, 7] -> [(0, 2), (7, 7)]``."""
    out: KeyGroupRanges = []
    for kg in sorted(key_groups):
        if out and out[-1][1] == kg - 1:
            out[-1] = (out[-1][0], kg)
        else:
            out.append((kg, kg))
    return out


def count(ranges: KeyGroupRanges) -> int:
    """How many key groups ``ranges`` hold."""
    return sum(end - start + 1 for start, end in ranges)


def format_images(images: Sequence[KeyGroupRanges]) -> str:
    """A chain's images as a handle property: per file ``start-end`` ranges joined by ``+``,
    files joined by ``,`` (an empty item: a file imaging nothing)."""
    return ",".join("+".join(f"{s}-{e}" for s, e in ranges) for ranges in images)


def parse_images(text: str) -> list[KeyGroupRanges]:
    """The inverse of :func:`format_images`; ValueError when malformed."""
    out: list[KeyGroupRanges] = []
    for item in text.split(","):
        ranges: KeyGroupRanges = []
        for part in item.split("+") if item else ():
            start, _, end = part.partition("-")
            ranges.append((int(start), int(end)))
        out.append(ranges)
    return out


def latest_images(images: Sequence[KeyGroupRanges], key_groups: KeyGroupRange) -> list[int]:
    """Per key group of ``key_groups`` (indexed from its start), the position of the newest file
    imaging it, -1 if none does."""
    first = key_groups.start
    latest = [-1] * len(key_groups)
    for position, ranges in enumerate(images):
        for s, e in ranges:
            for kg in range(max(s, first), min(e, key_groups.end) + 1):
                latest[kg - first] = position
    return latest


def choose_images(latest: Sequence[int], key_groups: KeyGroupRange, sizes: Callable[[int], int],
                  budget: int, at_least: int) -> list[int]:
    """The key groups the next incremental snapshot images: the ones whose latest image is
    oldest (``latest``, per key group; ties in key-group order, so the choice goes round the
    range like a cursor), taken until their entries (``sizes(kg)``) reach ``budget`` and at
    least ``at_least`` of them are taken. A key group without an image (-1) is always taken.
    Sorted."""
    first = key_groups.start
    order = sorted(range(len(latest)), key=latest.__getitem__)  # stable: ties by key group
    chosen: list[int] = []
    entries = 0
    for offset in order:
        if len(chosen) >= at_least and entries >= budget and latest[offset] >= 0:
            break
        chosen.append(first + offset)
        entries += sizes(first + offset)
    return sorted(chosen)


@dataclass(frozen=True)
class RollingPlan:
    """What an incremental snapshot writes besides its diff."""

    #: the key groups it images (sorted)
    images: list[int]
    #: the position of the first base file the new chain still needs (``len(base files)``:
    #: none, every key group is imaged)
    first_needed: int
    #: the entries changed since the base (journal marks, and timers of changed key groups)
    changed_entries: int
    #: the entries the images hold (stored entries and timers)
    image_entries: int


def plan_rolling(latest: Sequence[int], base_files: int, key_groups: KeyGroupRange,
                 changes: dict[str, KeyGroupMarks], tables: Sequence[StateTable],
                 queues: Sequence[TimerQueue], max_chain_length: int) -> RollingPlan:
    """The images of an incremental snapshot on a base chain of ``base_files`` files whose key
    groups' newest images are at ``latest``, given the journal's ``changes`` (numbered steps)."""
    # Step 1. How many entries changed: the journal's marks, and the timers of each key group
    # whose timers changed (a diff rewrites them whole).
    changed = sum(len(entries) for marks in changes.values() for entries in marks.values())
    changed += sum(len(q.by_key_group.get(kg, ())) for q in queues
                   for kg in changes.get(q.name, ()))

    def entries(kg: int) -> int:
        return sum(len(t.maps.get(kg, ())) for t in tables) + \
            sum(len(q.by_key_group.get(kg, ())) for q in queues)

    # Step 2. The key groups to image: oldest image first, as many entries as changed, and
    # enough key groups to image each again within max_chain_length + 1 snapshots.
    at_least = math.ceil(len(key_groups) / (max_chain_length + 1))
    chosen = choose_images(latest, key_groups, entries, changed, at_least)
    # Step 3. The base files still needed: from the oldest newest image of the key groups not
    # imaged now.
    imaged = set(chosen)
    first_needed = min((position for offset, position in enumerate(latest)
                        if key_groups.start + offset not in imaged), default=base_files)
    return RollingPlan(chosen, first_needed, changed, sum(entries(kg) for kg in chosen))
