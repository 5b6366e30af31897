"""Training state ↔ DCP state dicts, so ``stepvault.save/restore`` work on every rank.

Modules and their optimizers go through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``): FQN-keyed, DTensor-aware, correct for DDP and
FSDP2 and loadable on another world size. An optimizer is paired automatically with the
module that owns its parameters. RNG states are per rank (each rank's own key); other
``state_dict()`` objects and plain values are treated as global (rank 0's copy is kept).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from .._rank import current_rank
from ..errors import StepvaultError
from ..state.capture import is_stateful
from ..state.rng import RNGState


def distributed_active() -> bool:
    """A process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def has_dtensor(value: Any) -> bool:
    """Whether any tensor reachable from ``value`` (modules, optimizers, dicts) is a DTensor."""
    if isinstance(value, DTensor):
        return True
    if isinstance(value, torch.nn.Module):
        return any(isinstance(p, DTensor) for p in value.parameters())
    if isinstance(value, torch.optim.Optimizer):
        return any(isinstance(p, DTensor) for g in value.param_groups for p in g["params"])
    if isinstance(value, Mapping):
        return any(has_dtensor(v) for v in value.values())
    return False


def _pairs(state: Mapping[str, Any], *, refuse: bool = True) -> dict[str, str]:
    """optimizer key -> key of the module that owns all of its parameters (an optimizer
    without one is refused, or with ``refuse=False`` left out)."""
    owners = {
        key: {id(p) for p in obj.parameters()}
        for key, obj in state.items()
        if isinstance(obj, torch.nn.Module)
    }
    pairs = {}
    for key, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        params = {id(p) for g in obj.param_groups for p in g["params"]}
        owner = next((m for m, ids in owners.items() if params <= ids), None)
        if owner is None and not refuse:
            continue
        if owner is None:
            raise StepvaultError(
                f"state[{key!r}]: a distributed save needs the module this optimizer trains "
                "in the same state (to key its state by parameter name); add the model"
            )
        pairs[key] = owner
    return pairs


def to_dcp(
    state: Mapping[str, Any], *, for_save: bool = False
) -> tuple[dict[str, Any], dict[str, str]]:
    """The DCP state dict of ``state`` and the kind of each top-level entry.

    ``get_state_dict`` gives an optimizer without state one (a zero-lr step: AdamW then
    holds step 1 and zero moments), which a load needs as its destination. A save must
    not change training: with ``for_save`` such an optimizer is emptied again right after
    (the state dict keeps the tensors it saves), so the first real step runs as without
    the save.
    """
    if not for_save:
        return _to_dcp(state)
    fresh = [o for o in state.values() if isinstance(o, torch.optim.Optimizer) and not o.state]
    try:
        return _to_dcp(state)
    finally:
        for opt in fresh:
            opt.state.clear()


def per_rank(obj: Any) -> bool:
    """Whether ``obj``'s state is its rank's own, like an RNG's: a data loader (each rank
    reads its own part of the data, with its own generator; ``ResumableLoader``,
    torchdata's ``StatefulDataLoader``: a stateful object you iterate). Stored once per
    rank; replicated state is stored once (rank 0's copy)."""
    return callable(getattr(obj, "__iter__", None)) and not isinstance(obj, torch.nn.Module)


def _to_dcp(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    pairs = _pairs(state)
    by_module: dict[str, list[str]] = {}
    for opt_key, mod_key in pairs.items():
        by_module.setdefault(mod_key, []).append(opt_key)
    out: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for key, obj in state.items():
        if isinstance(obj, torch.optim.Optimizer):
            continue  # handled with its module
        if isinstance(obj, torch.nn.Module):
            opts = by_module.get(key, [])
            if len(opts) == 1:
                msd, osd = get_state_dict(obj, state[opts[0]])
                out[key], out[opts[0]] = msd, osd
                kinds[opts[0]] = "optimizer"
            else:
                out[key] = get_model_state_dict(obj)
                for opt_key in opts:  # several optimizers on one model: each on its own
                    out[opt_key] = get_state_dict(obj, state[opt_key])[1]
                    kinds[opt_key] = "optimizer"
            kinds[key] = "module"
        elif isinstance(obj, RNGState):
            out[key] = {f"rank{current_rank()}": obj.state_dict()}
            kinds[key] = "rng"
        elif is_stateful(obj) and per_rank(obj):
            out[key] = {f"rank{current_rank()}": obj.state_dict()}
            kinds[key] = "per_rank"
        elif is_stateful(obj):
            out[key] = obj.state_dict()
            kinds[key] = "stateful"
        elif isinstance(obj, np.ndarray):
            out[key] = torch.from_numpy(np.ascontiguousarray(obj))
            kinds[key] = "ndarray"
        else:
            out[key] = obj
            kinds[key] = "tensor" if isinstance(obj, torch.Tensor) else "value"
    return out, kinds


def apply_dcp(state: MutableMapping[str, Any], loaded: dict[str, Any], kinds: dict[str, str]):
    """Put a loaded DCP state dict back into the live objects of ``state``."""
    pairs = _pairs(state)
    for key, obj in list(state.items()):
        kind = kinds.get(key)
        if kind == "optimizer":
            continue
        if kind == "module":
            opts = [k for k, m in pairs.items() if m == key]
            if len(opts) == 1:
                set_state_dict(
                    obj,
                    state[opts[0]],
                    model_state_dict=loaded[key],
                    optim_state_dict=loaded[opts[0]],
                )
            else:
                set_model_state_dict(obj, loaded[key])
                for opt_key in opts:
                    set_state_dict(
                        obj, state[opt_key], model_state_dict={}, optim_state_dict=loaded[opt_key]
                    )
        elif kind == "rng":
            mine = loaded.get(key, {}).get(f"rank{current_rank()}")
            if mine is None:
                warnings.warn(
                    f"state[{key!r}]: no RNG state for rank {current_rank()} in the checkpoint "
                    "(saved with another world size); RNGs keep their current state",
                    RuntimeWarning,
                    stacklevel=3,
                )
            else:
                obj.load_state_dict(mine)
        elif kind == "per_rank":
            held = loaded.get(key, {})
            mine = held.get(f"rank{current_rank()}")
            if mine is None and "rank0" in held:
                warnings.warn(
                    f"state[{key!r}]: no state of rank {current_rank()} in the checkpoint "
                    "(saved with another world size); it takes rank 0's position",
                    RuntimeWarning,
                    stacklevel=3,
                )
                mine = held["rank0"]
            if mine is not None:
                obj.load_state_dict(mine)
        elif kind == "stateful":
            obj.load_state_dict(loaded[key])
        elif kind == "ndarray":
            obj[...] = loaded[key].numpy()
        elif kind == "tensor":
            pass  # loaded in place by DCP
        else:
            state[key] = loaded[key]
