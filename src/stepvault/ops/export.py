"""Export the weights of a checkpoint as safetensors (one file, or an HF-style sharded set).

Works for single-process and multi-rank checkpoints alike (shards are assembled into full
tensors in one process), and for DeepSpeed checkpoints of ``DeepSpeedCheckpointer`` (ZeRO
1/2: the module weights of DeepSpeed's model-states file; ZeRO-3: each weight joined from
the ranks' partitions, :mod:`stepvault.ops.export_zero3`). One tensor at a time: each
file's header is written from the manifest, then each tensor as soon as it is read
(:mod:`stepvault.ops.safetensors_stream`), and the reader forgets the objects no later
tensor needs. Optional dtype cast, name filter and prefix strip.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._units import parse_size
from ..catalog.events import log_event
from ..catalog.reader_holds import holding
from ..catalog.vault import Vault
from ..errors import StepvaultError
from ..format.encoding import torch_dtype
from ..store import Store
from .safetensors_stream import write_streamed

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


#: The one lossy export: symmetric int8 per output channel (dim 0), float32 scales.
INT8_SCHEME = "int8-per-channel-symmetric"
SCALE_SUFFIX = ".scale"


@dataclass
class ExportReport:
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    total_bytes: int = 0
    cast: str | None = None
    #: with ``quantize="int8"``: scheme, tensors quantized and the measured error
    quantization: dict[str, Any] | None = None
    step: int | None = None  # the step exported (resolved when "latest" was asked for)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _unescape(name: str) -> str:
    return name.replace("%2F", "/").replace("%25", "%")


@dataclass(frozen=True)
class _Loader:
    """Reads one tensor when called; ``nbytes``, ``shape`` and ``dtype`` (a stored dtype
    name) are what the manifest tells before any byte is read: the export writes each
    file's safetensors header from them, then streams the tensors one at a time.
    ``objects``: the store objects the read touches; ``drop(digests)`` lets the reader
    forget objects no later tensor needs (an export never holds more than the objects of
    the tensor it is writing)."""

    read: Callable[[], Any]
    nbytes: int | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    objects: frozenset[str] = frozenset()
    drop: Callable[[Iterable[str]], None] | None = None

    def __call__(self) -> Any:
        return self.read()


def _entry_loader(ckpt: Any, fqn: str, e: dict[str, Any]) -> _Loader:
    """The loader of one tensor of a sharded manifest (``e``: its entry)."""
    shape = tuple(int(d) for d in e["size"])
    digests = frozenset(str(c[0]) for sh in e["shards"] for c in sh["chunks"])
    return _Loader(
        functools.partial(ckpt.tensor, fqn),
        math.prod(shape) * torch_dtype(e["dtype"]).itemsize,
        shape,
        e["dtype"],
        digests,
        ckpt._reader.drop,
    )


def weight_tensors(vault: Vault, run: str, step: int | str | None, module: str | None):
    """(export name, loader) pairs of a checkpoint's module weights, in stored order."""
    ckpt = vault.checkpoint(run, step)
    m = ckpt.manifest
    if m.sharded:
        entries = m.sharded["entries"]
        tag = "__stepvault_kinds__"
        kinds = {  # DCP flattens the kinds dict into one value entry per key
            fqn[len(tag) + 1 :]: e["value"]
            for fqn, e in entries.items()
            if fqn.startswith(tag + ".") and e["type"] == "value"
        }
        modules = [k for k, v in kinds.items() if v == "module"] or sorted(
            {fqn.split(".", 1)[0] for fqn, e in entries.items() if e["type"] == "tensor"}
        )
        paths = m.sharded.get("paths", {})
        deepspeed = "module" not in kinds.values() and "deepspeed" in modules
        if deepspeed and module in (None, "deepspeed"):
            # DeepSpeedCheckpointer's (the HF Trainer's, Accelerate's with DeepSpeed)
            from .export_zero3 import deepspeed_weights

            yield from deepspeed_weights(ckpt, entries, paths)
            return
        chosen = _choose(module, modules, m)
        for fqn, e in entries.items():
            path = paths.get(fqn) or fqn.split(".", 1)
            if e["type"] == "tensor" and path[0] == chosen:
                yield ".".join(str(p) for p in path[1:]), _entry_loader(ckpt, fqn, e)
        return
    modules = [k for k, v in m.state_kinds.items() if v == "module"]
    chosen = _choose(module, modules, m)
    prefix = chosen.replace("%", "%25").replace("/", "%2F") + "/"
    for name, entry in m.tensors.items():
        if name.startswith(prefix) and entry.kind == "tensor":
            size = sum(length for _, _, length in entry.chunks)
            load = _Loader(
                functools.partial(ckpt.tensor, name),
                size,
                tuple(entry.shape),
                entry.dtype,
                frozenset(d for d, _, _ in entry.chunks),
                ckpt._reader.drop,
            )
            yield _unescape(name[len(prefix) :]), load


def _choose(module: str | None, modules: list[str], m: Any) -> str:
    if module is not None:
        if module not in modules:
            raise StepvaultError(
                f"{m.run}@{m.step} has no module {module!r} (modules: {modules or 'none'})"
            )
        return module
    if len(modules) != 1:
        raise StepvaultError(
            f"{m.run}@{m.step} holds {len(modules)} modules {modules}: choose one with "
            "module= (CLI: --module)"
        )
    return modules[0]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Symmetric per-output-channel int8: ``weight ≈ q * scale[:, None, ...]``.

    Returns ``(q, scale, error)``; ``error`` holds the measured ``max_abs`` error and the
    relative Frobenius error ``rel`` = ||w - dequant(q)|| / ||w||. Each element's error is
    at most half its channel's scale (round to nearest, no clipping: scale = max|w| / 127).
    """
    w = weight.detach().to(torch.float32)
    rows = w.reshape(w.shape[0], -1)
    amax = rows.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    deq = q.to(torch.float32) * scale[:, None]
    diff = (rows - deq).abs()
    norm = float(torch.linalg.vector_norm(rows))
    error = {
        "max_abs": float(diff.max()) if diff.numel() else 0.0,
        "rel": float(torch.linalg.vector_norm(diff)) / norm if norm > 0 else 0.0,
    }
    return q.reshape(weight.shape), scale, error


def dequantize_int8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float32 weights back from an int8 export (``name`` + ``name.scale`` pairs)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in tensors:
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if t.dtype == torch.int8 and scale is not None:
            shape = (t.shape[0],) + (1,) * (t.dim() - 1)
            out[name] = t.to(torch.float32) * scale.reshape(shape)
        else:
            out[name] = t
    return out


def export_weights(
    store: Store,
    ref_run: str,
    step: int | str | None,
    out: str | os.PathLike[str],
    *,
    module: str | None = None,
    dtype: str | None = None,
    include: str | None = None,
    strip_prefix: str | None = None,
    max_shard_size: int | str = "5GB",
    quantize: str | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> ExportReport:
    """Write the module weights of ``run@step`` to ``out`` (logged as an ``export`` event).

    ``out`` ending in ``.safetensors`` is one file; otherwise a directory receives
    ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files plus
    ``model.safetensors.index.json`` when the weights exceed ``max_shard_size``.
    ``dtype`` casts floating tensors (e.g. ``bfloat16``); ``include`` is a regex on names.

    ``quantize="int8"`` is LOSSY: every floating tensor with two or more dimensions becomes
    int8 with one float32 scale per output channel (stored as ``<name>.scale``; see
    :func:`dequantize_int8`); 1-D tensors (biases, norms) stay as they are. The measured
    error is in ``report.quantization`` and the file metadata says ``lossy: true``.
    ``progress(done, None)`` gets the bytes of the weights read so far. A checkpoint in
    any tier of ``store`` is exported, read as restore reads it (hot first).
    """
    from ..tiers.view import read_view

    store = read_view(store)
    chosen = Vault(store).checkpoint(ref_run, step).manifest  # "latest" -> a step
    with holding(store, chosen.run, chosen.step, owner="export"):  # no GC takes it mid-way
        report = _export(
            store,
            ref_run,
            chosen.step,
            out,
            module=module,
            dtype=dtype,
            include=include,
            strip_prefix=strip_prefix,
            max_shard_size=max_shard_size,
            quantize=quantize,
            progress=progress,
        )
    q = report.quantization or {}
    log_event(
        store,
        chosen.run,  # ref_run may be "run@step" or an alias
        "export",
        step=report.step,
        output=os.fspath(out),
        tensors=report.tensors,
        bytes=report.total_bytes,
        cast=dtype,
        quantize=quantize,
        max_rel_error=q.get("max_rel_error"),
    )
    return report


def _export(
    store: Store,
    ref_run: str,
    step: int | str | None,
    out: str | os.PathLike[str],
    *,
    module: str | None = None,
    dtype: str | None = None,
    include: str | None = None,
    strip_prefix: str | None = None,
    max_shard_size: int | str = "5GB",
    quantize: str | None = None,
    exclude: frozenset[str] = frozenset(),
    progress: Callable[[int, int | None], None] | None = None,
) -> ExportReport:
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
    target = torch_dtype(dtype) if dtype else None
    if target is not None and not target.is_floating_point:
        # A cast of float weights to an integer or bool type truncates them (int8: all 0).
        raise ValueError(
            f"dtype={dtype!r}: a cast is to another float type (bfloat16, float16, float32); "
            "for int8 weights use quantize='int8' (--quantize int8: per-channel scales)"
        )
    pattern = re.compile(include) if include else None
    limit = parse_size("max_shard_size", max_shard_size)
    if limit <= 0:  # 0 wrote one shard per tensor: never what a size limit means
        raise ValueError(
            f"max_shard_size must be a positive size such as '5GB', got {max_shard_size!r}"
        )
    vault = Vault(store)
    report = ExportReport(cast=dtype)
    errors: dict[str, dict[str, float]] = {}
    shards: list[list[tuple[str, _Loader, list[tuple[str, torch.dtype, tuple[int, ...]]]]]]
    shards = [[]]
    sizes = [0]
    report.step = step = vault.checkpoint(ref_run, step).manifest.step  # "latest" -> int
    chosen = []
    for name, load in weight_tensors(vault, ref_run, step, module):
        if pattern is not None and not pattern.search(name):
            continue
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix) :]
        if name in exclude:  # tied weights an HF folder leaves out (ops/export_hf.py)
            continue
        chosen.append((name, load))
    # The plan: every output tensor's name, dtype and shape from the manifest, before any
    # byte is read, so each file's header is written first and the tensors are streamed
    # into it one at a time (the export holds one tensor, not a shard or the model).
    planned: list[tuple[str, _Loader, list[tuple[str, torch.dtype, tuple[int, ...]]]]] = []
    for name, load in chosen:
        if load.shape is None or load.dtype is None:  # pragma: no cover - every path tells
            raise StepvaultError(f"{ref_run}@{step}: the manifest does not tell {name}'s shape")
        stored = torch_dtype(load.dtype)
        shape = tuple(load.shape)
        if quantize and stored in _CASTABLE and len(shape) >= 2 and shape[0] > 0:
            outs = [(name, torch.int8, shape), (name + SCALE_SUFFIX, torch.float32, shape[:1])]
        elif target is not None and stored in _CASTABLE:
            outs = [(name, target, shape)]
        else:
            outs = [(name, stored, shape)]
        nbytes = sum(math.prod(sh) * dt.itemsize for _, dt, sh in outs)
        if sizes[-1] and sizes[-1] + nbytes > limit:
            shards.append([])
            sizes.append(0)
        shards[-1].append((name, load, outs))  # a weight and its scale stay in one shard
        sizes[-1] += nbytes
        planned.append((name, load, outs))
        report.tensors += 1
        report.total_bytes += nbytes
    if report.tensors == 0:
        raise StepvaultError(f"nothing to export from {ref_run}@{step} (filter {include!r})")
    total = sum(load.nbytes or 0 for _, load, _ in planned)
    last_use = {d: i for i, (_, load, _) in enumerate(planned) for d in load.objects}
    state = {"index": 0, "read": 0}

    def produce(name: str, load: _Loader) -> dict[str, torch.Tensor]:
        """Read one tensor, give it its exported form, let the reader forget its objects."""
        t = load()
        state["read"] += t.numel() * t.element_size()
        if progress is not None:
            progress(state["read"], total)  # total known: the bar shows an ETA
        if load.drop is not None:
            index = state["index"]
            load.drop([d for d in load.objects if last_use[d] == index])
        state["index"] += 1
        if quantize and t.dtype in _CASTABLE and t.dim() >= 2 and t.shape[0] > 0:
            q, scale, error = quantize_int8(t)
            errors[name] = error
            return {name: q, name + SCALE_SUFFIX: scale}
        if target is not None and t.dtype in _CASTABLE:
            return {name: t.to(target)}
        return {name: t}

    out = os.fspath(out)
    meta = {"format": "pt", "stepvault_source": f"{ref_run}@{step}"}
    if quantize:
        meta.update(stepvault_quantization=INT8_SCHEME, lossy="true")
    if out.endswith(".safetensors"):
        if len(shards) > 1:
            raise StepvaultError(
                f"weights ({report.total_bytes} bytes) exceed max_shard_size; export to a "
                "directory to get a sharded set"
            )
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        write_streamed(out, shards[0], meta, produce)
        report.files.append(out)
    else:
        os.makedirs(out, exist_ok=True)
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = (
                "model.safetensors"
                if len(shards) == 1
                else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            )
            write_streamed(os.path.join(out, fname), shard, meta, produce)
            report.files.append(os.path.join(out, fname))
            weight_map.update({key: fname for _, _, outs in shard for key, _, _ in outs})
        if len(shards) > 1:
            index = {"metadata": {"total_size": report.total_bytes}, "weight_map": weight_map}
            index_path = os.path.join(out, "model.safetensors.index.json")
            with open(index_path, "w") as f:
                json.dump(index, f, indent=2)
            report.files.append(index_path)
    if quantize:
        rels = [e["rel"] for e in errors.values()]
        report.quantization = {
            "scheme": INT8_SCHEME,
            "lossy": True,
            "tensors": len(errors),
            "max_abs_error": max((e["max_abs"] for e in errors.values()), default=0.0),
            "max_rel_error": max(rels, default=0.0),
            "mean_rel_error": sum(rels) / len(rels) if rels else 0.0,
            "per_tensor": errors,
        }
    return report
