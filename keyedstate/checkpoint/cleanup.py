"""Clean-up after the commit point: deletions and listings that may fail without harm.

Once a checkpoint's ``_metadata`` is durable it is complete; what follows (subsuming older
checkpoints, dropping files nobody references, an aborted checkpoint's leftovers) only frees
space. So a failure here is logged, never raised: ``keyedstate gc`` finds what is left
(docs/checkpoints.md, "The commit protocol"). The coordinator calls these with its storage.
"""

from __future__ import annotations

import logging
from typing import Iterable

from keyedstate.checkpoint.pending import CompletedCheckpoint
from keyedstate.checkpoint.properties import CLAIMED_FROM
from keyedstate.checkpoint.restore_modes import dispose_claimed_snapshot
from keyedstate.storage.checkpoint_storage import CheckpointStorage
from keyedstate.storage.layout import SHARED_DIR, checkpoint_dir_name, shared_file_prefix

logger = logging.getLogger(__name__)


def written_for(storage: CheckpointStorage, checkpoint_id: int) -> list[str]:
    """Shared files whose name says they were written for ``checkpoint_id`` (one prefix
    listing; a failure is logged, since only clean-up depends on it)."""
    prefix = shared_file_prefix(checkpoint_id)
    try:
        if any(c in storage.root for c in "*?["):  # glob would misread the root
            return [p for p in storage.list_files(SHARED_DIR) if p.startswith(prefix)]
        root = storage.root.rstrip("/") + "/"
        found = storage.fs.glob(storage.path(prefix) + "*")
    except OSError as exc:
        logger.warning("could not list %s*: %s; `keyedstate gc` will find what is left",
                       storage.url_of(prefix), exc)
        return []
    return sorted(p[len(root):] for p in found if p.startswith(root))


def list_quietly(storage: CheckpointStorage, relative: str) -> list[str] | None:
    """Every file below ``relative`` (None: the listing failed, logged)."""
    try:
        return storage.list_files(relative)
    except OSError as exc:
        logger.warning("could not list %s: %s", storage.url_of(relative), exc)
        return None


def delete_quietly(storage: CheckpointStorage, paths: Iterable[str], why: str) -> bool:
    """Delete ``paths``, in one bulk request where the store has one; a failure is
    logged (then each file is tried on its own), since only clean-up depends on it.
    Whether every one is gone."""
    paths = list(paths)
    try:
        storage.delete_many(paths)
        return True
    except OSError:
        pass
    done = True
    for path in paths:
        try:
            storage.delete([path])
        except OSError as exc:
            done = False
            logger.warning("could not delete %s (%s): %s; `keyedstate gc` will find it",
                           storage.url_of(path), why, exc)
    return done


def delete_dir_quietly(storage: CheckpointStorage, relative: str) -> None:
    """Delete the folder ``relative``; a failure is logged."""
    try:
        storage.delete_dir(relative)
    except OSError as exc:
        logger.warning("could not delete %s: %s; `keyedstate gc` will find it",
                       storage.url_of(relative), exc)


def discard_completed(storage: CheckpointStorage, checkpoint: CompletedCheckpoint, *,
                      folder: bool = True) -> bool:
    """Discard a subsumed checkpoint: its claimed snapshot, then its ``_metadata``, then
    (``folder``) its ``chk-<M>/``. Whether its ``_metadata`` is gone; failures are
    logged."""
    # CLAIM restore mode: a checkpoint imported from a claimed snapshot takes the snapshot
    # with it, before its own _metadata goes (a crash in between repeats this on recover).
    claimed = checkpoint.metadata.properties.get(CLAIMED_FROM)
    if claimed:
        try:
            dispose_claimed_snapshot(claimed, storage)
        except Exception as exc:  # the checkpoint that subsumed it is complete: log only
            logger.warning("could not delete the claimed snapshot %s (subsumed with "
                           "checkpoint %d): %s; delete it by hand", claimed,
                           checkpoint.checkpoint_id, exc)
    gone = delete_quietly(storage, [checkpoint.metadata_path],
                          f"subsumed checkpoint {checkpoint.checkpoint_id}")
    if folder:
        delete_dir_quietly(storage, checkpoint_dir_name(checkpoint.checkpoint_id))
    return gone
