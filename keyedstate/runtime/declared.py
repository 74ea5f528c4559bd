"""The states a function declares, found at job start (as Spark's ``transformWithState`` runs
its processor's ``init()`` on the driver to learn its state variables).

:func:`declared_states` calls ``open()`` of a deep copy of the function with a context over an
empty heap backend that records every descriptor ``get_state`` is given. The job's start-up
checks them against the snapshot it restores (:func:`~keyedstate.backends.base.migration.
check_restored_states`), so an incompatible state type fails the start, not the first batch.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Sequence, cast

from keyedstate.backends.base.backend import KeyedStateBackend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.backends.heap.backend import HeapStateBackend
from keyedstate.errors import ConfigurationError
from keyedstate.keygroups import KeyGroupRange
from keyedstate.keys import KeySerializer
from keyedstate.runtime.function import Context, KeyedProcessFunction
from keyedstate.state.descriptors import S, StateDescriptor

_MAX_PARALLELISM = 128


class _Recorder:
    """A keyed backend's stand-in for ``open()``: ``get_state`` records the descriptor (and
    returns a real, empty state); everything else is the empty heap backend's."""

    def __init__(self, backend: KeyedStateBackend) -> None:
        self._backend = backend
        self.descriptors: dict[str, StateDescriptor] = {}

    def get_state(self, descriptor: StateDescriptor[S]) -> S:
        state = self._backend.get_state(descriptor)  # refuses a name used for two kinds
        self.descriptors.setdefault(descriptor.name, descriptor)
        return state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def declared_states(function: KeyedProcessFunction, key_types: Sequence[str],
                    parallelism: int) -> list[StateDescriptor]:
    """The descriptors ``function.open()`` registers, in registration order. ``open`` runs on
    a deep copy (the function itself is untouched), then ``close``. Raises
    :class:`ConfigurationError` from what ``open`` raises (its traceback kept): ``open`` must
    be able to run at job start (register states there; acquire executor-only resources
    lazily)."""
    backend = HeapStateBackend().create_keyed_backend(KeyedStateBackendParameters(
        subtask_index=0, key_group_range=KeyGroupRange(0, _MAX_PARALLELISM - 1),
        max_parallelism=_MAX_PARALLELISM, key_serializer=KeySerializer(list(key_types))))
    recorder = _Recorder(backend)
    try:
        probe = copy.deepcopy(function)
        ctx = Context(cast(KeyedStateBackend, recorder), subtask_index=0,
                      parallelism=parallelism, batch_id=-1, watermark=-(1 << 63),
                      processing_time=time.time_ns() // 1_000_000)
        probe.open(ctx)
        probe.close()
    except Exception as exc:
        raise ConfigurationError(
            f"{type(function).__name__}.open() failed when run at job start to find the states "
            f"it declares ({type(exc).__name__}: {exc}); open() must run anywhere: register "
            f"states there and acquire executor-only resources on first use"
        ) from exc
    finally:
        backend.close()
    return list(recorder.descriptors.values())
