"""Keeping Python's cyclic garbage collector off the state a worker keeps between batches.

A heap backend holds its state as Python objects: per state a dict per key group, whose keys
are ``(key bytes, namespace bytes)`` tuples. Such a dict, millions of entries in all, costs a
walk over every entry whenever a collection looks at it, and allocation-heavy work (a batch,
a restore, the snapshot's asynchronous part) triggers many collections. Worse, a full
collection *untracks* a dict whose entries are all untracked (tuples of bytes are, once a
collection has seen them), and the next insert of a freshly made key tuple tracks it again,
into the youngest generation, where every collection walks it. Measured at 2.5 M keys in one
subtask (local runtime, 100,000 events over 25,000 keys per batch): 1.5-2.5 s per batch with
the collector walking the state, 0.5-0.75 s without, as at 100,000 keys (docs/benchmarks.md
section 5).

What the runtime does (:func:`keyedstate.runtime.subtask.process_subtask`):

- :func:`collection_paused` around a subtask's whole run (restore, timers, the function, the
  snapshot): no automatic collection walks anything while it runs. Reference counting still
  frees whatever is not in a cycle; a run's cyclic garbage waits for the next
  :func:`freeze_survivors`.
- :func:`freeze_survivors` at the start of each batch, once the subtask has its state: the
  young generations are collected (a young collection never untracks a dict) and every
  surviving object is moved to the permanent generation (``gc.freeze``), which collections
  skip. A key-group dict frozen while tracked stays there, however often it is written.
  Frozen objects not in a cycle are still freed by reference counting (a replaced value, a
  cleared key group); what leaks is cyclic garbage made of objects frozen before it became
  garbage, and cyclic garbage that reached the oldest generation between two batches.
- :func:`thaw` when a live copy is closed: the frozen objects are the collector's again (the
  closed copy's cyclic shell is collected), at the price of one walk over everything at the
  next full collection.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic cyclic collection inside (``gc.disable``); the collector's previous state
    is restored on the way out (a caller that had disabled it keeps it disabled)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_survivors() -> None:
    """Collect the young generations (the garbage made since the last freeze, when automatic
    collection was paused since), then freeze everything left."""
    gc.collect(1)
    gc.freeze()


def thaw() -> None:
    """Return the frozen objects to the collector (a live copy was closed)."""
    gc.unfreeze()
