"""Sharded restore on a process group: every rank loads its own shards, resharding as needed.

:func:`load_sharded` loads a DCP state dict in place; :func:`restore_state` is
``stepvault.restore`` on every rank (modules, optimizers, RNGs and values);
:func:`restore_checkpoint` restores one chosen checkpoint and is what the core's restore
planner calls for each candidate. Rank 0 chooses and the ranks agree
(:mod:`.agreement`): on the candidates, on whether the checkpoint fits every rank's live
state, and on damage, before any rank changes its state (invariant 4).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp

from .._rank import current_rank
from ..errors import StateMismatchError, StepvaultError
from ..format import Manifest
from ..store import Store
from .agreement import agree, agree_fits, group_store, handshake, share_offer, try_candidates
from .planners import SafeLoadPlanner
from .state import apply_dcp, to_dcp
from .storage import StepvaultReader

__all__ = ["load_sharded", "restore_checkpoint", "restore_state"]


def load_sharded(
    root: str | os.PathLike[str] | Store,
    state_dict: MutableMapping[str, Any],
    *,
    run: str,
    step: int | Literal["latest"] = "latest",
    workers: int | None = None,
) -> int:
    """Load into ``state_dict`` (in place, resharding as needed); returns the step loaded.

    With ``"latest"`` all ranks agree on the newest checkpoint that every rank could read
    and verify: if any rank finds damage, all ranks fall back together to the next one.
    """
    store = group_store(root, create=False)

    def attempt(candidate: int, manifest: Manifest) -> None:
        if isinstance(state_dict, _Targets):
            state_dict.prune_for(manifest)
        _dcp_load(store, state_dict, run, candidate, manifest, workers)

    offer = share_offer(store, run, lambda: _steps(store, run, step))
    chosen, _, _ = try_candidates(store, run, offer, attempt)
    return chosen


def _steps(store: Store, run: str, step: int | Literal["latest"]) -> tuple[list[int], bool]:
    """``"latest"``: every step, newest first, falling back; a step: that one alone."""
    if step == "latest":
        return list(reversed(store.list_steps(run))), True
    return [int(step)], False


def _dcp_load(
    store: Store,
    targets: MutableMapping[str, Any],
    run: str,
    step: int,
    manifest: Manifest,
    workers: int | None,
    local: bool = False,
) -> None:
    """One DCP load of ``run@step`` (its manifest parsed) into ``targets``: every rank
    verifies what it needs and the ranks agree before any byte is placed. ``local``: this
    process alone, even under a process group (no collective; damage raises here)."""
    reader = StepvaultReader(
        store,
        run,
        step,
        workers=workers,
        manifest=manifest,
        verified=None if local else lambda damage: agree(store, damage, f"{run}@{step}"),
    )
    dcp.load(targets, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=local)


def restore_state(
    root: str | os.PathLike[str] | Store,
    state: MutableMapping[str, Any],
    *,
    run: str,
    step: int | Literal["latest"] = "latest",
    workers: int | None = None,
    timeout: float = 60.0,
    strict: bool = True,
) -> int:
    """``stepvault.restore`` on every rank (resharding to this world size); returns the step.

    ``"latest"`` is the newest checkpoint that every rank verifies (all fall back
    together). The core's restore planner chooses its own candidates and calls
    :func:`try_candidates` with :func:`restore_checkpoint` instead.
    """
    handshake(f"restore {run}", timeout)
    store = group_store(root, create=False)

    def attempt(candidate: int, manifest: Manifest) -> None:
        restore_checkpoint(store, state, run, candidate, manifest, workers=workers, strict=strict)

    # rank 0's view decides, so every rank tries the same list
    offer = share_offer(store, run, lambda: _steps(store, run, step))
    chosen, _, _ = try_candidates(store, run, offer, attempt)
    return chosen


def restore_checkpoint(
    store: Store,
    state: MutableMapping[str, Any],
    run: str,
    step: int,
    manifest: Manifest,
    *,
    workers: int | None = None,
    strict: bool = True,
    local: bool = False,
) -> None:
    """Collective: restore ``run@step`` (``manifest`` already parsed) into the live
    objects of ``state`` on every rank, resharding as needed. ``local`` (a sharded
    checkpoint only): in this process alone, under a process group or not, with no
    collective (a DDP rank reading the full tensors: the core planner's
    ``restore_rank_local``); this rank's own RNG entries are taken where the checkpoint
    has them.

    Invariant 4 on every rank: the checkpoint is checked against the live state (a
    :class:`StateMismatchError` on every rank when it does not fit), every object this
    rank needs is verified and the ranks agree that all did, and only then is live state
    changed. A fresh optimizer that DCP gave a state to build its load targets is emptied
    again when the restore fails.
    """
    fresh = [o for o in state.values() if isinstance(o, torch.optim.Optimizer) and not o.state]
    try:
        if manifest.sharded:
            _restore_sharded(store, state, run, step, manifest, workers, strict, local)
        else:
            _restore_full(store, state, run, step, manifest, workers, strict)
    except BaseException:
        for opt in fresh:
            opt.state.clear()
        raise


def _restore_sharded(
    store: Store,
    state: MutableMapping[str, Any],
    run: str,
    step: int,
    manifest: Manifest,
    workers: int | None,
    strict: bool,
    local: bool = False,
) -> None:
    dcp_state, kinds = to_dcp(state)
    targets = _Targets(store, run, dcp_state, kinds, f"rank{current_rank()}")
    targets.prune_for(manifest)
    problems = _sharded_problems(manifest, targets)
    if not local:
        agree_fits(problems, manifest)
    elif problems:  # this process alone: nothing read yet, nothing changed
        raise StateMismatchError([f"{manifest.run}@{manifest.step}: {p}" for p in problems])
    _dcp_load(store, targets, run, step, manifest, workers, local)
    apply_dcp(state, targets, kinds)


def _restore_full(
    store: Store,
    state: MutableMapping[str, Any],
    run: str,
    step: int,
    manifest: Manifest,
    workers: int | None,
    strict: bool,
) -> None:
    """A checkpoint of one process on every rank: read whole (it fitted in one process
    when it was saved), checked, verified and agreed on; each rank keeps its shards."""
    from ..engine import CheckpointReader
    from ..engine.load import _pick
    from ..format import decode_value
    from .full_checkpoint import full_checkpoint_problems, restore_full_checkpoint

    reader = CheckpointReader(store, manifest, workers=workers)
    meta = decode_value(manifest.state, lambda kind, name: reader.meta(name))
    problems = full_checkpoint_problems(state, meta, manifest.state_kinds, strict=strict)
    agree_fits(problems, manifest)
    damage: BaseException | None = None
    tree: dict[str, Any] = {}
    try:
        arrays = reader.read_all()
        tree = decode_value(manifest.state, lambda kind, name: _pick(arrays, kind, name))
    except StepvaultError as exc:
        damage = exc
    agree(store, damage, f"{run}@{step}")
    restore_full_checkpoint(store, state, run, step, workers=workers, loaded=(manifest, tree))


def _sharded_problems(manifest: Manifest, targets: Mapping[str, Any]) -> list[str]:
    """What stops DCP from loading ``manifest`` into ``targets``: tensors the checkpoint
    lacks or holds with another (global) shape."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    entries = (manifest.sharded or {}).get("entries", {})
    flat, _ = flatten_state_dict(dict(targets))
    problems = []
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        size = tuple(value.size())
        entry = entries.get(fqn)
        if entry is None:
            problems.append(f"{fqn}: not in checkpoint")
        elif entry.get("type") == "tensor" and tuple(entry["size"]) != size:
            problems.append(f"{fqn}: checkpoint has shape {tuple(entry['size'])}, live {size}")
    return problems


class _Targets(dict):
    """The DCP target dict; drops RNG entries of ranks the checkpoint does not have (a
    per-rank data loader state then reads rank 0's)."""

    def __init__(self, store, run, dcp_state, kinds, rank_key):
        super().__init__(dcp_state)
        self._kinds = kinds
        self._rank_key = rank_key
        self._source = dcp_state

    def prune_for(self, manifest) -> None:
        names = set((manifest.sharded or {}).get("entries", {}))
        for key, kind in self._kinds.items():
            if kind not in ("rng", "per_rank") or any(
                n.startswith(f"{key}.{self._rank_key}.") for n in names
            ):
                continue
            if kind == "per_rank" and any(n.startswith(f"{key}.rank0.") for n in names):
                # another world size: this rank takes rank 0's position (apply_dcp warns)
                self[key] = {"rank0": self._source[key][self._rank_key]}
            else:
                self.pop(key, None)
