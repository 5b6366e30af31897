"""What the manager may read of a state before a save is due, to prepare its staging.

A due save calls ``state_dict()`` of every object in the state; a preparation at
``restore()`` or at a ``save()`` that is not due must not call more of them than the user
asked for: a user object's ``state_dict()`` may have effects (torchdata's
``StatefulDataLoader`` draws its iterator seed from its generator, which broke a bitwise
resume). So an implicit preparation reads only what has no effects, modules' and
optimizers' tensors (almost all of a state's bytes), and leaves room for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

#: Room left in a block prepared from part of a state, for the entries it could not read
#: (RNG states, small buffers of user objects); a larger rest makes the first due save
#: synchronous, and the staging is prepared for the whole state from then on.
RESERVE = 1 << 20


def _plain(value: Any) -> bool:
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, np.ndarray)):
        return True
    if isinstance(value, (str, bytes, int, float, bool, type(None))):
        return True
    if isinstance(value, Mapping):
        return all(_plain(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False


def readable_part(state: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """``(the entries of state whose snapshot has no side effects, bytes to reserve)``."""
    part = {k: v for k, v in state.items() if _plain(v)}
    whole = len(part) == len(state)
    return part, 0 if whole else RESERVE


def still_growing(state: Mapping[str, Any]) -> bool:
    """Whether the state will grow before it is saved: an optimizer that has parameters
    but no per-parameter state yet (Adam's moments appear at its first step), as on a
    fresh start. Buffers prepared now would be too small for the first due save."""

    def lazy(value: Any) -> bool:
        if isinstance(value, torch.optim.Optimizer):
            has_params = any(g["params"] for g in value.param_groups)
            return has_params and not value.state
        if isinstance(value, Mapping):
            return any(lazy(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(lazy(v) for v in value)
        return False

    return lazy(state)


class Preparer:
    """Gets an async manager's staging buffers ready before its first due save.

    ``prepare`` (explicit) snapshots what it is given; ``soon`` (a non-due ``save()`` or a
    ``restore()``, the manager's first sight of the state) only the readable part, until
    buffers are ready, and once more when the state reached its final shape (an optimizer's
    moments appear at its first step), queued behind a preparation still running.
    ``enabled`` is False where nothing is staged (synchronous or collective managers).
    """

    def __init__(self, staging: Any, *, enabled: bool) -> None:
        self.staging = staging
        self.enabled = enabled
        self._final = False  # prepared from the state as it will be saved

    def prepare(
        self,
        state: Mapping[str, Any],
        *,
        implicit: bool,
        wait: bool = False,
        partial: bool = False,
    ) -> None:
        if not self.enabled:
            return
        from ..state.snapshot import take_snapshot

        reserve = RESERVE if partial else 0
        # Prepared from a state that will still grow (a fresh optimizer): prepare again at
        # a later non-due save, or the first due save would find the buffers too small.
        self._final = not still_growing(state)
        if implicit:  # only what a snapshot reads without effects
            state, reserve = readable_part(state)
        # The snapshot (state_dict() calls) runs here, on the caller's thread, where the
        # state may be read; only the allocation and page faults run in the background.
        self.staging.prepare(take_snapshot(state, kind="full").arrays, reserve=reserve)
        if wait:
            self.staging.wait_prepared()

    def soon(self, state: Mapping[str, Any]) -> None:
        staging = self.staging
        first = not staging.ready and not staging.preparing
        again = (
            (staging.ready or staging.preparing) and not self._final and not still_growing(state)
        )
        if first or again:
            try:
                self.prepare(state, implicit=True)
            except (TypeError, ValueError):
                pass  # a state that cannot be saved fails at its due save, with the message
