"""Exact data positions under Lightning: the train loaders become :class:`ResumableLoader`\\ s.

Lightning saves and restores the position of a loader that has ``state_dict`` /
``load_state_dict`` (torchdata's ``StatefulDataLoader``) and restarts the epoch of any other
loader. Its fit loop processes the train loaders (``DistributedSampler`` injection and the
like), loads their saved states and then builds the epoch's iterator; the loaders are
wrapped at that point, just before the states are loaded, so that

* an ordinary ``DataLoader`` resumes mid-epoch with the same order and the same remaining
  batches (the epoch's generator states are replayed, the consumed batches skipped);
* a ``StatefulDataLoader`` keeps its own state and gets its generators back once the
  restored iterator exists (torchdata leaves them one draw short, which reshuffles every
  later epoch differently; see INTEGRATIONS.md, "Exact resume").

The hook point is a private method of Lightning's ``_FitLoop`` (2.x); without it the
loaders are left as they are, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from ..state.dataloader import resumable

_HOOK = "_load_combined_loader_states"


def install_resumable_loaders(fit_loop: Any) -> Callable[[], None] | None:
    """Wrap the fit loop's train loaders each time it (re)loads them; returns the undo."""
    original = getattr(fit_loop, _HOOK, None)
    if not callable(original) or not hasattr(fit_loop, "_combined_loader"):
        warnings.warn(
            "stepvault: this Lightning version has no FitLoop."
            f"{_HOOK}(); train loaders are not made resumable (an ordinary DataLoader "
            "restarts its epoch on resume, a StatefulDataLoader reshuffles later epochs)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None

    def wrap_then_load() -> None:
        combined = fit_loop._combined_loader
        if combined is not None:
            combined.flattened = [
                # Lightning counts an epoch's batches and never asks a finished iterator
                # again: a checkpoint after the last batch resumes with the next epoch.
                resumable(dl, at_epoch_end="next") if isinstance(dl, DataLoader) else dl
                for dl in combined.flattened
            ]
        original()

    setattr(fit_loop, _HOOK, wrap_then_load)

    def uninstall() -> None:
        if vars(fit_loop).get(_HOOK) is wrap_then_load:
            delattr(fit_loop, _HOOK)

    return uninstall
