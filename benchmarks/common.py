"""Helpers shared by the benchmarks: machine facts, timing, subtask construction, where
checkpoints go (a store, optionally behind a latency model)."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from keyedstate.backends import load_backend
from keyedstate.backends.base.backend import KeyedStateBackend, StateBackend
from keyedstate.backends.base.parameters import KeyedStateBackendParameters
from keyedstate.keygroups import KeyGroupRange, operator_index_for_key_group
from keyedstate.keys import KeySerializer
from keyedstate.state.api import ValueState
from keyedstate.state.descriptors import ValueStateDescriptor
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle
from keyedstate.testing.latency import LatencyModel, behind_latency, parse_latency


def machine() -> dict[str, Any]:
    """Where a figure was measured (benchmarks report ratios: the machines are shared)."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        # other work on a shared machine shows here (1, 5, 15 minutes; taken at the end)
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "commit": _commit(),
    }


def _commit() -> str | None:
    """The source tree's git commit (``+dirty`` with uncommitted changes), None outside git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}+dirty" if dirty.strip() else head


@dataclass(frozen=True)
class Location:
    """A folder checkpoints (and savepoints) go to: ``url(name)`` is a folder in it,
    ``options`` its fsspec storage options; ``model`` the latency model it is behind (None:
    none), whose wrapper logs every request to ``log_dir`` when given."""

    base: str
    options: dict[str, Any] = field(default_factory=dict)
    model: LatencyModel | None = None
    log_dir: str | None = None

    def url(self, name: str) -> str:
        return f"{self.base.rstrip('/')}/{name}"


def behind(base: str, options: dict[str, Any], model: LatencyModel | None,
           log_dir: str | None = None) -> Location:
    """The :class:`Location` of ``base`` (a local path or ``s3://...``) seen through ``model``
    (``kslatency://``, :mod:`keyedstate.testing.latency`), or plainly without one."""
    url, shaped = behind_latency(base, options, model, log_dir if model else None)
    return Location(url, shaped, model, log_dir if model else None)


def latency_model(spec: str | LatencyModel | None) -> LatencyModel | None:
    """A benchmark's ``--latency``: ``none`` (or None), a model name, or figures
    (:func:`~keyedstate.testing.latency.parse_latency`); refused with
    :class:`~keyedstate.errors.LatencyModelError` before anything runs."""
    if spec is None or isinstance(spec, LatencyModel):
        return spec
    return parse_latency(spec)


class Timer:
    def __init__(self) -> None:
        self.seconds = 0.0


@contextmanager
def timed() -> Iterator[Timer]:
    t = Timer()
    start = time.perf_counter()
    try:
        yield t
    finally:
        t.seconds = time.perf_counter() - start


@contextmanager
def workdir(prefix: str) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix=f"keyedstate-bench-{prefix}-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def save_figure(fig: Any, path: str, dpi: float | None = None) -> str:
    """Lay ``fig`` out, write it to ``path`` (its directory created) and close it; returns
    ``path``. ``dpi`` None: matplotlib's default."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def user_keys(n: int) -> list[str]:
    return [f"user-{i:08d}" for i in range(n)]


def build_subtasks(backend: StateBackend, parallelism: int, max_parallelism: int,
                   key_serializer: KeySerializer, local_dir: str,
                   restore: Sequence[KeyedStateHandle] = (),
                   storage: CheckpointStorage | None = None) -> list[KeyedStateBackend]:
    return [
        backend.create_keyed_backend(KeyedStateBackendParameters(
            subtask_index=i,
            key_group_range=KeyGroupRange.of_operator(max_parallelism, parallelism, i),
            max_parallelism=max_parallelism,
            key_serializer=key_serializer,
            restore_handles=restore,
            storage=storage,
            local_dir=local_dir,
        ))
        for i in range(parallelism)
    ]


def route(keys: Sequence[Any], key_serializer: KeySerializer, parallelism: int,
          max_parallelism: int) -> list[list[tuple[Any, int]]]:
    """Keys with their key group, per subtask (what the Spark runtime's shuffle does)."""
    per_subtask: list[list[tuple[Any, int]]] = [[] for _ in range(parallelism)]
    for key in keys:
        kg = key_serializer.key_group(key, max_parallelism)
        per_subtask[operator_index_for_key_group(max_parallelism, parallelism, kg)].append((key, kg))
    return per_subtask


def backend_named(name: str, **options: Any) -> StateBackend:
    return load_backend(name, **options)


def value_state(backend: KeyedStateBackend, descriptor: ValueStateDescriptor) -> ValueState[Any]:
    """``backend.get_state(descriptor)``, typed as the ValueState it is."""
    return backend.get_state(descriptor)
