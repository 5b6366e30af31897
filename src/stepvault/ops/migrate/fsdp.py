"""FSDP ``SHARDED_STATE_DICT`` folders: what Accelerate's ``save_state`` and the HF Trainer
write for an FSDP job.

Both write the model as a ``torch.distributed.checkpoint`` directory
``pytorch_model_fsdp_<i>/`` (its state dict under the key ``model``) and the optimizer as
``optimizer_<i>/`` (``get_optimizer_state_dict``'s layout under the key ``optimizer``:
state and param groups keyed by parameter names). Beside them, Accelerate writes
``scheduler.bin`` (``scheduler_<i>.bin``), ``scaler.pt``, ``custom_checkpoint_<i>.pkl`` and
one ``random_states_<rank>.pkl`` per process (its RNGs and ``accelerator.step``); the Trainer
its usual ``scheduler.pt``, ``rng_state_<rank>.pth`` and ``trainer_state.json``
(:mod:`.hf` reads those, and the two DCP folders through :func:`read_fsdp_parts`).

The import joins them into one checkpoint laid out as the integration that resumes from it
stores its own (``AcceleratorCheckpointer``: ``model``, ``optimizer``, ``scheduler``,
``scaler``, ``rng``, ``accelerate_step``, ``custom_<i>``): the weights and optimizer
consolidated (they restore in one process, or on any number of ranks), the optimizer
renumbered as ``Optimizer.state_dict()`` numbers its parameters, and every rank's RNG
(``rng`` holds rank 0's state and, when several processes saved, ``ranks`` each rank's,
the layout the Trainer integration writes). Everything here is a pickle (DCP metadata
included): the import needs ``trust=True``.

FSDP1 and FSDP2 folders are read alike: FSDP1's DCP state dicts (flat parameters or
``use_orig_params``) name and shape the original parameters too, and a resume on FSDP1
ranks maps them onto the flat shards by name (:mod:`stepvault.distributed.full_checkpoint`).
"""

from __future__ import annotations

import os
import re
from typing import Any

from ...errors import StepvaultError
from .base import ImportedState, is_flat_state_dict, kind_for, plain
from .pickles import load_pickle

_MODEL_DIR = re.compile(r"pytorch_model_fsdp_(\d+)")
_OPTIM_DIR = re.compile(r"optimizer_(\d+)")
_SCHEDULER = re.compile(r"scheduler(?:_(\d+))?\.bin")
_RNG = re.compile(r"random_states_(\d+)\.pkl")
_CUSTOM = re.compile(r"custom_checkpoint_(\d+)\.pkl")


def _name(kind: str, i: int) -> str:
    """The integrations' entry names: ``model``, ``model_1``, ..."""
    return kind if i == 0 else f"{kind}_{i}"


def _is_dcp_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def is_fsdp_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds an FSDP ``SHARDED_STATE_DICT`` model folder
    (``pytorch_model_fsdp_0/`` with DCP metadata)."""
    return _is_dcp_dir(os.path.join(os.fspath(path), "pytorch_model_fsdp_0"))


def read_fsdp_parts(folder: str, imported: ImportedState, *, trust: bool) -> None:
    """Read ``folder``'s ``pytorch_model_fsdp_<i>/`` into ``model``/``model_<i>`` and its
    ``optimizer_<i>/`` into ``optimizer``/``optimizer_<i>`` of ``imported.tree``, whole
    (DCP resharded to one process); the optimizers renumbered from parameter names
    (:func:`.dcp.optimizers_by_index`)."""
    from .dcp import load_dcp, optimizers_by_index

    for fname in sorted(os.listdir(folder)):
        path = os.path.join(folder, fname)
        for pattern, kind in ((_MODEL_DIR, "model"), (_OPTIM_DIR, "optimizer")):
            m = pattern.fullmatch(fname)
            if not m or not _is_dcp_dir(path):
                continue
            loaded = load_dcp(path, trust=trust)
            value = loaded.get(kind)
            if value is None or len(loaded) != 1:
                raise StepvaultError(
                    f"{path}: expected one entry {kind!r} (what Accelerate and the Trainer "
                    f"write), found {', '.join(map(repr, loaded))}; import the folder itself "
                    "with `stepvault import-dcp` instead"
                )
            if kind == "model" and not is_flat_state_dict(value):
                raise StepvaultError(f"{path}: 'model' is not a flat dict of name -> tensor")
            imported.tree[_name(kind, int(m.group(1)))] = value
            imported.files.append(fname + "/")
    optimizers_by_index(imported)


def accelerate_rng_to_stepvault(states: Any, where: str) -> dict[str, Any]:
    """One ``random_states_<rank>.pkl`` (Accelerate's RNG save) → :class:`stepvault.RNGState`'s
    ``state_dict`` layout (the torch CPU state the same tensor; a CUDA state kept)."""
    from .hf import hf_rng_to_stepvault

    try:
        hf_like: dict[str, Any] = {
            "python": states["random_state"],
            "numpy": states["numpy_random_seed"],
            "cpu": states["torch_manual_seed"],
        }
    except (KeyError, TypeError):
        raise StepvaultError(
            f"{where}: not Accelerate's RNG state (expected random_state, numpy_random_seed "
            "and torch_manual_seed)"
        ) from None
    known = ("step", "random_state", "numpy_random_seed", "torch_manual_seed")
    for key, value in states.items():
        if key == "torch_cuda_manual_seed":
            hf_like["cuda"] = value
        elif key not in known:
            hf_like[key] = value  # other devices' states (xm_seed, ...): kept as saved
    out = hf_rng_to_stepvault(hf_like)
    if out is None:
        raise StepvaultError(f"{where}: Accelerate's RNG state in an unknown layout")
    return out


def read_accelerate_folder(folder: str, *, trust: bool = False) -> ImportedState:
    """Read an Accelerate ``save_state`` folder of an FSDP job as one checkpoint (see the
    module docstring); it records no training step (``step=`` is needed)."""
    imported = ImportedState("accelerate", os.path.abspath(folder), {}, {})
    read_fsdp_parts(folder, imported, trust=trust)
    tree, files = imported.tree, imported.files
    names = sorted(os.listdir(folder))
    ranks: dict[int, dict[str, Any]] = {}
    for fname in names:
        path = os.path.join(folder, fname)
        if m := _SCHEDULER.fullmatch(fname):
            tree[_name("scheduler", int(m.group(1) or 0))] = plain(load_pickle(path, trust=trust))
        elif fname == "scaler.pt":
            tree["scaler"] = plain(load_pickle(path, trust=trust))
        elif m := _CUSTOM.fullmatch(fname):
            tree[f"custom_{m.group(1)}"] = plain(load_pickle(path, trust=trust))
        elif m := _RNG.fullmatch(fname):
            raw = load_pickle(path, trust=trust)
            ranks[int(m.group(1))] = raw
            if int(m.group(1)) == 0 and isinstance(raw, dict) and "step" in raw:
                tree["accelerate_step"] = int(raw["step"])  # accelerator.step (accumulation)
        else:
            continue
        files.append(fname)
    if ranks:
        if sorted(ranks) != list(range(len(ranks))):
            raise StepvaultError(
                f"{folder}: random_states files of ranks {sorted(ranks)}: a rank's file is "
                "missing (a partial save, or files of two saves mixed); import a complete folder"
            )
        states = [
            accelerate_rng_to_stepvault(ranks[r], os.path.join(folder, f"random_states_{r}.pkl"))
            for r in range(len(ranks))
        ]
        # rank 0's state, and every rank's under "ranks" (the Trainer integration's layout):
        # each rank of a resume takes its own (RNGState.load_state_dict)
        tree["rng"] = {**states[0], "ranks": states} if len(states) > 1 else states[0]
    for fname in names:
        if fname not in files and fname + "/" not in files:
            imported.skipped.append(
                (
                    fname,
                    "not read by the import (it takes the models, optimizers, schedulers, "
                    "scaler, custom objects and RNG); a sampler or data loader state resumes "
                    "fresh",
                )
            )
    imported.kinds = {k: kind_for(v) for k, v in tree.items()}
    for key, what in (
        ("optimizer", "optimizer_0/"),
        ("rng", "random_states_<rank>.pkl"),
    ):
        if key not in tree:
            imported.missing[key] = f"no {what} in {os.path.basename(folder)}"
    return imported
