"""The functional API: ``save``, ``restore``, ``open`` and ``annotate``.

This module is the public face: it re-exports. The work (and the documentation of each
function) lives in the checkpoint core (:mod:`stepvault.core`) and the catalog
(:mod:`stepvault.catalog`), which the :class:`CheckpointManager`, the distributed layer
and the ops use directly.
"""

from __future__ import annotations

from .catalog.annotations import annotate
from .core.info import RestoreInfo, SaveInfo, SkippedCheckpoint
from .core.opened import open_vault as open
from .core.restore import restore
from .core.write import save
from .format.settings import DEFAULT_STORE_SETTINGS

__all__ = [
    "DEFAULT_STORE_SETTINGS",
    "RestoreInfo",
    "SaveInfo",
    "SkippedCheckpoint",
    "annotate",
    "open",
    "restore",
    "save",
]
