"""The checkpoint core, below the public face (:mod:`stepvault.api`).

One module per step of a checkpoint's life, each importable without the others:

- :mod:`.info`: what a save wrote and what a restore loaded (``SaveInfo``, ``RestoreInfo``);
- :mod:`.values`: metrics and user metadata as a manifest stores them;
- :mod:`.scope`: whether a call is collective (every rank, through DCP) or local;
- :mod:`.write`: a new manifest from a snapshot, written and committed (``save``);
- :mod:`.opened`: an opened checkpoint (a manifest parsed once, its reader, its tree);
- :mod:`.restore`: the restore planner: candidates → verify → place (``restore``).

The manager, the distributed layer's callers, the integrations and the ops import from
here; nothing here imports the manager or the face. Names are imported on first use, so
that reading a store (the CLI) does not import torch; ``save`` and ``restore`` are in
:mod:`.write` and :mod:`.restore` (the package names those modules).
"""

from __future__ import annotations

from .._lazy import lazy_getattr

_LAZY = {
    "RestoreInfo": ".info",
    "SaveInfo": ".info",
    "SkippedCheckpoint": ".info",
    "open_vault": ".opened",
    "OpenedCheckpoint": ".opened",
    "open_checkpoint": ".opened",
    "RestorePlanner": ".restore",
    "restore_candidates": ".restore",
    "new_manifest": ".write",
    "open_store_for_writing": ".write",
    "write_manifest": ".write",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


__all__ = sorted(_LAZY)
