"""What the trainer integrations share (no framework imports here)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

import numpy as np
import torch

from .._rank import rank_and_world
from ..catalog import checkpoint_records
from ..core.gaps import warn_resume_gaps  # noqa: F401  (the integrations import it from here)
from ..core.info import RestoreInfo
from ..core.planner import Source, restore_local
from ..errors import CheckpointNotFoundError, StoreNotFoundError
from ..store import Store

StepRef = int | Literal["latest", "best"]


def sharded_collective() -> bool | None:
    """``collective=`` for the manager of a sharded job (FSDP): collective under any
    process group, one rank included (``torchrun --nproc_per_node 1`` keeps the DTensors,
    which a single-process save cannot hold); None without a group."""
    import torch.distributed as dist

    return True if dist.is_available() and dist.is_initialized() else None


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
    """``(candidates, fallback)`` for a restore without a manager: the planner's choice
    (:meth:`stepvault.core.planner.Source.choose`) over the run's records."""
    chosen = _source(store, run).choose(step, best=best)
    return chosen.steps, chosen.fallback


def _source(store: Store, run: str) -> Source:
    """``run`` through the tier view (any tier, hot first), chosen from its records (full
    checkpoints only for "latest": a trainer resumes a training state)."""
    from ..tiers.view import read_view

    view = read_view(store)
    return Source(view, run, records=lambda: checkpoint_records(view, run, protected=False))


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

    Through the one restore planner, from any tier of the store: every object is verified
    and ``holder`` checked before anything in it changes; for ``"latest"``/``"best"`` a
    damaged checkpoint is skipped (and reported in ``info.skipped``) and the next one is
    tried. Raises :class:`CheckpointNotFoundError` when there is nothing to read.
    """
    store = root if isinstance(root, Store) else Store.open(root)
    source = _source(store, run)
    chosen = source.choose(step, best=best)
    if not chosen.steps:
        raise CheckpointNotFoundError(
            f"run {run!r} has no {'scored ' if step == 'best' else ''}full checkpoint in "
            f"{store.backend.url}"
        )
    return restore_local(source, holder, chosen, strict=False, workers=workers, progress=False)


def has_full_checkpoint(root: str | os.PathLike[str] | Store, run: str) -> bool:
    """Whether ``run`` has at least one committed full checkpoint (valid or not)."""
    try:
        store = root if isinstance(root, Store) else Store.open(root)
    except StoreNotFoundError:
        return False
    return any(r.kind == "full" or not r.valid for r in checkpoint_records(store, run))


# ------------------------------------------------------------------ several processes
# Lightning and the HF Trainer gather a replicated (DDP) model on global rank 0 and write
# the checkpoint there only; the other ranks never touch the store on save. What differs
# between ranks is their RNG state: it is gathered to rank 0 and stored as a list, one entry
# per rank (plain values and tensors: the safe encoding, never a pickle in the store).


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's Python/numpy/torch (and CUDA) RNG state, in rank order; a collective
    call (every rank must make it). One process: a list of its own state."""
    from ..state import RNGState

    own = RNGState().state_dict()
    _, world = rank_and_world()
    if world == 1:
        return [own]
    everyone: list[Any] = [None] * world
    # In transit between the ranks of one job only; what is stored is the safe encoding.
    torch.distributed.all_gather_object(everyone, own)
    return everyone


def rng_state_of_this_rank(
    states: list[dict[str, Any]] | None, default: dict[str, Any] | None, what: str
) -> dict[str, Any] | None:
    """This rank's entry of the stored per-rank RNG states.

    ``states`` is the stored list (None for a checkpoint written by one process);
    ``default`` the RNG state stored for rank 0. A rank with no entry of its own (the
    checkpoint was written by fewer processes) gets ``default`` and a warning: its dropout
    and augmentation draws will differ from the run that saved.
    """
    rank, world = rank_and_world()
    if states is None:
        states = [default] if default is not None else []
    if rank < len(states):
        return states[rank]
    if world > 1:
        saved = len(states)
        import warnings

        warnings.warn(
            f"stepvault: {what} was saved by {saved} process(es); rank {rank} of {world} "
            "has no RNG state of its own in it and continues from rank 0's",
            RuntimeWarning,
            stacklevel=3,
        )
    return default


def on_rank0(fn: Any, what: str) -> Any:
    """``fn()`` on global rank 0, its result on every rank (a collective call).

    An error on rank 0 is raised on every rank (rank 0 raises the original; the others a
    :class:`StepvaultError` with its text), and a ``SystemExit`` (a save policy that exits
    after a preemption save) exits every rank with the same code: no rank is left waiting
    in a collective for a peer that has gone.
    """
    from ..errors import StepvaultError

    rank, world = rank_and_world()
    if world == 1:
        return fn()
    outcome: tuple[str, Any] = ("ok", None)
    error: BaseException | None = None
    if rank == 0:
        try:
            outcome = ("ok", fn())
        except SystemExit as exc:
            outcome, error = ("exit", exc.code), exc
        except BaseException as exc:  # every rank must hear of it
            outcome, error = ("error", f"{type(exc).__name__}: {exc}"), exc
    box = [outcome]
    torch.distributed.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if error is not None:
        raise error
    if kind == "exit":
        raise SystemExit(value)
    if kind == "error":
        raise StepvaultError(f"{what} failed on rank 0: {value}")
    return value


class PolicySignals:
    """The save policy's signal handlers on a rank that has no manager (DDP, rank != 0).

    A preemption notice reaches every process of a job (torchrun, SLURM and Kubernetes
    signal them all). Rank 0's manager installs its policy's handlers (``OnSignal``); the
    other ranks install the same ones, which only record the signal, so that the default
    action does not kill them (nor a trainer's own handler start a collective of its own)
    while rank 0 saves at the next step boundary and every rank then exits together.
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.installed = False

    def install(self) -> None:
        if not self.installed:
            self.policy.install()
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            self.installed = False
            self.policy.uninstall()


def open_manager_on_rank0(owner: Any, options: dict[str, Any]) -> None:
    """Give ``owner.manager`` a :class:`CheckpointManager` on global rank 0 only.

    Lightning and the HF Trainer write checkpoints from rank 0 alone, so under several
    processes that manager is rank-local (``collective=False``) and holds the run's lease;
    the other ranks take its decisions. A lease error on rank 0 stops every rank.
    ``owner`` has ``root``, ``run``, ``save_policy``, ``keep_policy`` and ``async_save``.
    """
    from ..manager import CheckpointManager

    options = dict(options)
    if rank_and_world()[1] > 1:
        options["collective"] = False

    def create() -> None:
        owner.manager = CheckpointManager(
            owner.root,
            owner.run,
            save=owner.save_policy,
            keep=owner.keep_policy,
            async_save=owner.async_save,
            **options,
        )

    on_rank0(create, "opening the stepvault run")
