"""Helpers every ``keyedstate`` command module shares: option parsing and byte formatting."""

from __future__ import annotations

import json
from typing import Any

import click


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """``--storage-options JSON``: the fsspec options as a dict ({} when not given); anything
    but a JSON object is a ``click.BadParameter`` naming the option."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--storage-options") from exc
    if not isinstance(options, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--storage-options")
    return options


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB (one decimal above bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
