"""The latency model: a first-byte latency per request and a bandwidth per stream, the named
models and their published sources (docs/object-storage.md, "A latency model for benchmarks")."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import fsspec

from keyedstate.errors import LatencyModelError

PROTOCOL = "kslatency"
#: A megabyte as transfer rates count it (10**6 bytes: 15 requests at 85 MB/s fill 10 Gb/s).
MB = 1_000_000


@dataclass(frozen=True)
class LatencyModel:
    """What one request costs: ``first_byte_ms`` before its first byte, then its bytes at
    ``mb_per_s`` megabytes (10**6 bytes) per second on its own stream (None: no bandwidth
    limit). ``name`` says where the figures come from (``"custom"`` for figures given by
    hand); :data:`MODELS` holds the named ones. Raises :class:`LatencyModelError` naming the
    parameter for a negative latency or a bandwidth that is not positive."""

    name: str
    first_byte_ms: float
    mb_per_s: float | None = None
    #: the published figures the model takes (docs/object-storage.md cites them)
    source: str = ""

    def __post_init__(self) -> None:
        if not _finite(self.first_byte_ms) or self.first_byte_ms < 0:
            raise LatencyModelError(
                f"latency model {self.name!r}: first_byte_ms must be a number >= 0 (milliseconds "
                f"before a request's first byte), got {self.first_byte_ms!r}")
        if self.mb_per_s is not None and (not _finite(self.mb_per_s) or self.mb_per_s <= 0):
            raise LatencyModelError(
                f"latency model {self.name!r}: mb_per_s must be a number > 0 (megabytes per "
                f"second per stream; leave it out for no bandwidth limit), got "
                f"{self.mb_per_s!r}")

    @property
    def first_byte_s(self) -> float:
        return self.first_byte_ms / 1000

    def transfer_s(self, nbytes: int) -> float:
        """Seconds ``nbytes`` take on one stream (0 without a bandwidth limit)."""
        return 0.0 if self.mb_per_s is None else nbytes / (self.mb_per_s * MB)

    def request_s(self, nbytes: int = 0) -> float:
        """Seconds one request moving ``nbytes`` takes: first byte plus transfer."""
        return self.first_byte_s + self.transfer_s(nbytes)

    def parameters(self) -> dict[str, Any]:
        """The model as a benchmark's JSON records it."""
        return {"name": self.name, "first_byte_ms": self.first_byte_ms,
                "mb_per_s": self.mb_per_s, "source": self.source}

    def storage_options(self, target_protocol: str,
                        target_options: Mapping[str, Any] | None = None,
                        log_dir: str | None = None) -> dict[str, Any]:
        """The ``kslatency://`` storage options that put ``target_protocol`` (``"file"``,
        ``"s3"`` ...) with its own options behind this model (``log_dir``: see the module)."""
        options: dict[str, Any] = {"target_protocol": target_protocol,
                                   "target_options": dict(target_options or {}),
                                   "model": self.name, "first_byte_ms": self.first_byte_ms,
                                   "mb_per_s": self.mb_per_s}
        if log_dir is not None:
            options["log_dir"] = os.fspath(log_dir)
        return options


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: The named models (docs/object-storage.md, "A latency model for benchmarks", cites the
#: figures): S3 Standard from an instance in the bucket's region, from AWS's "Best practices
#: design patterns: optimizing Amazon S3 performance" (first-byte-out latency "roughly
#: 100-200 milliseconds": the low end) and its whitepaper's "one concurrent request for each
#: 85-90 MB/s" (the high end).
MODELS: dict[str, LatencyModel] = {
    "s3-standard-same-region": LatencyModel(
        "s3-standard-same-region", first_byte_ms=100.0, mb_per_s=90.0,
        source="AWS S3 User Guide, 'Best practices design patterns: optimizing Amazon S3 "
               "performance': small-object and first-byte-out latencies of roughly 100-200 ms; "
               "whitepaper 'Best Practices Design Patterns: Optimizing Amazon S3 Performance', "
               "'Horizontal Scaling and Request Parallelization for High Throughput': one "
               "concurrent request per 85-90 MB/s"),
}
DEFAULT_MODEL = "s3-standard-same-region"
#: What ``--latency none`` means: no wrapper at all.
NONE = "none"
_SPEC_KEYS = {"first_byte_ms": "first_byte_ms", "ms": "first_byte_ms", "mb_per_s": "mb_per_s"}


def parse_latency(spec: str) -> LatencyModel | None:
    """The model a benchmark's ``--latency`` names: ``none`` (None: no wrapper), a name of
    :data:`MODELS`, or comma-separated ``key=value`` figures (``first_byte_ms`` or its short
    form ``ms``, ``mb_per_s``), optionally after a name whose figures they override:
    ``ms=30,mb_per_s=90``, ``s3-standard-same-region,first_byte_ms=30``. Figures without a
    name start from no latency and no bandwidth limit. Raises :class:`LatencyModelError`
    naming the part it can't read (``mbps`` is refused as ambiguous: megabits or megabytes)."""
    text = str(spec).strip()
    if text.lower() == NONE:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise LatencyModelError(f"--latency {spec!r} is empty; give {NONE!r}, a model name "
                                f"({', '.join(MODELS)}) or figures like ms=30,mb_per_s=90")
    base: LatencyModel | None = None
    if "=" not in parts[0]:
        name = parts.pop(0)
        if name not in MODELS:
            raise LatencyModelError(f"--latency: unknown model {name!r}; known: "
                                    f"{', '.join([NONE, *MODELS])}, or figures like "
                                    f"ms=30,mb_per_s=90")
        base = MODELS[name]
    figures: dict[str, float] = {}
    for part in parts:
        key, _, value = part.partition("=")
        key = key.strip()
        if key == "mbps":
            raise LatencyModelError(
                f"--latency {spec!r}: 'mbps' is ambiguous (megabits or megabytes per second?); "
                f"write mb_per_s=<megabytes per second per stream>")
        if key not in _SPEC_KEYS or not value.strip():
            raise LatencyModelError(
                f"--latency {spec!r}: can't read {part!r}; figures are first_byte_ms (or ms) "
                f"and mb_per_s, as key=value, after an optional model name")
        try:
            figures[_SPEC_KEYS[key]] = float(value)
        except ValueError:
            raise LatencyModelError(f"--latency {spec!r}: {key} must be a number, got "
                                    f"{value.strip()!r}") from None
    if base is None:
        return LatencyModel("custom", figures.get("first_byte_ms", 0.0),
                            figures.get("mb_per_s"))
    if not figures:
        return base
    return LatencyModel(f"{base.name} (changed: {', '.join(f'{k}={v:g}' for k, v in figures.items())})",
                        figures.get("first_byte_ms", base.first_byte_ms),
                        figures.get("mb_per_s", base.mb_per_s), base.source)


def behind_latency(url: str, storage_options: Mapping[str, Any] | None,
                   model: LatencyModel | None, log_dir: str | None = None
                   ) -> tuple[str, dict[str, Any]]:
    """``url`` (a local path, ``file://``, ``s3://`` ...) and its storage options seen through
    ``kslatency://`` with ``model``; unchanged when ``model`` is None."""
    if model is None:
        return str(url), dict(storage_options or {})
    protocol, path = fsspec.core.split_protocol(str(url))
    if protocol in (None, "file", "local"):
        protocol, path = "file", os.path.abspath(path)
    return (f"{PROTOCOL}://{path}",
            model.storage_options(protocol, storage_options, log_dir))


def model_of_options(model: str | None = None, first_byte_ms: float | None = None,
                     mb_per_s: float | None = None) -> LatencyModel:
    """The model of ``kslatency://``'s storage options: the figures of ``model`` (a name of
    :data:`MODELS`; None: :data:`DEFAULT_MODEL`), each replaced where ``first_byte_ms`` or
    ``mb_per_s`` is given. Any other ``model`` is a label for figures given by hand: it needs
    ``first_byte_ms``, and without ``mb_per_s`` has no bandwidth limit."""
    base = MODELS.get(model or DEFAULT_MODEL)
    if base is None:
        if first_byte_ms is None:
            raise LatencyModelError(
                f"kslatency: unknown model {model!r} and no first_byte_ms; give a known model "
                f"({', '.join(MODELS)}) or the figures first_byte_ms (and mb_per_s)")
        return LatencyModel(str(model), first_byte_ms, mb_per_s)
    if first_byte_ms in (None, base.first_byte_ms) and mb_per_s in (None, base.mb_per_s):
        return base
    return LatencyModel(f"{base.name} (changed)",
                        base.first_byte_ms if first_byte_ms is None else first_byte_ms,
                        base.mb_per_s if mb_per_s is None else mb_per_s, base.source)
