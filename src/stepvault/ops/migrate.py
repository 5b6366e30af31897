"""Migrate existing checkpoints into a store: Hugging Face, Lightning, ``torch.save`` files.

Supported inputs (``format=`` forces one, otherwise it is detected):

``hf``
    A ``transformers.Trainer`` ``checkpoint-N`` folder: ``model.safetensors`` (or a sharded
    set with ``model.safetensors.index.json``), or ``pytorch_model.bin`` (sharded likewise),
    plus ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth``,
    ``trainer_state.json``, ``config.json``; ``training_args.bin`` only with ``trust=True``.
    A PEFT checkpoint's ``adapter_model.safetensors``/``.bin`` stands for the weights. A
    Trainer ``output_dir`` imports each of its ``checkpoint-N`` folders
    (:func:`import_checkpoints`).
``lightning``
    A Lightning ``.ckpt`` file.
``torch``
    A ``.pt``/``.pth``/``.bin`` file holding a state dict, or a dict of state dicts and values.
``safetensors``
    One ``.safetensors`` file (the weights of a model).

Safety: safetensors files are read with the ``safetensors`` library (no pickle). Pickled
files are read with ``torch.load(weights_only=True)`` — tensors, containers and plain values
only, plus plain numpy arrays (HF's RNG files hold some). A file that needs anything else
(an arbitrary class, a function) would run code chosen by whoever wrote it: it is refused
with :class:`UntrustedInputError` unless the caller passes ``trust=True``, which is unsafe
for files from others. Once imported, the checkpoint is in stepvault's pickle-free format and
safe to share.

The imported checkpoint is an ordinary one (``run@step``): tensors are stored bitwise as
read, it restores with :func:`stepvault.restore`, reads lazily with :func:`stepvault.open`
and exports with ``stepvault export``. Its top-level entries (see :data:`LAYOUTS`) use the
names a stepvault training state usually has: ``model``, ``optimizer``, ``scheduler``, ...
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ..api import SaveInfo, new_manifest, open_store_for_writing, write_manifest
from ..engine import to_host
from ..errors import StepvaultError, UnsupportedTypeError
from ..format import Encoder
from ..state.snapshot import Snapshot
from ..store import validate_run_name, validate_step
from .importing import UntrustedInputError

Format = Literal["hf", "lightning", "torch", "safetensors"]
FORMATS: tuple[str, ...] = ("hf", "lightning", "torch", "safetensors")

#: Top-level entries each format produces (``*_1``, ``*_2``... for extra optimizers etc.).
LAYOUTS: dict[str, dict[str, str]] = {
    "hf": {
        "model": "module: the weights, as named in the safetensors/bin files",
        "adapter": "module: adapter_model.* of a PEFT checkpoint (instead of model)",
        "optimizer": "optimizer.pt",
        "scheduler": "scheduler.pt",
        "scaler": "scaler.pt (GradScaler)",
        "rng": "rng_state.pth in stepvault.RNGState's layout (rank 0 when several)",
        "rng_ranks": "every rank's RNG state, when there are rng_state_<i>.pth files",
        "trainer_state": "trainer_state.json",
    },
    "lightning": {
        "model": "module: checkpoint['state_dict']",
        "optimizer": "checkpoint['optimizer_states'][0] (optimizer_1... for the others)",
        "scheduler": "checkpoint['lr_schedulers'][0] (scheduler_1... for the others)",
        "lightning": "every other key: epoch, global_step, loops, callbacks, hyper_parameters",
    },
    "torch": {
        "model": "the file itself when it is one flat state dict",
        "<key>": "otherwise each top-level key of the saved dict, unchanged",
    },
    "safetensors": {"model": "module: the tensors of the file"},
}

_HF_WEIGHTS = (
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


@dataclass
class ImportedState:
    """A foreign checkpoint read into memory, ready to be committed as ``run@step``."""

    format: str
    source: str
    tree: dict[str, Any]
    kinds: dict[str, str]
    step: int | None = None
    epoch: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    #: files that were read, relative to the source
    files: list[str] = field(default_factory=list)
    #: (file, reason) for each file left out
    skipped: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class ImportReport:
    """What :func:`import_checkpoint` read and wrote."""

    run: str
    step: int
    format: str
    source: str
    entries: dict[str, str]
    files: list[str]
    skipped: list[tuple[str, str]]
    tensors: int
    save: SaveInfo

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["skipped"] = [{"file": f, "reason": r} for f, r in self.skipped]
        return out


# --------------------------------------------------------------------------- reading files


_PLAIN_NUMPY_DTYPES = [
    *("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
    *("float16", "float32", "float64", "complex64", "complex128"),
]


def _numpy_safe_globals() -> list[Any]:
    """numpy pieces a pickle needs to rebuild plain arrays and scalars (HF's RNG files).

    They only allocate an array of a given dtype and fill it with bytes; an object-dtype
    array would still need its items unpickled by the restricted unpickler, and the
    encoding refuses object arrays anyway.
    """
    core = getattr(np, "_core", None) or np.core
    allow: list[Any] = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype]
    allow += [type(np.dtype(name)) for name in _PLAIN_NUMPY_DTYPES]
    return allow


def _refusal(path: str, exc: Exception) -> UntrustedInputError:
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    detail = f"it references {found.group(1)}" if found else str(exc).strip().splitlines()[0]
    return UntrustedInputError(
        f"{path}: this pickle holds more than tensors and plain values ({detail}); loading "
        "it fully would run code chosen by whoever wrote the file. If you made this file or "
        "trust its author, pass trust=True (CLI: --trust); never for files from others"
    )


def load_pickle(path: str, *, trust: bool = False) -> Any:
    """``torch.load`` a file safely: ``weights_only=True`` unless ``trust`` is passed.

    Raises :class:`UntrustedInputError` when the file needs full unpickling and ``trust`` is
    false; nothing in the file has run by then.
    """
    if not os.path.isfile(path):
        raise StepvaultError(f"{path}: no such file")
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return _torch_load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        if not trust:
            raise _refusal(path, exc) from None
    return _torch_load(path, weights_only=False)


def _torch_load(path: str, *, weights_only: bool) -> Any:
    try:
        # mmap: a large file is paged in as it is written to the store, not read twice.
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):  # legacy (non-zip) torch.save files cannot be mapped
            raise _unreadable(path, exc) from None
    except (EOFError, OSError, ValueError) as exc:
        raise _unreadable(path, exc) from None
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise _unreadable(path, exc) from None


def _unreadable(path: str, exc: Exception) -> StepvaultError:
    return StepvaultError(
        f"{path}: not a readable torch.save file ({type(exc).__name__}: {exc}); "
        "is it truncated or of another format?"
    )


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, read with the safetensors library (no pickle)."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise StepvaultError("reading safetensors needs: pip install safetensors") from exc
    if not os.path.isfile(path):
        raise StepvaultError(f"{path}: no such file")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError) as exc:
        raise StepvaultError(f"{path}: not a valid safetensors file ({exc})") from None


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise StepvaultError(f"{path}: not a readable JSON file ({exc})") from None


# --------------------------------------------------------------------------- classification


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and "state" in value and "param_groups" in value


def _is_flat_state_dict(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def kind_for(value: Any) -> str:
    """The manifest kind of an imported top-level entry.

    A flat name → tensor mapping is a ``module`` state dict; ``state``/``param_groups`` an
    ``optimizer``; any other dict is ``stateful`` (no class recorded, so it loads into any
    live object with ``load_state_dict``, or as a plain dict).
    """
    if _is_flat_state_dict(value):
        return "module"
    if _is_optimizer_state(value):
        return "optimizer"
    if isinstance(value, Mapping):
        return "stateful"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, np.ndarray):
        return "ndarray"
    return "value"


def _plain(value: Any) -> Any:
    """Objects a *trusted* full unpickle may yield → plain values the encoding accepts."""
    if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
        return value.state_dict()
    if callable(getattr(value, "to_json_string", None)):  # transformers' TrainingArguments
        return json.loads(value.to_json_string())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if type(value).__name__ == "Namespace" and hasattr(value, "__dict__"):  # argparse
        return _plain(vars(value))
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value


def _step_from(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value != int(value) or value < 0:
        raise StepvaultError(f"{what} is {value!r}, not a step number; pass step=N (--step N)")
    return int(value)


# --------------------------------------------------------------------------- HF Trainer


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
            if not _is_flat_state_dict(weights):
                raise StepvaultError(f"{path}: expected a flat dict of name -> tensor")
            return entry, dict(weights)
        if index in names:
            return entry, _hf_sharded(folder, index, loader, files, trust)
    raise StepvaultError(
        f"{folder}: no model weights found (expected one of {', '.join(_HF_WEIGHTS)})"
        + (
            "; FSDP/DeepSpeed folders are not supported: consolidate them first"
            if any(n.startswith(("pytorch_model_fsdp", "global_step")) for n in names)
            else ""
        )
    )


def _why_skipped(fname: str, weights_from: str) -> str:
    if fname in _HF_WEIGHTS or re.fullmatch(r"(model|pytorch_model)-\d+-of-\d+\.\w+", fname):
        return f"the same weights in another layout ({weights_from} was imported)"
    return "not training state (config, tokenizer or other)"


def _hf_sharded(
    folder: str, index: str, loader: Any, files: list[str], trust: bool
) -> dict[str, Any]:
    doc = _read_json(os.path.join(folder, index))
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
        if not _is_flat_state_dict(part):
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
    entry, tree[entry] = _hf_weights(folder, files, trust)
    weights_from = files[0]
    names = sorted(os.listdir(folder))
    for fname, key in (
        ("optimizer.pt", "optimizer"),
        ("scheduler.pt", "scheduler"),
        ("scaler.pt", "scaler"),
    ):
        if fname in names:
            tree[key] = _plain(load_pickle(os.path.join(folder, fname), trust=trust))
            files.append(fname)
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
        trainer_state = _read_json(os.path.join(folder, "trainer_state.json"))
        tree["trainer_state"] = trainer_state
        files.append("trainer_state.json")
    for fname, key in _HF_METADATA_JSON.items():
        if fname in names:
            imported.metadata[key] = _read_json(os.path.join(folder, fname))
            files.append(fname)
    if "training_args.bin" in names:
        if trust:
            args = load_pickle(os.path.join(folder, "training_args.bin"), trust=True)
            imported.metadata["training_args"] = _plain(args)
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
        if fname not in files and not any(fname == f for f, _ in imported.skipped):
            imported.skipped.append((fname, _why_skipped(fname, weights_from)))
    imported.kinds = {k: kind_for(v) for k, v in tree.items()}
    # Step: trainer_state's global_step, else the folder name (checkpoint-N).
    if isinstance(trainer_state, dict):
        imported.step = _step_from(trainer_state.get("global_step"), "trainer_state global_step")
        epoch = trainer_state.get("epoch")
        if isinstance(epoch, int | float) and math.isfinite(epoch) and epoch >= 0:
            imported.epoch = math.floor(epoch)  # HF counts fractional epochs; ours is the index
    match = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(os.path.normpath(folder)))
    if imported.step is None and match:
        imported.step = int(match.group(1))
    return imported


# --------------------------------------------------------------------------- Lightning


def _looks_like_lightning(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and "state_dict" in obj
        and ("pytorch-lightning_version" in obj or ("global_step" in obj and "loops" in obj))
    )


def _from_lightning(obj: Any, imported: ImportedState) -> None:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("state_dict"), Mapping):
        raise StepvaultError(
            f"{imported.source}: not a Lightning checkpoint (no 'state_dict' dict); "
            "use format='torch' for a plain torch.save file"
        )
    tree = imported.tree
    tree["model"] = dict(obj["state_dict"])
    rest = {k: v for k, v in obj.items() if k != "state_dict"}
    layout: dict[str, list[str]] = {}
    for src, name in (("optimizer_states", "optimizer"), ("lr_schedulers", "scheduler")):
        items = rest.pop(src, None) or []
        if not isinstance(items, list):
            raise StepvaultError(f"{imported.source}: {src!r} is not a list")
        keys = [name if i == 0 else f"{name}_{i}" for i in range(len(items))]
        tree.update(zip(keys, items))
        layout[src] = keys
    tree["lightning"] = rest
    imported.kinds = {k: kind_for(v) for k, v in tree.items()}
    imported.kinds["model"] = "module"  # even when a model has no parameters
    imported.kinds["lightning"] = "value"
    imported.metadata["lightning_layout"] = layout
    imported.step = _step_from(obj.get("global_step"), "the checkpoint's global_step")
    epoch = obj.get("epoch")
    imported.epoch = epoch if isinstance(epoch, int) and epoch >= 0 else None


def read_lightning_checkpoint(path: str, *, trust: bool = False) -> ImportedState:
    """Read a Lightning ``.ckpt`` file (see :data:`LAYOUTS` for what goes where)."""
    imported = ImportedState(
        "lightning", os.path.abspath(path), {}, {}, files=[os.path.basename(path)]
    )
    obj = load_pickle(path, trust=trust)
    _from_lightning(_plain(obj) if trust else obj, imported)
    return imported


def to_lightning_checkpoint(tree: Mapping[str, Any], layout: Mapping[str, list[str]]) -> dict:
    """Rebuild Lightning's checkpoint dict from an imported tree (``Checkpoint.load()``)
    and ``metadata["lightning_layout"]``: what ``Trainer.fit(ckpt_path=...)`` reads."""
    out = dict(tree["lightning"])
    out["state_dict"] = tree["model"]
    for src, keys in layout.items():
        out[src] = [tree[k] for k in keys]
    return out


# --------------------------------------------------------------------------- torch / safetensors


def read_torch_file(path: str, *, trust: bool = False) -> ImportedState:
    """Read a ``torch.save`` file: one state dict (→ ``model``), or a dict of entries."""
    obj = load_pickle(path, trust=trust)
    if trust:
        obj = _plain(obj)
    imported = ImportedState("torch", os.path.abspath(path), {}, {}, files=[os.path.basename(path)])
    if _is_flat_state_dict(obj):
        imported.tree["model"] = dict(obj)
    elif isinstance(obj, Mapping):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise StepvaultError(
                f"{path}: top-level keys must be strings to become state entries, found {bad[0]!r}"
            )
        if not obj:
            raise StepvaultError(f"{path}: the saved dict is empty; nothing to import")
        imported.tree.update(obj)
    elif isinstance(obj, torch.Tensor):
        imported.tree["tensor"] = obj
    else:
        raise StepvaultError(
            f"{path}: holds a {type(obj).__name__}; expected a state dict or a dict of "
            "state dicts and values"
        )
    imported.kinds = {k: kind_for(v) for k, v in imported.tree.items()}
    for key in ("global_step", "step"):
        value = obj.get(key) if isinstance(obj, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            imported.step = value
            break
    epoch = obj.get("epoch") if isinstance(obj, Mapping) else None
    if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0:
        imported.epoch = epoch
    return imported


def read_safetensors_file(path: str) -> ImportedState:
    """Read one ``.safetensors`` file as the ``model`` module's weights."""
    weights = load_safetensors(path)
    return ImportedState(
        "safetensors",
        os.path.abspath(path),
        {"model": weights},
        {"model": "module"},
        files=[os.path.basename(path)],
    )


# --------------------------------------------------------------------------- detection and commit


def hf_checkpoint_folders(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(step, folder)`` of the ``checkpoint-N`` folders in a Trainer ``output_dir``, by step."""
    found = []
    for name in os.listdir(path):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isdir(os.path.join(path, name)):
            found.append((int(m.group(1)), os.path.join(os.fspath(path), name)))
    return sorted(found)


def detect_format(path: str | os.PathLike[str]) -> str:
    """``hf`` for a folder with model weights, else by suffix (``.ckpt`` → ``lightning``,
    ``.safetensors``, ``.pt``/``.pth``/``.bin`` → ``torch``); a clear error otherwise."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if is_hf_checkpoint(path):
            return "hf"
        if ".metadata" in os.listdir(path):
            raise StepvaultError(
                f"{path}: a torch.distributed.checkpoint directory; use `stepvault import-dcp`"
            )
        if hf_checkpoint_folders(path):
            raise StepvaultError(
                f"{path}: a Trainer output directory holding checkpoint-N folders; import one "
                "of them, or all with import_checkpoints (CLI: stepvault import DIR --run R)"
            )
        raise StepvaultError(
            f"{path}: a directory without model weights ({', '.join(_HF_WEIGHTS)}): not an "
            "HF checkpoint-N folder. Point at the checkpoint folder or file itself"
        )
    if not os.path.exists(path):
        raise StepvaultError(f"{path}: no such file or directory")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".ckpt":
        return "lightning"
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in (".pt", ".pth", ".bin", ".tar"):
        return "torch"
    raise StepvaultError(
        f"{path}: cannot tell the format from the suffix {suffix or '(none)'!r}; pass "
        f"format= (CLI: --format) one of {', '.join(FORMATS)}"
    )


def read_checkpoint(
    path: str | os.PathLike[str], *, format: Format | None = None, trust: bool = False
) -> ImportedState:
    """Read a foreign checkpoint into memory (detecting its format unless given)."""
    path = os.fspath(path)
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    fmt = format or detect_format(path)
    if fmt == "hf":
        return read_hf_checkpoint(path, trust=trust)
    if os.path.isdir(path):
        raise StepvaultError(f"{path}: a directory; format {fmt!r} needs a file")
    if fmt == "safetensors":
        return read_safetensors_file(path)
    if fmt == "lightning":
        return read_lightning_checkpoint(path, trust=trust)
    imported = read_torch_file(path, trust=trust)
    if format is None and _looks_like_lightning(imported.tree):
        # A Lightning checkpoint saved under a .pt name: split it the Lightning way.
        lit = ImportedState("lightning", imported.source, {}, {}, files=imported.files)
        _from_lightning(imported.tree, lit)
        return lit
    return imported


def import_checkpoint(
    root: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    run: str,
    step: int | None = None,
    format: Format | None = None,
    trust: bool = False,
    codec: str | None = None,
    overwrite: bool = False,
) -> ImportReport:
    """Import the checkpoint at ``path`` into the store at ``root`` as ``run@step``.

    ``step`` defaults to the one the source records (HF ``trainer_state.json``
    ``global_step`` or the ``checkpoint-N`` folder name, Lightning's ``global_step``, a
    ``global_step``/``step`` key of a torch file). ``format`` forces ``hf``, ``lightning``,
    ``torch`` or ``safetensors``. ``trust=True`` allows full unpickling — UNSAFE for files
    from others. Everything is read and checked before the store is touched; the
    checkpoint becomes visible atomically, like any save.
    """
    validate_run_name(run)
    if step is not None:
        validate_step(step)
    imported = read_checkpoint(path, format=format, trust=trust)
    chosen = step if step is not None else imported.step
    if chosen is None:
        raise StepvaultError(
            f"{path}: the {imported.format} checkpoint records no step; pass step=N (--step N)"
        )
    validate_step(chosen)
    return commit_imported(root, imported, run=run, step=chosen, codec=codec, overwrite=overwrite)


def commit_imported(
    root: str | os.PathLike[str],
    imported: ImportedState,
    *,
    run: str,
    step: int,
    codec: str | None = None,
    overwrite: bool = False,
) -> ImportReport:
    """Write an :class:`ImportedState` as checkpoint ``run@step``."""
    arrays: dict[str, Any] = {}
    try:
        encoded = Encoder(arrays.__setitem__).encode(imported.tree)
    except UnsupportedTypeError as exc:
        raise UnsupportedTypeError(f"{imported.source}: {exc}") from None
    metadata = {
        "imported_from": imported.source,
        "format": imported.format,
        "files": list(imported.files),
        **imported.metadata,
    }
    snapshot = Snapshot(encoded, dict(imported.kinds), arrays)
    manifest = new_manifest(run, step, snapshot, epoch=imported.epoch, metadata=metadata)
    host = {name: to_host(value) for name, value in arrays.items()}
    store = open_store_for_writing(root)
    info = write_manifest(store, manifest, host, codec=codec, overwrite=overwrite)
    return ImportReport(
        run=run,
        step=step,
        format=imported.format,
        source=imported.source,
        entries=dict(imported.kinds),
        files=list(imported.files),
        skipped=list(imported.skipped),
        tensors=len(arrays),
        save=info,
    )


def import_checkpoints(
    root: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    run: str,
    step: int | None = None,
    format: Format | None = None,
    trust: bool = False,
    codec: str | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int | None], None] | None = None,
) -> list[ImportReport]:
    """Like :func:`import_checkpoint`, and a Trainer ``output_dir`` imports every
    ``checkpoint-N`` folder in it, oldest first, as steps of ``run`` — chunks they share
    (frozen layers, unchanged embeddings) are stored once.

    Each folder is read completely before its checkpoint is written; if one fails, the
    ones before it stay imported (and the error names the failing folder).
    ``progress(done, total)`` gets the source bytes imported so far, after each checkpoint.
    """
    path = os.fspath(path)
    folders = (
        hf_checkpoint_folders(path)
        if os.path.isdir(path) and format in (None, "hf") and not is_hf_checkpoint(path)
        else []
    )
    sources = [folder for _, folder in folders] or [path]
    sizes = [_source_bytes(p) for p in sources]
    report = progress if progress is not None else (lambda done, total: None)
    report(0, sum(sizes))
    if not folders:
        kwargs = dict(run=run, step=step, format=format, trust=trust, codec=codec)
        out = [import_checkpoint(root, path, overwrite=overwrite, **kwargs)]
        report(sizes[0], sizes[0])
        return out
    if step is not None:
        raise StepvaultError(
            f"{path}: holds {len(folders)} checkpoint folders; step= applies to one "
            "checkpoint (import a single checkpoint-N folder to choose its step)"
        )
    reports = []
    for i, folder in enumerate(sources):
        reports.append(
            import_checkpoint(
                root, folder, run=run, format="hf", trust=trust, codec=codec, overwrite=overwrite
            )
        )
        report(sum(sizes[: i + 1]), sum(sizes))
    return reports


def _source_bytes(path: str) -> int:
    """Bytes of a file, or of every file under a folder (what an import reads)."""
    if not os.path.isdir(path):
        return os.path.getsize(path) if os.path.exists(path) else 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def is_hf_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether the folder ``path`` is one HF checkpoint (weights or trainer_state.json)."""
    names = set(os.listdir(path))
    return bool(names & set(_HF_WEIGHTS)) or "trainer_state.json" in names
