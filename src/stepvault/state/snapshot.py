"""A snapshot of a training state: the encoded tree plus references to its tensors.

Taking a snapshot runs on the training thread and is cheap: ``state_dict()`` calls and
the JSON encoding of the small values. Tensor *bytes* are not copied here; the caller
either writes them at once (synchronous save) or stages them into host buffers (async).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..format import Encoder
from .capture import capture


@dataclass
class Snapshot:
    state: Any  # encoded JSON tree (an independent copy of every plain value)
    kinds: dict[str, str]
    arrays: dict[str, Any]  # name -> live torch.Tensor / numpy.ndarray (not copied)


def weights_only(state: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a state that a weights-only checkpoint keeps: its modules."""
    picked = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    if not picked:
        raise ValueError(
            "a weights-only checkpoint needs at least one torch.nn.Module in the state"
        )
    return picked


def take_snapshot(state: Mapping[str, Any], *, kind: str = "full") -> Snapshot:
    """Encode ``state`` (all of it, or only its modules for ``kind="weights"``)."""
    if kind not in ("full", "weights"):
        raise ValueError(f"kind must be 'full' or 'weights', got {kind!r}")
    if kind == "weights":
        state = weights_only(state)
    tree, kinds = capture(state)
    arrays: dict[str, Any] = {}
    encoded = Encoder(arrays.__setitem__).encode(tree)
    return Snapshot(encoded, kinds, arrays)
