"""State backends by name (``state.backend.type``), imported lazily."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from keyedstate.backends.base.backend import StateBackend
from keyedstate.errors import ConfigurationError

_BACKENDS = {
    "heap": ("keyedstate.backends.heap", "HeapStateBackend"),
    "rocksdb": ("keyedstate.backends.rocksdb", "RocksDBStateBackend"),
}


def load_backend(name: str, **options: Any) -> StateBackend:
    """The backend called ``name`` ("heap" or "rocksdb"), built with ``options``
    (``keyedstate.backend.options``). An unknown name or option raises
    :class:`ConfigurationError` naming what the backend takes (at job start, not as a
    ``TypeError`` from its constructor)."""
    try:
        module, cls = _BACKENDS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown state backend {name!r}; choose one of {sorted(_BACKENDS)}"
        ) from None
    backend_class = getattr(importlib.import_module(module), cls)
    accepted = list(inspect.signature(backend_class).parameters)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigurationError(
            f"the {name!r} state backend has no option {', '.join(map(repr, unknown))} "
            f"(keyedstate.backend.options); it takes {accepted}"
        )
    backend: StateBackend = backend_class(**options)
    return backend


def backend_names() -> list[str]:
    return sorted(_BACKENDS)
