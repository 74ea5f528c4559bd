"""Keeping Python's cyclic garbage collector off the state a worker keeps between batches.

A heap backend holds its state as Python objects (a dict per key group, a tuple or list per
entry), millions of them at a few million keys, all tracked by the cyclic garbage collector.
A full collection walks every tracked object, and allocation-heavy work (a batch, the
snapshot's asynchronous part) triggers several: measured at 2.5 M keys per subtask, batches
took 1.2-1.8 s instead of 0.94-0.97 s and the asynchronous part 140-540 ms instead of 83 ms
(docs/benchmarks.md section 5). The state is live until the copy is closed, so walking it
finds nothing to free.

Contract: :func:`freeze_survivors` runs after a batch kept its live copy. It collects what the
batch left as cyclic garbage, then moves every surviving object to the permanent generation
(``gc.freeze``), which collections skip. Reference counting still frees frozen objects that
are not in a cycle (a replaced value, a cleared key group), so freezing leaks only cyclic
garbage made of objects frozen earlier. :func:`thaw` gives those back to the collector: it
runs when a live copy is closed (its tables are dropped by ``close``; the small cyclic shell
around them becomes collectable again), at the price of one full walk at the next
:func:`freeze_survivors`.
"""

from __future__ import annotations

import gc


def freeze_survivors() -> None:
    """Collect the garbage made since the last freeze, then freeze what is left (a walk over
    the objects allocated since the last freeze only: frozen ones are not walked)."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Return the frozen objects to the collector (a live copy was closed)."""
    gc.unfreeze()
