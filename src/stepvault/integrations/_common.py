"""What the trainer integrations share (no framework imports here)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

import numpy as np
import torch

from ..api import RestoreInfo, restore_candidates
from ..errors import CheckpointNotFoundError, StoreNotFoundError
from ..manager.checkpoint_manager import checkpoint_records
from ..store import Store

StepRef = int | Literal["latest", "best"]


def missing_framework(module: str, framework: str, extra: str) -> str:
    """The ImportError text for an integration whose framework is not installed."""
    return (
        f"stepvault.integrations.{module} needs {framework}, which is not installed: "
        f'pip install "stepvault[{extra}]"'
    )


def finite_metrics(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite scalar entries of ``values`` as floats (what a manifest's metrics hold).

    Trainers log tensors, numpy scalars, ints, strings and NaNs side by side; only finite
    numbers are metrics (a NaN loss must not become the "best" checkpoint).
    """
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.detach().cpu().item()
        elif isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[str(key)] = float(value)
    return out


def restore_candidates_for(
    store: Store, run: str, step: StepRef, best: tuple[str, str] | None
) -> tuple[list[int], bool]:
    """``(candidates, fallback)`` for a restore without a manager (same rules as the manager's).

    ``"latest"``: full checkpoints newest first (unreadable manifests included, so that the
    restore reports them as skipped). ``"best"``: scored checkpoints best first. An int:
    exactly that step, no fallback.
    """
    records = checkpoint_records(store, run)
    if step == "latest":
        return [r.step for r in reversed(records) if r.kind == "full" or not r.valid], True
    if step == "best":
        if best is None:
            raise ValueError(
                "restoring the 'best' checkpoint needs a metric: pass best_metric= (or a "
                "KeepBest keep policy) to the integration"
            )
        metric, mode = best
        scored = [r for r in records if r.valid and math.isfinite(r.metrics.get(metric, math.nan))]
        sign = 1.0 if mode == "min" else -1.0
        scored.sort(key=lambda r: (sign * r.metrics[metric], -r.step))
        return [r.step for r in scored], True
    return [int(step)], False


def read_checkpoint(
    root: str | os.PathLike[str] | Store,
    run: str,
    holder: MutableMapping[str, Any],
    step: StepRef = "latest",
    *,
    best: tuple[str, str] | None = None,
    workers: int | None = None,
) -> RestoreInfo:
    """Read a checkpoint into ``holder`` without taking the run's lease (for evaluation).

    Every object is verified; for ``"latest"``/``"best"`` a damaged checkpoint is skipped
    (and reported in ``info.skipped``) and the next one is tried. Raises
    :class:`CheckpointNotFoundError` when there is nothing to read.
    """
    store = root if isinstance(root, Store) else Store.open(root)
    candidates, fallback = restore_candidates_for(store, run, step, best)
    if not candidates:
        raise CheckpointNotFoundError(
            f"run {run!r} has no {'scored ' if step == 'best' else ''}full checkpoint in "
            f"{store.backend.url}"
        )
    return restore_candidates(
        store, holder, run, candidates, fallback=fallback, strict=False, workers=workers
    )


def has_full_checkpoint(root: str | os.PathLike[str] | Store, run: str) -> bool:
    """Whether ``run`` has at least one committed full checkpoint (valid or not)."""
    try:
        store = root if isinstance(root, Store) else Store.open(root)
    except StoreNotFoundError:
        return False
    return any(r.kind == "full" or not r.valid for r in checkpoint_records(store, run))
