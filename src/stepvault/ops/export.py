"""Export the weights of a checkpoint as safetensors (one file, or an HF-style sharded set).

Works for single-process and multi-rank checkpoints alike (shards are assembled into full
tensors in one process), and for DeepSpeed ZeRO 1/2 checkpoints of ``DeepSpeedCheckpointer``
(the module weights of DeepSpeed's model-states file). Optional dtype cast, name filter and
prefix strip. Needs the ``safetensors`` package (``pip install 'stepvault[export]'``).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
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
    """Reads one tensor when called; ``nbytes`` is its size when the manifest tells."""

    read: Callable[[], Any]
    nbytes: int | None = None

    def __call__(self) -> Any:
        return self.read()


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
            yield from _deepspeed_module(ckpt, entries, paths)
            return
        chosen = _choose(module, modules, m)
        for fqn, e in entries.items():
            path = paths.get(fqn) or fqn.split(".", 1)
            if e["type"] == "tensor" and path[0] == chosen:
                load = _Loader(functools.partial(ckpt.tensor, fqn))
                yield ".".join(str(p) for p in path[1:]), load
        return
    modules = [k for k, v in m.state_kinds.items() if v == "module"]
    chosen = _choose(module, modules, m)
    prefix = chosen.replace("%", "%25").replace("/", "%2F") + "/"
    for name, entry in m.tensors.items():
        if name.startswith(prefix) and entry.kind == "tensor":
            size = sum(length for _, _, length in entry.chunks)
            load = _Loader(functools.partial(ckpt.tensor, name), size)
            yield _unescape(name[len(prefix) :]), load


def _deepspeed_module(ckpt: Any, entries: dict[str, Any], paths: dict[str, Any]):
    """(name, loader) pairs of the module weights in a DeepSpeed checkpoint's model-states
    file (ZeRO 1/2 keep the whole module there: what the HF Trainer's own ``save_model``
    writes), one tensor read at a time through the packed file's skeleton."""
    from ..distributed.planners import decode_value_bytes
    from ..format import decode_value
    from .migrate.deepspeed import MODEL_STATES, TensorRef, register_deepspeed_types

    register_deepspeed_types()
    by_path = {tuple(str(p) for p in (paths.get(f) or f.split("."))): f for f in entries}
    files = sorted({p[1] for p in by_path if len(p) > 2 and p[0] == "deepspeed"})
    shared = [f for f in files if f.endswith(MODEL_STATES) and "zero_pp_rank_" not in f]
    m = ckpt.manifest
    if not shared:
        raise StepvaultError(
            f"{m.run}@{m.step} is a DeepSpeed ZeRO-3 checkpoint: its weights exist only as "
            "the ranks' partitions. Read them joined with stepvault.integrations.deepspeed."
            "load_fp32_state_dict(root, run, step), then model.load_state_dict(...) and "
            "model.save_pretrained(DIR)"
        )
    name = shared[0]
    tree_fqn = by_path.get(("deepspeed", name, "tree"))
    if tree_fqn is None:
        raise StepvaultError(f"{m.run}@{m.step}: DeepSpeed file {name} has no skeleton")
    skeleton = decode_value_bytes(bytes(decode_value(entries[tree_fqn]["value"], _none)))
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
        yield str(key), _Loader(functools.partial(ckpt.tensor, fqn))


def _none(kind: str, name: str) -> None:
    return None


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
    try:
        from safetensors.torch import save_file
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise StepvaultError("export needs safetensors: pip install 'stepvault[export]'") from exc
    target = torch_dtype(dtype) if dtype else None
    pattern = re.compile(include) if include else None
    limit = parse_size("max_shard_size", max_shard_size)
    vault = Vault(store)
    report = ExportReport(cast=dtype)
    errors: dict[str, dict[str, float]] = {}
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    report.step = step = vault.checkpoint(ref_run, step).manifest.step  # "latest" -> int
    read_bytes = 0
    chosen = []
    for name, load in weight_tensors(vault, ref_run, step, module):
        if pattern is not None and not pattern.search(name):
            continue
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix) :]
        if name in exclude:  # tied weights an HF folder leaves out (ops/export_hf.py)
            continue
        chosen.append((name, load))
    sizes_known = [getattr(load, "nbytes", None) for _, load in chosen]
    total = None if None in sizes_known else sum(n for n in sizes_known if n is not None)
    for name, load in chosen:
        t = load()
        read_bytes += t.numel() * t.element_size()
        if progress is not None:
            progress(read_bytes, total)  # total known: the bar shows an ETA
        pieces = {name: t}
        if quantize and t.dtype in _CASTABLE and t.dim() >= 2 and t.shape[0] > 0:
            q, scale, error = quantize_int8(t)
            pieces = {name: q, name + SCALE_SUFFIX: scale}
            errors[name] = error
        elif target is not None and t.dtype in _CASTABLE:
            pieces = {name: t.to(target)}
        nbytes = sum(p.numel() * p.element_size() for p in pieces.values())
        if sizes[-1] and sizes[-1] + nbytes > limit:
            shards.append({})
            sizes.append(0)
        for key, piece in pieces.items():  # a weight and its scale stay in one shard
            shards[-1][key] = piece.contiguous()
        sizes[-1] += nbytes
        report.tensors += 1
        report.total_bytes += nbytes
    if report.tensors == 0:
        raise StepvaultError(f"nothing to export from {ref_run}@{step} (filter {include!r})")
    out = os.fspath(out)
    meta = {"format": "pt", "stepvault_source": f"{ref_run}@{step}"}
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
        meta.update(stepvault_quantization=INT8_SCHEME, lossy="true")
    if out.endswith(".safetensors"):
        if len(shards) > 1:
            raise StepvaultError(
                f"weights ({report.total_bytes} bytes) exceed max_shard_size; export to a "
                "directory to get a sharded set"
            )
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        save_file(shards[0], out, metadata=meta)
        report.files.append(out)
        return report
    os.makedirs(out, exist_ok=True)
    if len(shards) == 1:
        path = os.path.join(out, "model.safetensors")
        save_file(shards[0], path, metadata=meta)
        report.files.append(path)
        return report
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, fname), metadata=meta)
        report.files.append(os.path.join(out, fname))
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": report.total_bytes}, "weight_map": weight_map}
    index_path = os.path.join(out, "model.safetensors.index.json")
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)
    report.files.append(index_path)
    return report
