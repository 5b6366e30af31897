"""Staging prepared by the framework integrations before their first due save.

A framework asks the manager to save only when a save is due, so the manager never sees
the state before then (no ``restore()`` of a fresh run, no ``save()`` that is not due): its
first save would find no staging buffers ready and be written synchronously. Each
integration therefore hands the bulk of the state (its modules and optimizers: almost all
of the bytes; Lightning's and the Trainer's own values, RNG states and small buffers fit in
the manager's reserve) to :meth:`~stepvault.CheckpointManager.prepare` at train start,
after any resume has loaded the optimizer. On a fresh start Adam's moments appear only at
its first step, so it prepares again at the next step boundary that saves nothing, once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..manager import CheckpointManager
from ..manager.preparing import still_growing


class StagingPreparer:
    """Calls ``mgr.prepare(bulk, partial=True)`` until it was called for the state as it
    will be saved (an optimizer with its per-parameter state)."""

    def __init__(self) -> None:
        self._final = False

    def reset(self) -> None:
        """A new ``fit()``/``train()``: prepare again at its start."""
        self._final = False

    def __call__(self, mgr: CheckpointManager | None, bulk: Mapping[str, Any]) -> None:
        """Prepare ``mgr``'s staging from ``bulk`` unless that was done for its final
        shape already (a no-op without a manager or without ``async_save``)."""
        if self._final or mgr is None or not mgr.async_save:
            return
        mgr.prepare(bulk, partial=True)  # returns at once: the work runs in the background
        self._final = not still_growing(bulk)
