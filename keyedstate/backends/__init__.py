"""State backends by name (``state.backend.type``), imported lazily."""

from __future__ import annotations

import importlib
from typing import Any

from keyedstate.backends.base.backend import StateBackend
from keyedstate.errors import ConfigurationError

_BACKENDS = {
    "heap": ("keyedstate.backends.heap", "HeapStateBackend"),
    "rocksdb": ("keyedstate.backends.rocksdb", "RocksDBStateBackend"),
}


def load_backend(name: str, **options: Any) -> StateBackend:
    """The backend called ``name`` ("heap" or "rocksdb"), built with ``options``."""
    try:
        module, cls = _BACKENDS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown state backend {name!r}; choose one of {sorted(_BACKENDS)}"
        ) from None
    backend: StateBackend = getattr(importlib.import_module(module), cls)(**options)
    return backend


def backend_names() -> list[str]:
    return sorted(_BACKENDS)
