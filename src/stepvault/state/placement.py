"""Placing restored tensors straight into the live ones (the "place" of the read path).

A module's parameters, a top-level tensor and an optimizer's state tensors where the live
optimizer has them (after a step) already have memory of the right shape and dtype:
copying verified chunk bytes directly there saves allocating (and page-faulting) a
second full-size buffer and a second copy. Everything else (the moments of an optimizer
without state, plain tensors, anything the live state has no tensor of the same layout
for) is built in fresh memory (:mod:`stepvault.engine.fresh_memory`), filled by the same
parallel copy, never left as a view of a stored object: training writes those tensors at
once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..engine.copying import parallel_copy
from ..engine.fresh_memory import FreshMemory
from ..engine.reader import CheckpointReader, PendingArray
from .capture import kind_of


class Placed:
    """Marks a tree entry whose bytes were already copied into the live tensor."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<placed>"


PLACED = Placed()


class Fresh:
    """Where a placement builds the tensors it has no live memory for: fresh memory, and
    the byte copies that fill it (run with everything else, over the cores)."""

    def __init__(self, copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.copies = copies
        self.memory = FreshMemory()


def _materialize(value: Any, reader: CheckpointReader, fresh: Fresh | None = None) -> Any:
    """``value`` with every pending tensor read: into fresh memory when ``fresh`` is given
    (placement), else as views of the stored objects (``assign=True``)."""
    if isinstance(value, PendingArray):
        if fresh is None:
            return reader.read(value.name)
        return reader.read_fresh(value.name, copies=fresh.copies, memory=fresh.memory)
    if isinstance(value, dict):
        return {k: _materialize(v, reader, fresh) for k, v in value.items()}
    if isinstance(value, list):
        return [_materialize(v, reader, fresh) for v in value]
    if isinstance(value, tuple):
        return tuple(_materialize(v, reader, fresh) for v in value)
    return value


def _place_optimizer(
    opt: torch.optim.Optimizer,
    saved: dict[str, Any],
    reader: CheckpointReader,
    copies: list[tuple[np.ndarray, np.ndarray]],
    fresh: Fresh,
) -> dict[str, Any]:
    """An optimizer's saved state dict with each stored tensor copied into the live
    optimizer's tensor of the same parameter and key where it has one that fits (its
    moments after a step: an in-process restore, a rollback), the live tensor itself in
    the result, and the rest built in fresh memory. ``load_state_dict`` keeps tensors of
    the parameter's dtype and device as given, so the live ones stay in use.

    Measured on the 2-core VM of BENCHMARKS.md (one thread): copying into fresh memory
    cost 0.33 CPU-s per GB against 0.20 into existing tensors (page faults and the
    kernel's zeroing of every new page)."""
    live_sd = opt.state_dict()
    # saved index -> live index, as load_state_dict pairs them (group by group, in order)
    index: dict[Any, Any] = {}
    for group, live_group in zip(saved.get("param_groups", []), live_sd["param_groups"]):
        if isinstance(group, dict) and "params" in group:
            index.update(zip(group["params"], live_group["params"]))
    state: dict[Any, Any] = {}
    for pid, entries in saved["state"].items():
        live = live_sd["state"].get(index.get(pid)) if pid in index else None
        if not isinstance(entries, dict) or not isinstance(live, dict):
            state[pid] = _materialize(entries, reader, fresh)
            continue
        state[pid] = {}
        for k, value in entries.items():
            target = live.get(k)
            if (
                isinstance(value, PendingArray)
                # plain tensors only: a DTensor's (FSDP2) or a subclass's bytes are not its
                # storage; those get fresh ones, as before
                and type(target) is torch.Tensor
                and reader.read_into(value.name, target, copies=copies)
            ):
                state[pid][k] = target
            else:
                state[pid][k] = _materialize(value, reader, fresh)
    rest = {k: _materialize(v, reader, fresh) for k, v in saved.items() if k != "state"}
    return {**rest, "state": state}


def place_and_materialize(
    state: Mapping[str, Any], tree: dict[str, Any], reader: CheckpointReader
) -> dict[str, Any]:
    """Copy module tensors and top-level tensors into ``state``; read the rest.

    Call only after every object was verified and the tree was validated against the
    state: this mutates live tensors.
    """
    out: dict[str, Any] = {}
    # Host copies are collected and run together at the end, spread over the cores (one
    # thread copying 1.5 GB took 0.19 s here; torch's own copy_ on all cores 0.11 s).
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    fresh = Fresh(copies)
    for key, saved in tree.items():
        live: Any = state.get(key)
        kind = kind_of(live) if key in state else None
        if kind == "module" and isinstance(saved, dict):
            live_sd = live.state_dict()
            placed: dict[str, Any] = {}
            for name, value in saved.items():
                target = live_sd.get(name)
                if (
                    isinstance(value, PendingArray)
                    and isinstance(target, torch.Tensor)
                    and reader.read_into(value.name, target, copies=copies)
                ):
                    placed[name] = PLACED
                else:
                    placed[name] = _materialize(value, reader, fresh)
            out[key] = placed
        elif (
            kind == "optimizer" and isinstance(saved, dict) and isinstance(saved.get("state"), dict)
        ):
            out[key] = _place_optimizer(live, saved, reader, copies, fresh)
        elif (
            kind == "tensor"
            and isinstance(saved, PendingArray)
            and reader.read_into(saved.name, live, copies=copies)
        ):
            out[key] = PLACED
        else:
            out[key] = _materialize(saved, reader, fresh)
    parallel_copy(copies)
    return out
