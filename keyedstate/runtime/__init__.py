"""The engine-independent runtime: the user's :class:`~keyedstate.runtime.function.KeyedProcessFunction`,
the one job start-up (:mod:`~keyedstate.runtime.startup`), the engine-independent half of a
batch (:mod:`~keyedstate.runtime.batch`), one subtask of one batch
(:mod:`~keyedstate.runtime.subtask`), the failure line a subtask sends its driver
(:mod:`~keyedstate.runtime.failures`) and the local runtime (:mod:`~keyedstate.runtime.local`:
``LocalJob``, no Java). Spark drives the same pieces through :mod:`keyedstate.spark`."""
