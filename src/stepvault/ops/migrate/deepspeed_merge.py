"""The consolidation of DeepSpeed ZeRO checkpoints into one fp32 state dict: what
DeepSpeed's ``zero_to_fp32.py`` computes, from the files of a tag (an imported
``global_stepN`` folder or a ``DeepSpeedCheckpointer`` save), one parameter at a time.

:func:`consolidate` joins the ranks' partitions (ZeRO 1/2 flat groups with their alignment
paddings; ZeRO 3 slices from :func:`stepvault.ops.export_zero3.zero3_param_slices`, frozen
fragments, tied weights); :func:`weights_files` picks the parts of each file it needs, and
:func:`checkpoint_weights` reads only those from a stored checkpoint (never the optimizer
moments). The layout of the stored files is :mod:`stepvault.ops.migrate.deepspeed`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...distributed.planners import decode_value_bytes
from ...errors import StepvaultError
from .deepspeed import MODEL_STATES, OPTIM_STATES, TensorRef, register_deepspeed_types


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
