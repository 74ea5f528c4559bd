"""Per-state sizes of a heap snapshot (``keyedstate checkpoints show``)."""

from __future__ import annotations

from collections import defaultdict

from keyedstate.backends.base.backend import OTHER_FILES
from keyedstate.backends.heap.restore import chain_of, read_footer
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.handles import KeyedStateHandle


def state_sizes(storage: CheckpointStorage, handle: KeyedStateHandle) -> dict[str, int]:
    """Bytes of each state's sections in one subtask's heap files (their footers index them
    per state and key group), plus :data:`OTHER_FILES` (footers, private files)."""
    sizes: dict[str, int] = defaultdict(int)
    for _, stream in chain_of(handle):
        data = storage.read_verified(stream)
        footer = read_footer(data, storage.url_of(stream.path))
        owned = 0
        for section in footer.sections:
            sizes[footer.states[section.state].meta.name] += section.length
            owned += section.length
        sizes[OTHER_FILES] += len(data) - owned
    for stream in handle.private.values():
        sizes[OTHER_FILES] += stream.length
    return sizes
