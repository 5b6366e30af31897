"""Hugging Face ``transformers.Trainer`` checkpoint folders (``checkpoint-N``).

Weights: ``model.safetensors`` (or a sharded set with ``model.safetensors.index.json``), or
``pytorch_model.bin`` (sharded likewise); a PEFT checkpoint's ``adapter_model.*`` stands
for them. Training state: ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``,
``rng_state*.pth``, ``trainer_state.json`` (whose log entries at the checkpoint's step
become its metrics); ``config.json``, ``generation_config.json``, tokenizer and processor
files become attachments (configs are also kept in the metadata); ``training_args.bin``
only with ``trust=True``. Training state the folder lacks (no ``optimizer.pt``...) is
listed in :attr:`ImportedState.missing`.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, ClassVar

import numpy as np
import torch

from ...errors import StepvaultError
from .base import ImportedState, Importer, is_flat_state_dict, kind_for, plain, read_json, step_from
from .dcp import optimizers_by_index, per_rank_fsdp_files, per_rank_fsdp_refusal
from .fsdp import is_fsdp_folder, read_fsdp_parts
from .pickles import load_pickle
from .safetensors_file import load_safetensors

HF_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",  # PEFT (LoRA...): the Trainer saves only the adapter
    "adapter_model.bin",
)
# Files of an HF checkpoint folder that are configuration or tokenizer, not training state.
_HF_METADATA_JSON = {
    "config.json": "config",
    "generation_config.json": "generation_config",
    "adapter_config.json": "adapter_config",
}
# Files that ``from_pretrained`` reads next to the weights (config, generation config,
# tokenizer, processor, PEFT adapter config): stored as attachments, so that ``stepvault
# export`` writes a folder that loads.
_HF_ATTACH = re.compile(
    r"(config|generation_config|adapter_config|tokenizer|tokenizer_config|special_tokens_map"
    r"|added_tokens|vocab|merges|preprocessor_config|processor_config|chat_template"
    r"|sentencepiece\.bpe|spiece)\.(json|txt|jinja|model)"
)
# Training state a full resume needs, by entry: the file the Trainer writes it to.
_HF_STATE_FILES = {
    "optimizer": "optimizer.pt",
    "scheduler": "scheduler.pt",
    "rng": "rng_state.pth",
    "trainer_state": "trainer_state.json",
}


def _is_attachment(fname: str) -> bool:
    return bool(_HF_ATTACH.fullmatch(fname))


def step_metrics(trainer_state: Any, step: int | None) -> dict[str, float]:
    """The finite numbers ``trainer_state.json``'s ``log_history`` holds for ``step``
    (``loss``, ``grad_norm``, ``learning_rate``, ``eval_loss``...; several log entries of
    that step are merged), without ``step`` and ``epoch``."""
    history = trainer_state.get("log_history") if isinstance(trainer_state, dict) else None
    if step is None or not isinstance(history, list):
        return {}
    merged: dict[str, Any] = {}
    for entry in history:
        if isinstance(entry, dict) and entry.get("step") == step:
            merged.update(entry)
    return {
        k: float(v)
        for k, v in merged.items()
        if k not in ("step", "epoch")
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


def hf_rng_to_stepvault(rng: Any) -> dict[str, Any] | None:
    """HF ``rng_state.pth`` content → :class:`stepvault.RNGState`'s ``state_dict`` layout.

    The torch CPU (and CUDA) states are kept as the same tensors; Python's and numpy's
    states are re-shaped from their tuple form into RNGState's dicts. Keys RNGState does not
    know (``xla``, ``npu``...) are kept as they are. None when the layout is not HF's.
    """
    try:
        version, internal, gauss = rng["python"]
        bitgen, key, pos, has_gauss, cached = rng["numpy"]
        cpu = rng["cpu"]
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(cpu, torch.Tensor) or not isinstance(key, np.ndarray):
        return None
    out: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "bit_generator": bitgen,
            "state": {"key": key, "pos": int(pos)},
            "has_gauss": int(has_gauss),
            "gauss": float(cached),
        },
        "torch": cpu,
        "generators": [],
    }
    for k, v in rng.items():
        if k in ("python", "numpy", "cpu"):
            continue
        if k == "cuda" and isinstance(v, torch.Tensor):
            v = [v]  # one device's state; RNGState keeps the list of all devices
        out[k] = v
    return out


def _hf_weights(folder: str, files: list[str], trust: bool) -> tuple[str, dict[str, Any]]:
    """``(entry, weights)``: the full model's weights (``model``), else a PEFT adapter's."""
    names = set(os.listdir(folder))
    for entry, single, index, loader in (
        ("model", "model.safetensors", "model.safetensors.index.json", load_safetensors),
        ("model", "pytorch_model.bin", "pytorch_model.bin.index.json", None),
        ("adapter", "adapter_model.safetensors", None, load_safetensors),
        ("adapter", "adapter_model.bin", None, None),
    ):
        if single in names:
            files.append(single)
            path = os.path.join(folder, single)
            weights = loader(path) if loader else load_pickle(path, trust=trust)
            if not is_flat_state_dict(weights):
                raise StepvaultError(f"{path}: expected a flat dict of name -> tensor")
            return entry, dict(weights)
        if index in names:
            return entry, _hf_sharded(folder, index, loader, files, trust)
    raise StepvaultError(
        f"{folder}: no model weights found (expected one of {', '.join(HF_WEIGHTS)})"
        + (
            "; a DeepSpeed folder imports on its own: point at global_stepN"
            if any(n.startswith("global_step") for n in names)
            else ""
        )
    )


def _why_skipped(fname: str, weights_from: str) -> str:
    same = re.fullmatch(r"(model|pytorch_model)-\d+-of-\d+\.\w+|pytorch_model_fsdp\.bin", fname)
    if fname in HF_WEIGHTS or same:
        return f"the same weights in another layout ({weights_from} was imported)"
    return "not training state (config, tokenizer or other)"


def _hf_sharded(
    folder: str, index: str, loader: Any, files: list[str], trust: bool
) -> dict[str, Any]:
    doc = read_json(os.path.join(folder, index))
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise StepvaultError(f"{os.path.join(folder, index)}: no 'weight_map' in the index")
    files.append(index)
    out: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(weight_map.values()):  # shard files in index order, once each
        if not isinstance(shard, str) or os.path.basename(shard) != shard:
            raise StepvaultError(f"{index}: bad shard file name {shard!r}")
        path = os.path.join(folder, shard)
        if not os.path.isfile(path):
            raise StepvaultError(f"{path}: shard named in {index} is missing")
        part = loader(path) if loader else load_pickle(path, trust=trust)
        if not is_flat_state_dict(part):
            raise StepvaultError(f"{path}: expected a flat dict of name -> tensor")
        out.update(part)
        files.append(shard)
    missing = [k for k in weight_map if k not in out]
    if missing:
        raise StepvaultError(
            f"{index} lists {len(missing)} tensors that no shard holds: {', '.join(missing[:5])}"
        )
    # Keep the index's order (the model's), whatever the order inside the shards.
    return {k: out[k] for k in weight_map} | {k: v for k, v in out.items() if k not in weight_map}


def read_hf_checkpoint(folder: str, *, trust: bool = False) -> ImportedState:
    """Read a ``transformers.Trainer`` ``checkpoint-N`` folder (see the module docstring)."""
    if not os.path.isdir(folder):
        raise StepvaultError(
            f"{folder}: not a directory (an HF checkpoint is a checkpoint-N folder)"
        )
    imported = ImportedState("hf", os.path.abspath(folder), {}, {})
    tree, files = imported.tree, imported.files
    names = sorted(os.listdir(folder))
    per_rank = per_rank_fsdp_files(folder)  # the Trainer under FSDP LOCAL_STATE_DICT
    if per_rank and not set(names) & set(HF_WEIGHTS):
        raise StepvaultError(per_rank_fsdp_refusal(folder, per_rank))
    if is_fsdp_folder(folder) and not set(names) & set(HF_WEIGHTS):
        # The Trainer in FSDP SHARDED_STATE_DICT mode: the model and optimizer are DCP
        # folders (pytorch_model_fsdp_0/, optimizer_0/), consolidated here (see .fsdp)
        read_fsdp_parts(folder, imported, trust=trust)
        weights_from = "pytorch_model_fsdp_0/"
    else:
        entry, tree[entry] = _hf_weights(folder, files, trust)
        weights_from = files[0]
    for fname, key in (
        ("optimizer.pt", "optimizer"),
        # the Trainer under FSDP with FULL_STATE_DICT: get_optimizer_state_dict's full
        # state, keyed by parameter names (renumbered below)
        ("optimizer.bin", "optimizer"),
        ("scheduler.pt", "scheduler"),
        ("scaler.pt", "scaler"),
    ):
        if fname in names and key not in tree:
            tree[key] = plain(load_pickle(os.path.join(folder, fname), trust=trust))
            files.append(fname)
    optimizers_by_index(imported)
    rng_files = sorted(
        (n for n in names if re.fullmatch(r"rng_state(_\d+)?\.pth", n)),
        key=lambda n: int(re.sub(r"\D", "", n) or 0),
    )
    if rng_files:
        states = []
        for fname in rng_files:
            raw = load_pickle(os.path.join(folder, fname), trust=trust)
            states.append(hf_rng_to_stepvault(raw) or raw)
            files.append(fname)
        tree["rng"] = states[0]
        if len(states) > 1:
            tree["rng_ranks"] = states
    trainer_state = None
    if "trainer_state.json" in names:
        trainer_state = read_json(os.path.join(folder, "trainer_state.json"))
        tree["trainer_state"] = trainer_state
        files.append("trainer_state.json")
        if is_fsdp_folder(folder) or "pytorch_model_fsdp.bin" in names:
            # An FSDP job resumes through StepvaultTrainer's sharded path, which places the
            # data by the TrainerState it reads from the manifest alone (as DeepSpeed's)
            imported.metadata["trainer_state"] = json.dumps(trainer_state)
    for fname, key in _HF_METADATA_JSON.items():
        if fname in names:
            imported.metadata[key] = read_json(os.path.join(folder, fname))
    for fname in names:
        path = os.path.join(folder, fname)
        if _is_attachment(fname) and os.path.isfile(path):
            with open(path, "rb") as f:
                imported.attachments[fname] = f.read()
            files.append(fname)
    if "training_args.bin" in names:
        if trust:
            args = load_pickle(os.path.join(folder, "training_args.bin"), trust=True)
            imported.metadata["training_args"] = plain(args)
            files.append("training_args.bin")
        else:
            imported.skipped.append(
                (
                    "training_args.bin",
                    "a full pickle of a TrainingArguments object (loading it runs code from the "
                    "file); pass trust=True (--trust) to import it as plain values",
                )
            )
    for fname in names:
        if fname not in files and fname + "/" not in files and fname not in dict(imported.skipped):
            imported.skipped.append((fname, _why_skipped(fname, weights_from)))
    imported.kinds = {k: kind_for(v) for k, v in tree.items()}
    # Step: trainer_state's global_step, else the folder name (checkpoint-N).
    if isinstance(trainer_state, dict):
        imported.step = step_from(trainer_state.get("global_step"), "trainer_state global_step")
        epoch = trainer_state.get("epoch")
        if isinstance(epoch, int | float) and math.isfinite(epoch) and epoch >= 0:
            imported.epoch = math.floor(epoch)  # HF counts fractional epochs; ours is the index
    match = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(os.path.normpath(folder)))
    if imported.step is None and match:
        imported.step = int(match.group(1))
    imported.metrics = step_metrics(trainer_state, imported.step)
    # What a full resume needs and the folder lacks (a scaler.pt is written only by runs
    # with a GradScaler, so its absence is not a gap: a resume that has one warns).
    for key, fname in _HF_STATE_FILES.items():
        if key not in tree:
            imported.missing[key] = f"no {fname} in {os.path.basename(folder)}"
    return imported


def hf_checkpoint_folders(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(step, folder)`` of the ``checkpoint-N`` folders in a Trainer ``output_dir``, by step."""
    found = []
    for name in os.listdir(path):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isdir(os.path.join(path, name)):
            found.append((int(m.group(1)), os.path.join(os.fspath(path), name)))
    return sorted(found)


def is_hf_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether the folder ``path`` is one HF checkpoint (weights or trainer_state.json)."""
    names = set(os.listdir(path))
    return bool(names & set(HF_WEIGHTS)) or "trainer_state.json" in names


class HFImporter(Importer):
    name = "hf"
    layout: ClassVar[dict[str, str]] = {
        "model": "module: the weights, as named in the safetensors/bin files",
        "adapter": "module: adapter_model.* of a PEFT checkpoint (instead of model)",
        "optimizer": "optimizer.pt",
        "scheduler": "scheduler.pt",
        "scaler": "scaler.pt (GradScaler)",
        "rng": "rng_state.pth in stepvault.RNGState's layout (rank 0 when several)",
        "rng_ranks": "every rank's RNG state, when there are rng_state_<i>.pth files",
        "trainer_state": "trainer_state.json",
    }
    directory = True

    def detect(self, path: str) -> bool:
        return os.path.isdir(path) and is_hf_checkpoint(path)

    def read(self, path: str, *, trust: bool = False) -> ImportedState:
        return read_hf_checkpoint(path, trust=trust)
