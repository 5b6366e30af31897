"""The full weights of a DeepSpeed ZeRO-3 checkpoint, one tensor at a time.

ZeRO-3 keeps no whole parameter anywhere: each rank's optimizer file holds its flat fp32
partition of every parameter group (``fp32_flat_groups``), and a parameter of ``numel``
elements is ``ceil(numel / world)`` consecutive elements of every rank's flat partition,
joined in rank order, the last rank's tail padding (DeepSpeed's ``zero_to_fp32.py``:
``zero3_partitioned_param_info`` and ``GatheredTensor``). :func:`zero3_param_slices` is
that arithmetic alone; :class:`Zero3Weights` reads, for one parameter, only those byte
ranges of the ranks' stored partitions (partial reads of the store's objects, each range
verified by its segment checksums), so an export holds one tensor at a time, never the
partitions, let alone the model.

Frozen parameters come from each rank's ``frozen_param_fragments`` (in its model-states
file), buffers from rank 0's module state (floating ones as fp32, as ``zero_to_fp32.py``
returns them), tied parameters (``shared_params``) are the tensor they are tied to.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import StepvaultError
from ..format.encoding import torch_dtype
from ..format.manifest import TensorEntry

#: (rank, group, start, count): ``count`` elements of ``rank``'s flat group ``group`` from
#: element ``start``
Slice = tuple[int, int, int, int]


def zero3_param_slices(
    param_shapes: Sequence[Mapping[str, Sequence[int]]],
    group_numels: Sequence[int],
    world: int,
) -> dict[str, list[Slice]]:
    """Where each trainable parameter lies in the ranks' flat fp32 groups.

    ``param_shapes``: DeepSpeed's per-group ``{name: shape}`` (in its order);
    ``group_numels``: the element count of each flat group of one rank (the same on every
    rank). The slices of a parameter, read in order and joined, are its ``numel`` values
    (the padding is left out). Raises when the partitions do not hold exactly the
    parameters (DeepSpeed's own sanity check).
    """
    if world < 1:
        raise StepvaultError(f"a ZeRO-3 checkpoint needs at least one rank, got {world}")
    bounds = [0]
    for n in group_numels:
        bounds.append(bounds[-1] + int(n))
    out: dict[str, list[Slice]] = {}
    offset = 0
    for group in param_shapes:
        for name, shape in group.items():
            numel = math.prod(int(d) for d in shape)
            part = math.ceil(numel / world)
            pieces: list[Slice] = []
            left = numel
            for rank in range(world):
                # this rank's part of the parameter: [offset, offset + part) of its flat
                # groups joined; only what is not padding is read
                lo, hi = offset, offset + min(part, left)
                left -= hi - lo
                for g in range(len(group_numels)):
                    a, b = max(lo, bounds[g]), min(hi, bounds[g + 1])
                    if a < b:
                        pieces.append((rank, g, a - bounds[g], b - a))
            out[name] = pieces
            offset += part
    if offset != bounds[-1]:
        raise StepvaultError(
            f"the ZeRO-3 partitions hold {bounds[-1] * world} elements but the parameters "
            f"take {offset * world}: param_shapes and fp32_flat_groups do not match (a "
            "partial or mixed checkpoint?)"
        )
    return out


def _trim(chunks: Sequence[Sequence[Any]], lo: int, hi: int) -> list[tuple[str, int, int]]:
    """The byte ranges ``lo .. hi`` of a stored tensor whose bytes are ``chunks``."""
    out: list[tuple[str, int, int]] = []
    pos = 0
    for digest, off, length in chunks:
        a, b = max(lo, pos), min(hi, pos + length)
        if a < b:
            out.append((str(digest), int(off) + a - pos, b - a))
        pos += length
        if pos >= hi:
            break
    return out


@dataclass(frozen=True)
class Zero3Tensor:
    """One full tensor of the export: its shape, stored dtype, and where its bytes are
    (``(stored tensor fqn, start element, count)`` pieces, joined in order)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[tuple[str, int, int], ...]
    #: a floating buffer stored in half precision, handed out as fp32 (zero_to_fp32.py)
    as_float32: bool = False

    @property
    def out_dtype(self) -> str:
        """The dtype :meth:`Zero3Weights.read` returns."""
        return "float32" if self.as_float32 else self.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch_dtype(self.out_dtype).itemsize


class Zero3Weights:
    """The weights of one ZeRO-3 checkpoint (``DeepSpeedCheckpointer``'s files), planned
    from the manifest and the files' skeletons alone; :meth:`read` reads one tensor."""

    def __init__(
        self,
        entries: Mapping[str, Any],
        by_path: Mapping[tuple[str, ...], str],
        skeleton: Callable[[str], Any],
        where: str,
    ) -> None:
        """``entries``: the sharded manifest's entries; ``by_path``: (``deepspeed``, file,
        ...) path → entry fqn; ``skeleton(file)``: a packed file's decoded tree."""
        from .migrate.deepspeed import MODEL_STATES, OPTIM_STATES, TensorRef

        self.entries = entries
        self.where = where
        files = sorted({p[1] for p in by_path if len(p) > 2 and p[0] == "deepspeed"})
        model = _by_rank(f for f in files if f.endswith(MODEL_STATES) and "zero_pp_rank_" in f)
        optim = _by_rank(f for f in files if f.endswith(OPTIM_STATES))
        world = len(optim)
        if not model or world == 0 or sorted(optim) != list(range(world)):
            raise StepvaultError(
                f"{where}: not a whole ZeRO-3 checkpoint (model-states files of ranks "
                f"{sorted(model)}, optimizer files of ranks {sorted(optim)})"
            )

        def ref_fqn(file: str, ref: Any) -> str:
            if not isinstance(ref, TensorRef):
                raise StepvaultError(f"{where}: {file} holds no tensor where one is expected")
            return by_path[("deepspeed", file, "tensors", f"t{ref.index}")]

        states = skeleton(model[min(model)])
        flats: list[list[str]] = []
        for rank in range(world):
            opt = (skeleton(optim[rank]) or {}).get("optimizer_state_dict") or {}
            if "fp32_flat_groups" not in opt:
                raise StepvaultError(
                    f"{where}: {optim[rank]} holds no fp32_flat_groups: not ZeRO-3"
                )
            flats.append([ref_fqn(optim[rank], r) for r in opt["fp32_flat_groups"]])
        numels = [[_numel(entries[f]["size"]) for f in groups] for groups in flats]
        if any(n != numels[0] for n in numels):
            raise StepvaultError(f"{where}: the ranks' flat fp32 groups differ in size {numels}")
        slices = zero3_param_slices(states.get("param_shapes") or [], numels[0], world)
        shapes = {n: s for g in states.get("param_shapes") or [] for n, s in g.items()}
        planned: dict[str, Zero3Tensor] = {}
        for name, pieces in slices.items():
            planned[name] = Zero3Tensor(
                name,
                tuple(int(d) for d in shapes[name]),
                entries[flats[0][0]]["dtype"],
                tuple((flats[r][g], start, count) for r, g, start, count in pieces),
            )
        frozen = states.get("frozen_param_shapes") or {}
        for name, shape in frozen.items():
            planned[name] = self._frozen(name, shape, model, skeleton, ref_fqn)
        module = states.get("module") or {}
        for name in states.get("buffer_names") or []:
            if name in module:
                fqn = ref_fqn(model[min(model)], module[name])
                e = entries[fqn]
                planned[name] = Zero3Tensor(
                    name,
                    tuple(e["size"]),
                    e["dtype"],
                    ((fqn, 0, _numel(e["size"])),),
                    torch_dtype(e["dtype"]).is_floating_point,
                )
        for alias, source in (states.get("shared_params") or {}).items():
            if source in planned:
                src = planned[source]
                planned[alias] = Zero3Tensor(alias, src.shape, src.dtype, src.pieces)
        # the module's own order (a state dict's), then anything it does not name
        order = [n for n in module if n in planned] + [n for n in planned if n not in module]
        self.tensors = [planned[n] for n in order]

    def _frozen(
        self,
        name: str,
        shape: Sequence[int],
        model: Mapping[int, str],
        skeleton: Callable[[str], Any],
        ref_fqn: Callable[[str, Any], str],
    ) -> Zero3Tensor:
        """A frozen parameter: each rank's fragment, joined in rank order, cut to numel."""
        numel = math.prod(int(d) for d in shape)
        pieces: list[tuple[str, int, int]] = []
        left = numel
        dtype = None
        for rank in sorted(model):
            fragments = (skeleton(model[rank]) or {}).get("frozen_param_fragments") or {}
            if name not in fragments:
                raise StepvaultError(f"{self.where}: rank {rank} holds no fragment of {name}")
            fqn = ref_fqn(model[rank], fragments[name])
            count = min(left, _numel(self.entries[fqn]["size"]))
            dtype = self.entries[fqn]["dtype"]
            if count:
                pieces.append((fqn, 0, count))
            left -= count
        if left or dtype is None:
            raise StepvaultError(f"{self.where}: the ranks' fragments of {name} are too short")
        return Zero3Tensor(name, tuple(int(d) for d in shape), dtype, tuple(pieces))

    def objects(self, tensor: Zero3Tensor) -> set[str]:
        """The store objects a read of ``tensor`` touches."""
        out: set[str] = set()
        for fqn, start, count in tensor.pieces:
            for sh, lo, hi in self._shard_ranges(fqn, start, count):
                item = torch_dtype(self.entries[fqn]["dtype"]).itemsize
                out.update(d for d, _, _ in _trim(sh["chunks"], lo * item, hi * item))
        return out

    def _shard_ranges(self, fqn: str, start: int, count: int) -> Iterator[tuple[Any, int, int]]:
        """(shard, first, end element within the shard) of the stored shards of a 1-D
        tensor that hold its elements ``start .. start+count``."""
        for sh in self.entries[fqn]["shards"]:
            s_off, s_len = int(sh["offsets"][0]), int(sh["sizes"][0])
            lo, hi = max(start, s_off), min(start + count, s_off + s_len)
            if lo < hi:
                yield sh, lo - s_off, hi - s_off

    def read(self, reader: Any, tensor: Zero3Tensor) -> torch.Tensor:
        """``tensor`` read through ``reader`` (a CheckpointReader): only its byte ranges,
        each verified, copied straight into the one buffer returned."""
        dtype = torch_dtype(tensor.dtype)
        numel = math.prod(tensor.shape)
        # numpy's uninitialised memory (as the reader's own buffers): nothing is zeroed
        # before it is overwritten, and tracemalloc sees it (the export's memory bound is
        # measured with it)
        flat = torch.from_numpy(np.empty(numel * dtype.itemsize, dtype=np.uint8)).view(dtype)
        at = 0
        for fqn, start, count in tensor.pieces:
            e = self.entries[fqn]
            if e["dtype"] != tensor.dtype:
                raise StepvaultError(f"{self.where}: {fqn} is {e['dtype']}, not {tensor.dtype}")
            got = 0
            for sh, lo, hi in self._shard_ranges(fqn, start, count):
                item = dtype.itemsize
                piece = TensorEntry(
                    e["dtype"], [hi - lo], _trim(sh["chunks"], lo * item, hi * item)
                )
                dst = flat.narrow(0, at + got, hi - lo)
                if not reader.read_into(piece, dst):
                    raise StepvaultError(f"{self.where}: cannot place {fqn}[{lo}:{hi}]")
                got += hi - lo
            if got != count:
                raise StepvaultError(
                    f"{self.where}: {fqn} holds {got} of the {count} elements of "
                    f"{tensor.name} asked from element {start}"
                )
            at += count
        out = flat.view(tensor.shape)
        if tensor.as_float32 and out.dtype != torch.float32:
            out = out.float()  # a half-precision buffer, as zero_to_fp32.py returns it
        return out


def deepspeed_weights(ckpt: Any, entries: dict[str, Any], paths: dict[str, Any]):
    """(name, loader) pairs of the module weights of a ``DeepSpeedCheckpointer``
    checkpoint, read one tensor at a time: ZeRO 1/2 keep the whole module in the shared
    model-states file (what the HF Trainer's own ``save_model`` writes), read through the
    packed file's skeleton; ZeRO-3 weights are joined from the ranks' partitions
    (:class:`Zero3Weights`)."""
    from ..distributed.planners import decode_value_bytes
    from ..format import decode_value
    from .export import _entry_loader, _Loader
    from .migrate.deepspeed import MODEL_STATES, TensorRef, register_deepspeed_types

    register_deepspeed_types()
    by_path = {tuple(str(p) for p in (paths.get(f) or f.split("."))): f for f in entries}
    files = sorted({p[1] for p in by_path if len(p) > 2 and p[0] == "deepspeed"})
    shared = [f for f in files if f.endswith(MODEL_STATES) and "zero_pp_rank_" not in f]
    m = ckpt.manifest

    def skeleton_of(name: str) -> Any:
        tree_fqn = by_path.get(("deepspeed", name, "tree"))
        if tree_fqn is None:
            raise StepvaultError(f"{m.run}@{m.step}: DeepSpeed file {name} has no skeleton")
        return decode_value_bytes(bytes(decode_value(entries[tree_fqn]["value"], _none)))

    if not shared:
        # ZeRO-3: every weight is joined from the ranks' partitions, one at a time
        zero3 = Zero3Weights(entries, by_path, skeleton_of, f"{m.run}@{m.step}")
        reader = ckpt._reader
        for t in zero3.tensors:
            yield (
                t.name,
                _Loader(
                    functools.partial(zero3.read, reader, t),
                    t.nbytes,
                    t.shape,
                    t.out_dtype,
                    frozenset(zero3.objects(t)),
                    reader.drop,
                ),
            )
        return
    name = shared[0]
    skeleton = skeleton_of(name)
    for key, ref in (skeleton.get("module") or {}).items():
        if not isinstance(ref, TensorRef):
            continue
        fqn = by_path[("deepspeed", name, "tensors", f"t{ref.index}")]
        entry = entries[fqn]
        size = 1
        for n in entry["size"]:
            size *= n
        if size == 0:  # a ZeRO-3 placeholder
            raise StepvaultError(
                f"{m.run}@{m.step}: {key} is a ZeRO-3 placeholder in {name}; use "
                "stepvault.integrations.deepspeed.load_fp32_state_dict for its weights"
            )
        yield str(key), _entry_loader(ckpt, fqn, entry)


def _none(kind: str, name: str) -> None:
    return None


def _numel(size: Sequence[int]) -> int:
    return math.prod(int(d) for d in size)


def _by_rank(names: Any) -> dict[int, str]:
    import re

    out: dict[int, str] = {}
    for name in names:
        m = re.search(r"zero_pp_rank_(\d+)_", name)
        out[int(m.group(1)) if m else 0] = name
    return out
