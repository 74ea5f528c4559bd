"""The :class:`~keyedstate.checkpoint.cleanup.Cleaner`: clean-ups off the caller's path, in
the order handed; a failure is logged, never raised; ``wait`` returns once all have ended."""

from __future__ import annotations

import logging
import pickle
import threading

from keyedstate.checkpoint.cleanup import Cleaner


def test_clean_ups_run_in_order_off_the_callers_thread_and_wait_sees_them_all():
    cleaner = Cleaner()
    ran: list[tuple[int, str]] = []
    gate = threading.Event()
    cleaner.submit("first", lambda: (gate.wait(5), ran.append((1, threading.current_thread().name))))
    for i in range(2, 6):
        cleaner.submit(f"clean-up {i}", lambda i=i: ran.append((i, threading.current_thread().name)))
    assert ran == []  # the first one holds the thread: nothing ran on the caller's
    gate.set()
    cleaner.wait()
    assert [i for i, _ in ran] == [1, 2, 3, 4, 5]
    assert {name for _, name in ran} == {"keyedstate-cleaner"}


def test_a_failed_clean_up_is_logged_and_the_next_ones_still_run(caplog):
    cleaner = Cleaner()
    ran: list[str] = []

    def refused() -> None:
        raise PermissionError("denied")

    with caplog.at_level(logging.WARNING, logger="keyedstate.checkpoint.cleanup"):
        cleaner.submit("the staged output of batch 3", refused)
        cleaner.submit("the acks of checkpoint 4", lambda: ran.append("acks"))
        cleaner.wait()
    assert ran == ["acks"]
    assert "could not clean up the staged output of batch 3: denied" in caplog.text
    assert "keyedstate gc" in caplog.text
    cleaner.wait()  # nothing handed: returns at once
    cleaner.submit("later", lambda: ran.append("later"))  # a new thread once the last ended
    cleaner.wait()
    assert ran == ["acks", "later"]


def test_a_pickled_cleaner_starts_empty():
    cleaner = Cleaner()
    gate = threading.Event()
    cleaner.submit("held", lambda: gate.wait(5))
    copy = pickle.loads(pickle.dumps(cleaner))
    copy.wait()  # nothing of the original's was handed to it
    gate.set()
    cleaner.wait()
