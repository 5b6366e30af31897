"""A checkpoint one process wrote, restored on every rank of a process group: checked
against each rank's live state in the names and global shapes DCP uses (so it fits a
DDP, FSDP2 or FSDP1 copy of its model, FSDP1's flat parameters included), read whole and
verified, then handed to ``set_state_dict(full_state_dict=True)``, which keeps each
rank's shards. What an imported Accelerate or Trainer folder, or a checkpoint of a
single-process run, needs to resume a sharded job.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..errors import StepvaultError
from .state import _pairs


def _param_fqns(model: torch.nn.Module) -> dict[int, list[str]]:
    """``id(live parameter)`` -> the names DCP's state dicts give it, in order.

    One name for a parameter of a plain, DDP, compiled, FSDP2 or FSDP1 ``use_orig_params``
    module (wrapper prefixes such as ``module.`` and ``_fsdp_wrapped_module.`` dropped);
    for an FSDP1 ``FlatParameter`` (``use_orig_params=False``) the names of every original
    parameter it holds, in its flattening order, which is the order FSDP1's optimizer state
    dict lists them in. torch's ``_get_fqns`` is private: it is the mapping
    ``get_state_dict``/``set_state_dict`` themselves use, so the names agree with theirs.
    """
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out: dict[int, list[str]] = {}
    for name, param in model.named_parameters():
        fqns = _get_fqns(model, name)
        inner = getattr(param, "_fqns", None)  # FSDP1 FlatParameter: its originals' names
        out[id(param)] = _flat_order(fqns, inner, name) if inner else list(fqns)
    return out


def _flat_order(fqns: set[str], inner: list[str], name: str) -> list[str]:
    """``fqns`` (the full names of a FlatParameter's originals: the common module prefix
    + each of ``inner``, the names relative to its FSDP module) in ``inner``'s order."""
    for full in fqns:
        if full == inner[0] or full.endswith("." + inner[0]):
            prefix = full[: len(full) - len(inner[0])]
            ordered = [prefix + rel for rel in inner]
            if set(ordered) == fqns:
                return ordered
    raise StepvaultError(
        f"{name}: cannot order the names of this FSDP1 flat parameter's originals "
        f"({sorted(fqns)}); save with use_orig_params=True or FSDP2"
    )


def _fqn_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, native: dict):
    """A native (index-keyed) optimizer state dict re-keyed by parameter name, the form
    ``set_state_dict`` takes. Index i is the i-th parameter over the param groups, in
    order, counted as one process holds them: an FSDP1 flat parameter counts as the
    original parameters it holds (:func:`_param_fqns`)."""
    names = _param_fqns(model)
    live_groups = [[f for p in g["params"] for f in names[id(p)]] for g in opt.param_groups]
    order = [f for fqns in live_groups for f in fqns]
    groups = []
    index_to_name: dict[Any, str] = {}
    for saved_group, fqns in zip(native["param_groups"], live_groups):
        group = dict(saved_group)
        index_to_name.update(zip(saved_group["params"], fqns))
        group["params"] = fqns
        groups.append(group)
    state = {
        index_to_name.get(k, order[k] if isinstance(k, int) and k < len(order) else k): v
        for k, v in native["state"].items()
    }
    return {"state": state, "param_groups": groups}


class _OptimizerView(torch.optim.Optimizer):
    """What :func:`validate` compares a checkpoint's optimizer with when the live one is
    sharded: its param groups list one meta tensor per parameter *name*, with the global
    shape (an FSDP1 flat parameter as each original parameter it holds; an FSDP1 or FSDP2
    shard as the whole parameter), as a one-process checkpoint numbers them."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        # No Optimizer.__init__: this view steps nothing, validate reads param_groups only.
        self.param_groups = param_groups


def _optimizer_view(
    model: torch.nn.Module, opt: torch.optim.Optimizer, shapes: Mapping[str, Any]
) -> _OptimizerView:
    """``opt`` as a one-process checkpoint of it looks (see :class:`_OptimizerView`);
    ``shapes``: the model's state dict by DCP name (its tensors' global shapes)."""
    names = _param_fqns(model)
    groups = []
    for group in opt.param_groups:
        params = []
        for p in group["params"]:
            for fqn in names.get(id(p), []):
                held = shapes.get(fqn)
                shape = held.shape if isinstance(held, torch.Tensor) else p.shape
                params.append(torch.empty(shape, device="meta"))
        groups.append({"params": params})
    return _OptimizerView(groups)


class _StateDictView(torch.nn.Module):
    """A module whose ``state_dict()`` is the given one: what :func:`validate` compares
    with when the live module is wrapped (DDP's ``module.`` prefix, FSDP2's DTensors)."""

    def __init__(self, view: dict[str, Any]) -> None:
        super().__init__()
        self._view = view

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._view


def full_checkpoint_problems(
    state: Mapping[str, Any],
    saved: Mapping[str, Any],
    kinds: Mapping[str, str],
    *,
    strict: bool = True,
) -> list[str]:
    """Every reason the single-process checkpoint tree ``saved`` (meta tensors are enough)
    cannot restore the live ``state`` of this rank; empty when it fits.

    Modules are compared by DCP's parameter names on both sides (``get_model_state_dict``
    live; DDP's ``module.`` and compile's ``_orig_mod.`` prefixes dropped from the saved
    names), so a checkpoint fits the wrapped live copy of its model, and an FSDP2 DTensor
    by its global shape. An optimizer of a module in the state is compared the same way,
    by parameter name and global shape (an FSDP1 flat parameter as the original parameters
    it holds), as :func:`restore_full_checkpoint` maps it. With ``strict`` every live
    entry, and every key of a live module, must be in the checkpoint. Entries only the
    checkpoint has are not loaded, as in a DCP load.
    """
    from ..state.apply import validate

    view: dict[str, Any] = {}
    wanted: dict[str, Any] = {}
    shapes: dict[str, Mapping[str, Any]] = {}
    for key, obj in state.items():
        view[key] = obj
        if key not in saved:
            continue
        wanted[key] = saved[key]
        if isinstance(obj, torch.nn.Module):
            shapes[key] = get_model_state_dict(obj)
            view[key] = _StateDictView(dict(shapes[key]))
            if isinstance(saved[key], Mapping):
                wanted[key] = {_unwrapped_name(k): v for k, v in saved[key].items()}
    # An optimizer of a module in the state is compared by parameter name and global
    # shape, as restore_full_checkpoint maps it: its live parameters may be FSDP1 flat
    # parameters (several per name) or shards (a local shape).
    for opt_key, mod_key in _pairs(state, refuse=False).items():
        if opt_key in wanted and mod_key in shapes:
            view[opt_key] = _optimizer_view(state[mod_key], state[opt_key], shapes[mod_key])
    return validate(view, wanted, dict(kinds), strict=strict)


def _unwrapped_name(name: str) -> str:
    """``name`` without the wrappers' prefixes (DDP's ``module.``, compile's ``_orig_mod.``),
    as DCP names a parameter."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.partition(".")[2]
    return name


def _read_checked(
    store: Any, state: Mapping[str, Any], run: str, step: int, workers: int | None
) -> tuple[Any, dict[str, Any]]:
    """``run@step`` checked against the live state before a byte is read (a mismatch is a
    :class:`StateMismatchError`, nothing changed), then read whole and verified."""
    from ..engine import CheckpointReader
    from ..errors import ManifestError, StateMismatchError
    from ..format import decode_value, parse_manifest

    manifest = parse_manifest(store.read_manifest(run, step), f"{run}@{step}")
    reader = CheckpointReader(store, manifest, workers=workers)

    def entry(kind: str, name: str) -> None:
        stored = manifest.tensors.get(name)
        if stored is None or stored.kind != kind:
            raise ManifestError(f"{run}@{step}: state references unknown {kind} {name!r}")

    def stand_in(kind: str, name: str) -> Any:
        entry(kind, name)
        return reader.meta(name)

    meta = decode_value(manifest.state, stand_in)
    problems = full_checkpoint_problems(state, meta, manifest.state_kinds)
    if problems:
        raise StateMismatchError(problems)
    arrays = reader.read_all()  # every object verified before any is returned

    def stored(kind: str, name: str) -> Any:
        entry(kind, name)
        return arrays[name]

    return manifest, decode_value(manifest.state, stored)


def restore_full_checkpoint(
    store,
    state: MutableMapping[str, Any],
    run: str,
    step: int,
    *,
    workers: int | None = None,
    loaded: tuple[Any, dict[str, Any]] | None = None,
) -> None:
    """Load a single-process checkpoint on every rank: check it against the live state
    (:func:`full_checkpoint_problems`; a mismatch raises :class:`StateMismatchError` with
    nothing read or changed), read it whole (verified), then let
    ``set_state_dict(full_state_dict=True)`` keep each rank's shards. ``loaded``: its
    ``(manifest, tree)`` already read, verified and checked (the restore planner's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from ..state.apply import apply

    if loaded is None:
        _manifest, tree = _read_checked(store, state, run, step, workers)
    else:
        _manifest, tree = loaded
    pairs = _pairs(state)
    full = StateDictOptions(full_state_dict=True)
    rest_state, rest_tree, rest_kinds = {}, {}, {}
    for key, obj in state.items():
        if isinstance(obj, torch.optim.Optimizer):
            continue
        if isinstance(obj, torch.nn.Module):
            opts = [k for k, m in pairs.items() if m == key]
            if opts:
                for opt_key in opts:
                    osd = _fqn_optimizer_state(obj, state[opt_key], tree[opt_key])
                    set_state_dict(
                        obj,
                        state[opt_key],
                        model_state_dict=tree[key],
                        optim_state_dict=osd,
                        options=full,
                    )
            else:
                set_model_state_dict(obj, tree[key], options=full)
            continue
        if key not in tree:  # strict=False passed the fit check: it keeps its live value
            continue
        rest_state[key], rest_tree[key] = obj, tree[key]
        rest_kinds[key] = _manifest.state_kinds.get(key, "value")
    apply(rest_state, rest_tree, rest_kinds, strict=False)
    for key, value in rest_state.items():
        state[key] = value
