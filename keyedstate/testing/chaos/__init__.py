"""The chaos soak (``keyedstate chaos``): a keyed job with every state kind, TTL and both timer
kinds runs for hundreds of micro-batches on ``local-cluster`` while Python workers, executor
JVMs and the driver are killed, checkpoints are aborted, storage calls fail after the checkpoint
commit, and jobs end with savepoints (at a stop, after a drain, from inside the sink commit,
offline after a crash) and restart in every restore mode at random parallelism, in the same or
a fresh Spark checkpoint location, beside a second job writing into the same output path; an
independent oracle then checks that every output row appears exactly once with the right value
and that the final state read through the state processor API is the oracle's. See
``docs/reliability.md``.

- :mod:`~keyedstate.testing.chaos.plan`: the seeded schedule;
- :mod:`~keyedstate.testing.chaos.workload`: input, the keyed function, executor-side faults;
- :mod:`~keyedstate.testing.chaos.driver`: the Spark application (killed and restarted);
- :mod:`~keyedstate.testing.chaos.driver_faults`: the faults in the driver process;
- :mod:`~keyedstate.testing.chaos.boundary`: how a job ends, and the second job;
- :mod:`~keyedstate.testing.chaos.runner`: the controller;
- :mod:`~keyedstate.testing.chaos.verdict`: the verdict (oracle, drills, directories, bounds);
- :mod:`~keyedstate.testing.chaos.oracle`: the expected outputs and state (pandas);
- :mod:`~keyedstate.testing.chaos.compare`: the sinks and checkpoints compared with them;
- :mod:`~keyedstate.testing.chaos.drills`: corruption and positions drills;
- :mod:`~keyedstate.testing.chaos.resources`: memory, processes and disk from ``/proc``.

Nothing here imports pyspark: the Spark parts go through :mod:`keyedstate.spark`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ChaosConfig", "ChaosReport", "run_chaos"]


def __getattr__(name: str) -> Any:
    # Lazy: executors import keyedstate.testing.chaos.workload and need none of the controller.
    if name in __all__:
        from keyedstate.testing.chaos import runner

        return getattr(runner, name)
    raise AttributeError(name)
