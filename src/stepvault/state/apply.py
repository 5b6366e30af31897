"""Restored tree → live objects: validate everything first, mutate only when all fits."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import numpy as np
import torch

from ..errors import StateMismatchError
from .capture import class_name, kind_of

# Optimizer state entries that always have their parameter's shape (torch's optimizers).
_PER_ELEMENT = {
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "momentum_buffer",
    "square_avg",
    "acc_delta",
    "sum",
    "ax",
    "prev",
    "exp_inf",
    "mu_product_buf",
    "grad_avg",
}


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor | np.ndarray):
        return f"{tuple(v.shape)} {v.dtype}"
    return type(v).__name__


def tied_aliases(live: dict[str, Any], saved: Any) -> set[str]:
    """Live keys absent from ``saved`` whose tensor *is* one that ``saved`` holds (tied
    weights: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``). ``save_pretrained``
    writes such a tensor once; restoring the name it kept restores both."""
    held = {
        (v.data_ptr(), v.shape, v.stride())
        for k, v in live.items()
        if k in saved and isinstance(v, torch.Tensor) and v.numel()
    }
    return {
        k
        for k, v in live.items()
        if k not in saved
        and isinstance(v, torch.Tensor)
        and v.numel()
        and (v.data_ptr(), v.shape, v.stride()) in held
    }


def _check_module(key: str, module: torch.nn.Module, saved: Any, strict: bool) -> list[str]:
    if not isinstance(saved, dict):
        return [f"{key}: checkpoint holds {type(saved).__name__}, expected a module state dict"]
    problems = []
    live = module.state_dict()
    tied = tied_aliases(live, saved)
    missing = [k for k in live if k not in saved and k not in tied]
    unexpected = [k for k in saved if k not in live]
    if strict and missing:
        problems.append(
            f"{key}: missing keys in checkpoint: {', '.join(missing[:20])}"
            + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else "")
        )
    if strict and unexpected:
        problems.append(
            f"{key}: unexpected keys in checkpoint: {', '.join(unexpected[:20])}"
            + (f" (+{len(unexpected) - 20} more)" if len(unexpected) > 20 else "")
        )
    for k, v in live.items():
        s = saved.get(k)
        if isinstance(v, torch.Tensor) and s is not None:
            if not isinstance(s, torch.Tensor):
                problems.append(f"{key}.{k}: checkpoint holds {_describe(s)}, live is a tensor")
            elif s.shape != v.shape:
                problems.append(
                    f"{key}.{k}: shape {tuple(s.shape)} in checkpoint, {tuple(v.shape)} live"
                )
            elif s.dtype != v.dtype:
                problems.append(f"{key}.{k}: dtype {s.dtype} in checkpoint, {v.dtype} live")
    return problems


def _check_optimizer(key: str, opt: torch.optim.Optimizer, saved: Any) -> list[str]:
    if not isinstance(saved, dict) or "param_groups" not in saved or "state" not in saved:
        return [f"{key}: checkpoint does not hold an optimizer state dict"]
    groups, live_groups = saved["param_groups"], opt.param_groups
    if len(groups) != len(live_groups):
        return [f"{key}: {len(groups)} param groups in checkpoint, {len(live_groups)} live"]
    problems = _other_optimizer(key, opt, saved)
    if problems:
        return problems
    index_to_param: dict[Any, torch.Tensor] = {}
    for i, (g, lg) in enumerate(zip(groups, live_groups)):
        if len(g["params"]) != len(lg["params"]):
            problems.append(
                f"{key}: param group {i} has {len(g['params'])} params in checkpoint, "
                f"{len(lg['params'])} live"
            )
            continue
        index_to_param.update(zip(g["params"], lg["params"]))
    for idx, pstate in saved["state"].items():
        param = index_to_param.get(idx)
        if param is None or not isinstance(pstate, dict):
            continue
        for name, value in pstate.items():
            per_element = name in _PER_ELEMENT and isinstance(value, torch.Tensor)
            if per_element and value.shape != param.shape:
                problems.append(
                    f"{key}: state[{idx}][{name!r}] has shape {tuple(value.shape)}, its "
                    f"parameter {tuple(param.shape)}"
                )
    return problems


def _other_optimizer(key: str, opt: torch.optim.Optimizer, saved: dict[str, Any]) -> list[str]:
    """A checkpoint of another kind of optimizer (AdamW's state into an SGD): its param
    groups have settings the live one lacks *and* lack settings it has (a checkpoint of an
    older or newer torch differs in one direction only: a setting added since), or a
    parameter's state has none of the entries the live one keeps for it. Loading it would
    replace SGD's momentum with AdamW's moments and break the next step."""
    saved_keys = {k for g in saved["param_groups"] if isinstance(g, dict) for k in g}
    live_keys = {k for g in opt.param_groups for k in g}
    extra, missing = sorted(saved_keys - live_keys), sorted(live_keys - saved_keys)
    # The live entries by state-dict index (params numbered across groups, as torch does);
    # read from ``opt.state``: a view of a sharded optimizer has param groups only.
    held = getattr(opt, "state", None) or {}
    params = [p for g in opt.param_groups for p in g["params"]]
    live_state = {i: set(held[p]) for i, p in enumerate(params) if held.get(p)}
    clash = [
        i
        for i, pstate in saved["state"].items()
        if isinstance(pstate, dict)
        and pstate
        and i in live_state
        and not set(pstate) & live_state[i]
    ]
    if not (extra and missing) and not clash:
        return []
    kind = type(opt).__name__
    if extra and missing:
        detail = (
            f"its param groups have {', '.join(extra[:6])}, which a {kind} lacks, and lack "
            f"{', '.join(missing[:6])}"
        )
    else:
        i = clash[0]
        detail = (
            f"state[{i}] holds {', '.join(sorted(saved['state'][i]))}, the live {kind} keeps "
            f"{', '.join(sorted(live_state[i]))}"
        )
    return [
        f"{key}: checkpoint holds the state of another kind of optimizer ({detail}); "
        "build the optimizer the checkpoint was saved with, or leave it out of the restore"
    ]


def _check_stateful(key: str, obj: Any, saved: Any, saved_kind: str) -> list[str]:
    stored_cls = saved_kind.partition(":")[2]
    if stored_cls and stored_cls != class_name(obj):
        return [f"{key}: checkpoint holds state of {stored_cls}, live object is {class_name(obj)}"]
    live = obj.state_dict()
    if isinstance(live, dict):
        if not isinstance(saved, dict):
            return [f"{key}: checkpoint holds {type(saved).__name__}, expected a dict"]
        missing = [k for k in live if k not in saved]
        if missing:
            return [f"{key}: keys missing in checkpoint: {', '.join(map(str, missing[:20]))}"]
    return []


def _check_array(key: str, live: Any, saved: Any) -> list[str]:
    if type(saved) is not type(live) and not (
        isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor)
    ):
        return [f"{key}: checkpoint holds {_describe(saved)}, live is {_describe(live)}"]
    if tuple(saved.shape) != tuple(live.shape) or saved.dtype != live.dtype:
        return [f"{key}: checkpoint holds {_describe(saved)}, live is {_describe(live)}"]
    return []


def validate(
    state: MutableMapping[str, Any],
    restored: dict[str, Any],
    kinds: dict[str, str],
    *,
    strict: bool = True,
) -> list[str]:
    """Every problem that would stop ``apply``; empty when the checkpoint fits."""
    problems: list[str] = []
    for key, obj in state.items():
        if key not in restored:
            if strict:
                problems.append(
                    f"{key}: not in checkpoint (it has: {', '.join(restored)}); restore with "
                    "strict=False to keep its live value"
                )
            continue
        saved, saved_kind = restored[key], kinds.get(key, "value")
        live_kind = kind_of(obj)
        base_kind = saved_kind.partition(":")[0]
        if live_kind in ("module", "optimizer", "stateful") and base_kind != live_kind:
            problems.append(f"{key}: checkpoint holds a {base_kind}, live object is a {live_kind}")
            continue
        if live_kind == "module":
            problems += _check_module(key, obj, saved, strict)
        elif live_kind == "optimizer":
            problems += _check_optimizer(key, obj, saved)
        elif live_kind == "stateful":
            problems += _check_stateful(key, obj, saved, saved_kind)
        elif live_kind in ("tensor", "ndarray"):
            problems += _check_array(key, obj, saved)
    if strict:
        extra = [k for k in restored if k not in state]
        if extra:
            problems.append(
                f"checkpoint has entries the live state lacks: {', '.join(extra)} "
                "(add them to the state, or restore with strict=False)"
            )
    return problems


def apply(
    state: MutableMapping[str, Any],
    restored: dict[str, Any],
    kinds: dict[str, str],
    *,
    strict: bool = True,
    validated: bool = False,
    assign: bool = False,
) -> None:
    """Validate (unless ``validated``), then load ``restored`` into ``state`` in place.

    Entries marked placed (see :mod:`.placement`) already hold their bytes and are skipped.
    ``assign``: modules take the restored tensors themselves
    (``load_state_dict(assign=True)``) and top-level tensors are replaced in ``state``.
    """
    from .placement import Placed

    if not validated:
        problems = validate(state, restored, kinds, strict=strict)
        if problems:
            raise StateMismatchError(problems)
    for key, obj in list(state.items()):
        if key not in restored:
            continue
        saved = restored[key]
        if isinstance(saved, Placed):
            continue
        kind = kind_of(obj)
        if kind == "module":
            rest = {k: v for k, v in saved.items() if not isinstance(v, Placed)}
            if len(rest) == len(saved):
                # A tied alias left out of the checkpoint is loaded through its twin (in
                # place: assigning a new tensor to one name would untie them).
                tied = bool(tied_aliases(obj.state_dict(), saved))
                obj.load_state_dict(saved, strict=strict and not tied, assign=assign and not tied)
            elif rest:
                # Key sets were checked by validate(); the placed tensors are loaded already.
                obj.load_state_dict(rest, strict=False)
        elif kind in ("optimizer", "stateful"):
            obj.load_state_dict(saved)
        elif kind == "tensor" and assign:
            state[key] = saved
        elif kind == "tensor":
            with torch.no_grad():
                obj.copy_(saved)
        elif kind == "ndarray" and obj.flags.writeable:
            obj[...] = saved
        else:
            state[key] = saved
