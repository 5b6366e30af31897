"""Restoring with ``assign=True``: the live objects take the stored tensors themselves.

Instead of copying verified bytes into the live tensors (:mod:`.placement`), every tensor
is read as a view of its object's private copy-on-write mapping (zero-copy where the
object is raw on a local store) and modules get them through
``load_state_dict(assign=True)``. For jobs that read a checkpoint once (inference,
evaluation, export): no second copy of the weights, and pages are shared with the page
cache until written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..engine.reader import CheckpointReader, PendingArray
from .capture import kind_of
from .placement import _materialize


def _module_tree(
    module: torch.nn.Module, saved: dict[str, Any], reader: CheckpointReader
) -> dict[str, Any]:
    # Tied parameters (a decoder sharing its embedding) are one object in the live module;
    # assigning two separate tensors would untie them. The reader hands deduplicated bytes
    # out as separate tensors (no aliasing), so ties are rebuilt from the live module.
    live = module.state_dict(keep_vars=True)
    by_live: dict[int, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for name, value in saved.items():
        target = live.get(name)
        if not isinstance(value, PendingArray) or not isinstance(target, torch.Tensor):
            out[name] = _materialize(value, reader)
            continue
        tensor = reader.read(value.name)
        first = by_live.get(id(target))
        if first is not None and torch.equal(first, tensor):
            out[name] = first  # tied live, saved equal (a tied save stores the same bytes)
            continue
        if isinstance(target, torch.nn.Parameter):
            # One Parameter for every name of a tied one (torch would wrap each name's
            # tensor in a Parameter of its own).
            tensor = torch.nn.Parameter(tensor, requires_grad=target.requires_grad)
        out[name] = tensor
        by_live.setdefault(id(target), tensor)
    return out


def mapped_tree(
    state: Mapping[str, Any], tree: dict[str, Any], reader: CheckpointReader
) -> dict[str, Any]:
    """``tree`` with every stored tensor read as a (mapped, verified) tensor of its own.

    Call only after every object was verified and the tree was validated against the
    state; nothing live is changed here.
    """
    out: dict[str, Any] = {}
    for key, saved in tree.items():
        live = state.get(key)
        if live is not None and kind_of(live) == "module" and isinstance(saved, dict):
            out[key] = _module_tree(live, saved, reader)
        else:
            out[key] = _materialize(saved, reader)
    return out
