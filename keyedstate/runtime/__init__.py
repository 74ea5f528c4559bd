"""The engine-independent runtime: the user's :class:`~keyedstate.runtime.function.KeyedProcessFunction`,
one subtask of one batch (:mod:`~keyedstate.runtime.subtask`), the failure line a subtask
sends its driver (:mod:`~keyedstate.runtime.failures`) and the local runtime
(:mod:`~keyedstate.runtime.local`). Spark drives it through :mod:`keyedstate.spark`."""
