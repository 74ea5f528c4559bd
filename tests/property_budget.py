"""How many examples a property test draws.

``make test`` (and CI) gives every property test its full budget; ``make check``, the fast
loop, sets ``KEYEDSTATE_TEST_BUDGET=check`` and draws a quarter of it (at least 3). Either way
Hypothesis first replays the failing examples it found before (its example database), so a
bug found by a full run stays found in the fast loop. Use :func:`budget` wherever a test sets
``max_examples``: an explicit setting overrides any Hypothesis profile, so a profile alone
could not shrink them."""

from __future__ import annotations

import os

#: What share of its examples a property test draws, by ``KEYEDSTATE_TEST_BUDGET``.
SHARES = {"full": 1.0, "check": 0.25}
MODE = os.environ.get("KEYEDSTATE_TEST_BUDGET", "full")
if MODE not in SHARES:
    raise ValueError(f"KEYEDSTATE_TEST_BUDGET={MODE!r}: choose one of {sorted(SHARES)}")


def budget(examples: int) -> int:
    """The examples to draw of a test whose full budget is ``examples``."""
    return max(3, round(examples * SHARES[MODE])) if SHARES[MODE] < 1 else examples
