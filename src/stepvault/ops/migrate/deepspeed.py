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

:func:`consolidate` rebuilds the full fp32 weights from the ranks' partitions (what
DeepSpeed's ``zero_to_fp32.py`` does, one parameter at a time), for ZeRO 1, 2 and 3.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
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


def _rank_of(name: str) -> int:
    m = re.search(r"zero_pp_rank_(\d+)_", name)
    return int(m.group(1)) if m else 0


#: the files of a data-parallel ZeRO checkpoint (one model-parallel rank, no experts)
_ZERO_FILE = re.compile(
    r"^(mp_rank_00_model_states|(bf16_)?zero_pp_rank_\d+_mp_rank_00_(model|optim)_states)\.pt$"
)


def _numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


def consolidate(files: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The full fp32 weights (and buffers) from one tag's files (unpacked trees by name),
    equal to DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` (its
    ``zero_to_fp32.py``), in its order: buffers (floating ones as fp32), frozen
    parameters, trained parameters, then tied aliases (``shared_params``: the same tensor
    as the weight they are tied to).

    ZeRO 1/2: each group's flat fp32 partitions (``single_partition_of_fp32_groups``)
    joined in rank order and cut by ``param_shapes``, skipping each parameter's
    ``param_alignment_paddings``; the group's end is checked with DeepSpeed's alignment to
    ``2 * world``. Frozen parameters are rank 0's ``frozen_param_fragments`` (whole).
    ZeRO 3: each parameter's ``ceil(numel / world)`` slice of every rank's flat groups
    (:func:`stepvault.ops.export_zero3.zero3_param_slices`, the rule the one-tensor-at-a-time
    export uses); frozen parameters are every rank's fragment joined and cut to ``numel``.
    Only these keys of the files are read: a tree without the optimizer moments will do.
    """
    from ..export_zero3 import zero3_param_slices

    model = sorted((n for n in files if n.endswith(MODEL_STATES)), key=_rank_of)
    optim = sorted((n for n in files if n.endswith(OPTIM_STATES)), key=_rank_of)
    others = [n for n in (*model, *optim) if not _ZERO_FILE.match(n)]
    if others:
        # tensor/pipeline-parallel ranks (mp_rank_01...) and MoE expert files hold other
        # parts of the model: joining the data-parallel partitions alone would be wrong
        raise StepvaultError(
            f"{others[:3]}: only data-parallel ZeRO checkpoints (mp_rank_00, no expert "
            "files) are consolidated; convert a model-parallel or MoE checkpoint with "
            "DeepSpeed's ds_to_universal.py first"
        )
    if not model or not optim:
        raise StepvaultError(
            "a DeepSpeed checkpoint needs its *_model_states.pt and *_optim_states.pt files; "
            f"found {sorted(files)}"
        )
    partitions = [files[n]["optimizer_state_dict"] for n in optim]
    first = partitions[0]
    counts = first.get("partition_count", len(partitions))
    # ZeRO-2 may give each group its own partition count (experts); the dp world is the
    # largest, as zero_to_fp32.py reads it
    world = max(int(c) for c in counts) if isinstance(counts, list | tuple) else int(counts)
    if world != len(partitions):
        raise StepvaultError(
            f"the checkpoint was written by {world} ranks but {len(partitions)} "
            "*_optim_states.pt files are here: a partial save, or files of two saves mixed; "
            "import a complete global_stepN folder"
        )
    states = files[model[0]]
    shapes = [dict(group) for group in states.get("param_shapes") or []]
    out: dict[str, torch.Tensor] = {}
    module = states.get("module") or {}
    names = set(states.get("buffer_names") or [])
    for name, value in module.items():
        if name in names and isinstance(value, torch.Tensor):
            out[name] = value.float() if value.is_floating_point() else value
    frozen = states.get("frozen_param_shapes") or {}
    if "single_partition_of_fp32_groups" in first:  # ZeRO 1 and 2
        fragments = states.get("frozen_param_fragments") or {}
        for name in frozen:
            out[name] = fragments[name]
        if states.get("frozen_param_shapes") is None:
            # ZeRO-1 saves no frozen_param_shapes (DeepSpeed writes them from ZeRO-2 on), so
            # zero_to_fp32.py drops frozen parameters; the module holds them whole: keep them
            trained = {n for group in shapes for n in group}
            aliases = set(states.get("shared_params") or {})
            for name, value in module.items():
                if (
                    name not in out
                    and name not in trained
                    and name not in aliases
                    and isinstance(value, torch.Tensor)
                    and value.numel()
                ):
                    out[name] = value
        paddings = first.get("param_alignment_paddings")
        for i, group in enumerate(shapes):
            flat = torch.cat([p["single_partition_of_fp32_groups"][i] for p in partitions])
            pads = list(paddings[i]) if paddings is not None else [0] * len(group)
            if len(pads) != len(group):
                raise StepvaultError(
                    f"parameter group {i} has {len(group)} parameters but "
                    f"{len(pads)} alignment paddings: a damaged or mixed checkpoint"
                )
            offset = 0
            for (name, shape), pad in zip(group.items(), pads, strict=True):
                numel = _numel(shape)
                out[name] = flat.narrow(0, offset, numel).view(tuple(shape)).clone()
                offset += numel + int(pad)
            align = 2 * world  # DeepSpeed pads each group's end to this; the exact pad
            if align * math.ceil(offset / align) != align * math.ceil(flat.numel() / align):
                raise StepvaultError(
                    f"parameter group {i}: the parameters take {offset} elements but the "
                    f"ranks' partitions hold {flat.numel()}: param_shapes and the fp32 "
                    "partitions do not match"
                )
    elif "fp32_flat_groups" in first:  # ZeRO 3
        for name, shape in frozen.items():
            numel = _numel(shape)
            parts = [files[n]["frozen_param_fragments"][name].reshape(-1) for n in model]
            if len(parts) != world:
                raise StepvaultError(
                    f"{name} is frozen and partitioned over {world} ranks but "
                    f"{len(parts)} *_model_states.pt files are here"
                )
            out[name] = torch.cat(parts).narrow(0, 0, numel).view(tuple(shape)).clone()
        flats = [list(p["fp32_flat_groups"]) for p in partitions]
        numels = [[int(t.numel()) for t in groups] for groups in flats]
        if any(n != numels[0] for n in numels):
            raise StepvaultError(f"the ranks' flat fp32 groups differ in size: {numels}")
        slices = zero3_param_slices(shapes, numels[0], world)
        for group in shapes:
            for name, shape in group.items():
                pieces = [flats[r][g].narrow(0, a, n) for r, g, a, n in slices[name]]
                joined = torch.cat(pieces) if pieces else torch.empty(0, dtype=flats[0][0].dtype)
                out[name] = joined.view(tuple(shape)).clone()
    else:
        raise StepvaultError(
            "the optimizer files hold neither single_partition_of_fp32_groups (ZeRO 1/2) nor "
            "fp32_flat_groups (ZeRO 3): not a ZeRO checkpoint stepvault can consolidate"
        )
    for alias, source in (states.get("shared_params") or {}).items():
        if source in out:
            out[alias] = out[source]
    return out


#: what :func:`consolidate` reads of each file: the rest (the optimizer's moments under
#: ``optimizer_state_dict.base_optimizer_state`` / ``optimizer_state_dict``, client state,
#: the module's low-precision parameters) is never read by :func:`weights_files`
_MODEL_KEYS = (
    "buffer_names",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "ds_version",
)
_OPTIM_KEYS = (
    "zero_stage",
    "partition_count",
    "single_partition_of_fp32_groups",
    "fp32_flat_groups",
    "param_alignment_paddings",
)


def weights_files(
    skeletons: Mapping[str, Any], read: Callable[[str, TensorRef], torch.Tensor]
) -> dict[str, Any]:
    """The parts of one tag's files :func:`consolidate` needs, with only their tensors read.

    ``skeletons``: each packed file's decoded skeleton (tensors as :class:`TensorRef`);
    ``read(file, ref)``: that file's tensor. The module's buffers, the frozen fragments and
    the fp32 master weights are read; the optimizer moments are not.
    """

    def fill(file: str, value: Any) -> Any:
        if isinstance(value, TensorRef):
            return read(file, value)
        if isinstance(value, Mapping):
            return {k: fill(file, v) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(fill(file, v) for v in value)
        return value

    out: dict[str, Any] = {}
    for file, tree in skeletons.items():
        if file.endswith(MODEL_STATES):
            kept = {k: fill(file, tree[k]) for k in _MODEL_KEYS if k in tree}
            wanted = set(tree.get("buffer_names") or [])
            module = tree.get("module") or {}
            if tree.get("frozen_param_shapes") is None:
                # ZeRO-1: the frozen parameters are only in the module (see consolidate)
                trained = {n for group in tree.get("param_shapes") or [] for n in group}
                aliases = set(tree.get("shared_params") or {})
                wanted |= {k for k in module if k not in trained and k not in aliases}
            kept["module"] = {k: fill(file, v) for k, v in module.items() if k in wanted}
            out[file] = kept
        elif file.endswith(OPTIM_STATES):
            opt = tree.get("optimizer_state_dict") or {}
            out[file] = {
                "optimizer_state_dict": {k: fill(file, opt[k]) for k in _OPTIM_KEYS if k in opt}
            }
    return out


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


class _Stored:
    """A tensor of a single-process manifest's state, by its stored name (not yet read)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def checkpoint_weights(ckpt: Any) -> dict[str, torch.Tensor]:
    """The consolidated fp32 weights of a stored DeepSpeed checkpoint (``ckpt``: a
    :class:`stepvault.catalog.vault.Checkpoint` of a ``DeepSpeedCheckpointer`` save or of an
    imported ``global_stepN`` folder), reading only the tensors :func:`consolidate` uses
    (buffers, frozen fragments, fp32 master partitions), each verified as it is read: the
    optimizer moments, two thirds of an Adam checkpoint, are never read."""
    from ...catalog.reader_holds import holding
    from ...format import decode_value

    register_deepspeed_types()
    m = ckpt.manifest
    where = f"{m.run}@{m.step}"

    def skeleton(value: Any) -> Any:
        return decode_value_bytes(bytes(value)) if isinstance(value, bytes | bytearray) else value

    with holding(ckpt.store, m.run, m.step, owner="load_fp32_state_dict"):
        if m.sharded:
            entries = m.sharded["entries"]
            paths = m.sharded.get("paths", {})
            by_path = {tuple(str(p) for p in (paths.get(f) or f.split("."))): f for f in entries}
            names = sorted({p[1] for p in by_path if len(p) > 2 and p[0] == "deepspeed"})
            skeletons = {}
            for name in names:
                fqn = by_path.get(("deepspeed", name, "tree"))
                if fqn is None:
                    raise StepvaultError(f"{where}: DeepSpeed file {name} has no skeleton")
                skeletons[name] = skeleton(decode_value(entries[fqn]["value"], _no_array))

            def read(file: str, ref: TensorRef) -> torch.Tensor:
                return ckpt.tensor(by_path[("deepspeed", file, "tensors", f"t{ref.index}")])

        else:
            state = decode_value(m.state, lambda kind, name: _Stored(name))
            packed = state.get("deepspeed") if isinstance(state, Mapping) else None
            if not isinstance(packed, Mapping):
                raise StepvaultError(
                    f"{where}: not a DeepSpeed checkpoint (no 'deepspeed' entry); "
                    "restore it with stepvault.restore instead"
                )
            skeletons = {n: skeleton(p["tree"]) for n, p in packed.items()}

            def read(file: str, ref: TensorRef) -> torch.Tensor:
                stored = packed[file]["tensors"][f"t{ref.index}"]
                return ckpt.tensor(stored.name) if isinstance(stored, _Stored) else stored

        if not skeletons:
            raise StepvaultError(f"{where}: not a DeepSpeed checkpoint (no 'deepspeed' entry)")
        return consolidate(weights_files(skeletons, read))


def _no_array(kind: str, name: str) -> None:
    return None
