"""DeepSpeed ZeRO checkpoints: the stored layout of DeepSpeed's files, their consolidation
into one fp32 state dict, and the importer of existing ``global_stepN`` folders.

A DeepSpeed checkpoint is a set of ``torch.save`` files per tag: ``mp_rank_00_model_states.pt``
(ZeRO 1/2: the module, client state, counters) or one ``zero_pp_rank_R_mp_rank_00_model_states.pt``
per rank (ZeRO 3), and one ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank with that
rank's fp32 master partition and optimizer moments. stepvault stores each file's tree
*packed* (:func:`pack_file`): its tensors under ``tensors`` and everything else as one
skeleton value (``tree``: the safe encoding's JSON, as bytes), so that dict keys keep their
types (the optimizer's ``state`` is keyed by ints, which a flattened DCP path would turn
into strings), lists stay lists, and a reader that knows nothing of DeepSpeed still reads
the checkpoint (the skeleton is plain bytes to it). DeepSpeed's own objects in those files
(the loss scaler, ``fragment_address``, ``ZeroStageEnum``) are taught to the encoding by
:func:`register_deepspeed_types`: plain values in, the same classes out, never a pickle.

:mod:`stepvault.ops.migrate.deepspeed_merge` rebuilds the full fp32 weights from the ranks'
partitions (what DeepSpeed's ``zero_to_fp32.py`` does, one parameter at a time), for ZeRO 1,
2 and 3.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ...distributed.planners import decode_value_bytes, encode_value
from ...errors import StepvaultError, UntrustedInputError
from .base import ImportedState, Importer
from .pickles import load_pickle

#: the folder DeepSpeed writes per save (its default tag)
TAG_RE = re.compile(r"^global_step(\d+)$")
MODEL_STATES = "_model_states.pt"
OPTIM_STATES = "_optim_states.pt"


class TensorRef:
    """Where a tensor of a packed file's skeleton sits: its index in ``tensors``."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"TensorRef({self.index})"


_registered = {"done": False}


def register_deepspeed_types() -> None:
    """Teach the safe encoding the DeepSpeed objects its checkpoint files hold (once).

    Each is stored as plain values under a fixed name and rebuilt as the same class;
    DeepSpeed itself is imported only when it is installed (the packed layout's
    :class:`TensorRef` needs nothing).
    """
    if _registered["done"]:
        return
    from ...state import register_type

    register_type(TensorRef, "stepvault.deepspeed.TensorRef", lambda r: r.index, TensorRef)
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        _registered["done"] = True
        return

    def attributes(obj: Any) -> dict[str, Any]:
        return dict(vars(obj))

    def rebuild(cls: type) -> Any:
        def make(values: Mapping[str, Any]) -> Any:
            obj: Any = object.__new__(cls)  # no __init__: the stored attributes are the whole state
            obj.__dict__.update(values)
            return obj

        return make

    for cls in (LossScaler, DynamicLossScaler):
        register_type(cls, f"deepspeed.{cls.__name__}", attributes, rebuild(cls))
    register_type(
        fragment_address,
        "deepspeed.fragment_address",
        lambda f: [f.numel, f.start],
        lambda v: fragment_address(numel=v[0], start=v[1]),
    )
    register_type(ZeroStageEnum, "deepspeed.ZeroStageEnum", int, ZeroStageEnum)
    _registered["done"] = True


def pack_file(tree: Any) -> dict[str, Any]:
    """One DeepSpeed file's tree → ``{"tensors": {"t0": ...}, "tree": skeleton bytes}``.

    The skeleton is the tree with each tensor replaced by a :class:`TensorRef`, in the safe
    encoding's JSON (:func:`stepvault.distributed.planners.encode_value`).
    """
    tensors: dict[str, torch.Tensor] = {}

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            ref = TensorRef(len(tensors))
            tensors[f"t{ref.index}"] = value
            return ref
        if isinstance(value, Mapping):
            out = {k: strip(v) for k, v in value.items()}
            kind: Any = type(value)  # OrderedDict stays one
            return kind(out) if kind is not dict else out
        if type(value) in (list, tuple):
            return type(value)(strip(v) for v in value)
        return value

    skeleton = strip(tree)
    # One bytes value: DCP keeps it one leaf, and a reader without DeepSpeed's types
    # registered (stepvault export, show, a plain load) decodes it as bytes, not an error.
    return {"tensors": tensors, "tree": encode_value(skeleton, "tree")}


def unpack_file(packed: Mapping[str, Any]) -> Any:
    """Inverse of :func:`pack_file`: the tree DeepSpeed saved, with its tensors."""
    register_deepspeed_types()
    tensors = packed["tensors"]
    wrapped = packed["tree"]
    if isinstance(wrapped, bytes | bytearray):
        wrapped = decode_value_bytes(bytes(wrapped))

    def fill(value: Any) -> Any:
        if isinstance(value, TensorRef):
            return tensors[f"t{value.index}"]
        if isinstance(value, Mapping):
            out = {k: fill(v) for k, v in value.items()}
            kind: Any = type(value)
            return kind(out) if kind is not dict else out
        if type(value) in (list, tuple):
            return type(value)(fill(v) for v in value)
        return value

    return fill(wrapped)


def read_tag(folder: str, *, trust: bool) -> dict[str, Any]:
    """Every ``*.pt`` file of one DeepSpeed tag folder, unpickled (``trust`` required)."""
    if not trust:
        raise UntrustedInputError(
            f"{folder}: DeepSpeed checkpoint files are full pickles (they hold DeepSpeed's own "
            "objects: the loss scaler, fragment addresses), so reading them would run code "
            "chosen by whoever wrote them. If you made them or trust their author, pass "
            "trust=True (CLI: --trust); never for files from others"
        )
    names = sorted(n for n in os.listdir(folder) if n.endswith((MODEL_STATES, OPTIM_STATES)))
    return {name: load_pickle(os.path.join(folder, name), trust=True) for name in names}


def tag_folder(path: str) -> str:
    """``path`` itself when it is a ``global_stepN``-like tag folder; else, for a DeepSpeed
    save directory, the tag its ``latest`` file names (a clear error otherwise)."""
    if any(n.endswith(MODEL_STATES) for n in os.listdir(path)):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
        folder = os.path.join(path, tag)
        if os.path.isdir(folder):
            return folder
    raise StepvaultError(
        f"{path}: no DeepSpeed *_model_states.pt here and no 'latest' file naming a tag "
        "folder; point at a global_stepN folder"
    )


class DeepSpeedImporter(Importer):
    """A DeepSpeed save: a ``global_stepN`` tag folder, or its parent with ``latest``.

    The weights are consolidated into ``model`` (fp32, every ZeRO stage), so the import
    restores into a plain module, exports and loads with ``from_pretrained``; every file is
    kept too, packed, under ``deepspeed`` (the ZeRO partitions and moments, the client
    state), so nothing of the source is lost.
    """

    name: ClassVar[str] = "deepspeed"
    layout: ClassVar[Mapping[str, str]] = {"model": "module", "deepspeed": "value"}
    directory: ClassVar[bool] = True

    def detect(self, path: str) -> bool:
        if not os.path.isdir(path):
            return False
        names = os.listdir(path)
        if any(n.endswith(OPTIM_STATES) and "zero_pp_rank_" in n for n in names):
            return True
        return "latest" in names and any(TAG_RE.match(n) for n in names)

    def read(self, path: str, *, trust: bool = False) -> ImportedState:
        register_deepspeed_types()
        folder = tag_folder(path)
        files = read_tag(folder, trust=trust)
        from .deepspeed_merge import consolidate  # the merge builds on this module's layout

        weights = consolidate(files)
        model_file = next(n for n in sorted(files) if n.endswith(MODEL_STATES))
        states = files[model_file]
        m = TAG_RE.match(os.path.basename(os.path.normpath(folder)))
        step = int(m.group(1)) if m else states.get("global_steps")
        stage = files[next(n for n in files if n.endswith(OPTIM_STATES))]["optimizer_state_dict"]
        return ImportedState(
            format=self.name,
            source=folder,
            tree={"model": weights, "deepspeed": {n: pack_file(t) for n, t in files.items()}},
            kinds=dict(self.layout),
            step=step,
            metadata={
                "deepspeed": {
                    "tag": os.path.basename(os.path.normpath(folder)),
                    "zero_stage": int(stage.get("zero_stage", 0)),
                    "dp_world_size": states.get("dp_world_size"),
                    "ds_version": states.get("ds_version"),
                }
            },
            files=sorted(files),
            missing={
                "optimizer": "the ZeRO optimizer state stays in DeepSpeed's layout under "
                "'deepspeed' (DeepSpeedCheckpointer.resume loads it into an engine); no "
                "plain torch optimizer is rebuilt from it",
                "rng": "DeepSpeed's files hold no RNG state",
            },
        )
