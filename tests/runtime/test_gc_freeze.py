"""The runtime keeps Python's cyclic collector off the live state between batches
(``keyedstate.runtime.gc_freeze``): a batch's cyclic garbage is collected, what survives is
frozen, and closing the live copies gives the frozen objects back to the collector."""

from __future__ import annotations

import gc
import weakref
from typing import Any, Iterator

import pytest

from keyedstate.runtime.function import Context
from tests.runtime.test_local_job import batches, config, new_job
from tests.spark.jobs import IdleCounts


class _Cycle:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


class CountsMakingCycles(IdleCounts):
    """IdleCounts that leaves a cycle of garbage behind in every ``open`` (and remembers it
    weakly), and may keep one alive from outside (``kept``)."""

    made: list[weakref.ref[_Cycle]] = []
    kept: list[_Cycle] = []

    def open(self, ctx: Context) -> None:
        super().open(ctx)
        garbage = _Cycle()
        type(self).made.append(weakref.ref(garbage))
        if not type(self).kept:
            type(self).kept.append(_Cycle())


@pytest.fixture
def no_automatic_collection() -> Iterator[None]:
    """Only the runtime's own collection may free cycles during the test (an automatic one
    could free them too, and the test would not tell)."""
    CountsMakingCycles.made.clear()
    CountsMakingCycles.kept.clear()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def _alive(ref: weakref.ref[Any]) -> bool:
    return ref() is not None


@pytest.mark.usefixtures("no_automatic_collection")
def test_each_batch_collects_the_last_ones_garbage_and_freezes_the_state_for_good(tmp_path):
    with new_job(config(tmp_path, backend="heap"), CountsMakingCycles()) as job:
        data = batches(3, users=200)
        job.process_batch(data[0])
        job.process_batch(data[1])
        live = [v.backend for _, v in _live_copies(job)]
        groups = [g for b in live for t in b.tables.values() for g in t.maps.values()]
        assert groups
        job.process_batch(data[2])  # writes into most of those key-group dicts
        # Each subtask's run collected the cyclic garbage made before it in this process
        # (start-up's open() included); only the last run's garbage waits for the next one.
        made = [_alive(r) for r in CountsMakingCycles.made]
        assert len(made) >= 6 and made == [False] * (len(made) - 1) + [True]
        assert gc.get_freeze_count() > 0
        # The key-group dicts were frozen while tracked, and writing into them did not bring
        # them back to a generation that collections walk.
        walked = {id(o) for o in gc.get_objects()}
        assert not [g for g in groups if id(g) in walked]


def test_no_automatic_collection_runs_while_a_subtask_runs(tmp_path):
    seen: list[bool] = []

    class Recording(IdleCounts):
        def open(self, ctx: Context) -> None:
            super().open(ctx)
            seen.append(gc.isenabled())

    assert gc.isenabled()
    with new_job(config(tmp_path, backend="heap"), Recording()) as job:
        job.process_batch(batches(1)[0])
    # start-up's open() (runtime.declared, outside any subtask), then the two subtasks'
    assert seen == [True, False, False]
    assert gc.isenabled()  # restored afterwards


@pytest.mark.usefixtures("no_automatic_collection")
def test_closing_the_live_copies_gives_frozen_cycles_back_to_the_collector(tmp_path):
    with new_job(config(tmp_path, backend="heap"), CountsMakingCycles()) as job:
        job.process_batch(batches(1)[0])
        kept = weakref.ref(CountsMakingCycles.kept.pop())  # frozen, now garbage
        gc.collect()
        assert _alive(kept)  # the collector doesn't see frozen objects
    # The job closed its live copies: the frozen objects are the collector's again.
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert not _alive(kept)


def _live_copies(job: Any) -> list[Any]:
    import keyedstate.runtime.live_copies as live_copies

    return [(k, v) for k, v in live_copies.LIVE.items() if k[0] == job.storage.url]
