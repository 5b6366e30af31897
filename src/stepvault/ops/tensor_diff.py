"""``stepvault diff``: per tensor, what changed between two checkpoints and what it costs.

Fast by construction: chunk hashes are compared in the manifests first (content
addressing: the same hashes are the same bytes), and only tensors whose chunks differ are
read, decoded and compared. Reads go through the tier view, so either checkpoint may live
in any tier.

The light-checkpoint size is the payload of the quantised delta of part A of issue 17
(``stepvault.engine.light_delta.light_delta_size``) when that module is installed;
otherwise :func:`_light_delta_size`, the same formula (per-block float32 scales of 256
elements plus one int8 per element). Once that module is on main it is used with no
change here.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..catalog.refs import resolve_ref
from ..format import Manifest, parse_manifest
from ..format.codecs import FloatCodec
from ..store import Store

_FLOATS = (*FloatCodec.SUPPORTED, "float64")


def _light_delta_size(numel: int, *, bits: int = 8, block: int = 256) -> int:
    return math.ceil(numel / block) * 4 + math.ceil(numel * bits / 8)


def _light_size_function() -> Callable[..., int]:
    try:
        return importlib.import_module("stepvault.engine.light_delta").light_delta_size
    except (ImportError, AttributeError):
        return _light_delta_size


@dataclass
class TensorDiff:
    name: str
    status: str  # same | changed | added | removed
    dtype: str | None = None
    shape: list[int] | None = None
    max_abs: float | None = None
    mean_abs: float | None = None
    rel: float | None = None  # ||b - a|| / ||a|| (0 when equal)
    exact_bytes: int = 0  # new chunks an exact checkpoint of B would store after A
    light_bytes: int = 0  # a light checkpoint's payload for this tensor

    @property
    def equal(self) -> bool:
        return self.status == "same"

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "equal": self.equal}


@dataclass
class DiffReport:
    before: str
    after: str
    tensors: list[TensorDiff] = field(default_factory=list)

    @property
    def exact_bytes(self) -> int:
        return sum(t.exact_bytes for t in self.tensors)

    @property
    def light_bytes(self) -> int:
        return sum(t.light_bytes for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.status] = counts.get(t.status, 0) + 1
        return {
            "before": self.before,
            "after": self.after,
            "tensors": [t.to_json() for t in self.tensors],
            "counts": counts,
            "exact_bytes": self.exact_bytes,
            "light_bytes": self.light_bytes,
        }


def _stats(a: Any, b: Any) -> tuple[float, float, float]:
    import torch

    x, y = a.reshape(-1).double(), b.reshape(-1).double()
    d = (y - x).abs()
    if d.numel() == 0:
        return 0.0, 0.0, 0.0
    norm = float(torch.linalg.vector_norm(x))
    change = float(torch.linalg.vector_norm(y - x))
    rel = change / norm if norm else (0.0 if change == 0 else math.inf)
    return float(d.max()), float(d.mean()), rel


def _as_torch(value: Any) -> Any:
    import torch

    return value if isinstance(value, torch.Tensor) else torch.from_numpy(value)


def _bytes(t: Any) -> bytes:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def diff_manifests(store: Store, ma: Manifest, mb: Manifest) -> DiffReport:
    """Compare two parsed manifests of ``store`` (see :func:`diff_checkpoints`)."""
    from ..engine import CheckpointReader

    light = _light_size_function()
    report = DiffReport(f"{ma.run}@{ma.step}", f"{mb.run}@{mb.step}")
    ra, rb = CheckpointReader(store, ma), CheckpointReader(store, mb)
    stored = set(ma.objects)
    for name in sorted({*ma.tensors, *mb.tensors}):
        a, b = ma.tensors.get(name), mb.tensors.get(name)
        if b is None:
            report.tensors.append(TensorDiff(name, "removed", a.dtype, list(a.shape)))  # type: ignore[union-attr]
            continue
        row = TensorDiff(name, "changed", b.dtype, list(b.shape))
        row.exact_bytes = sum(n for d, _, n in b.chunks if d not in stored)
        if a is None:
            row.status = "added"
        elif a.chunks == b.chunks:
            row.status, row.max_abs, row.mean_abs, row.rel = "same", 0.0, 0.0, 0.0
        elif (a.dtype, list(a.shape)) == (b.dtype, list(b.shape)) and b.kind == a.kind:
            x, y = _as_torch(ra.read(name)), _as_torch(rb.read(name))
            if _bytes(x) == _bytes(y):  # equal bytes in other chunks (e.g. a moved bundle)
                row.status, row.max_abs, row.mean_abs, row.rel = "same", 0.0, 0.0, 0.0
            elif not x.dtype.is_complex:
                row.max_abs, row.mean_abs, row.rel = _stats(x, y)
        if row.status != "same":
            numel = math.prod(b.shape)
            # A light checkpoint stores a quantised delta of a float tensor with a base,
            # and an exact copy of anything else (FORMAT.md, light checkpoints).
            row.light_bytes = light(numel) if a is not None and b.dtype in _FLOATS else b.nbytes
        report.tensors.append(row)
        ra.release()
        rb.release()
    return report


def diff_checkpoints(store: Store, before: str, after: str) -> DiffReport:
    """Per tensor of ``before`` -> ``after`` (``RUN@STEP`` refs): equal or not, max/mean
    absolute and relative change, and the bytes an exact checkpoint (new chunks) or a light
    one would take. ``store`` is read through its tier view (any tier)."""
    from ..tiers.view import read_view

    view = read_view(store)
    (ra, sa), (rb, sb) = resolve_ref(view, before), resolve_ref(view, after)
    ma = parse_manifest(view.read_manifest(ra, sa), f"{ra}@{sa}")
    mb = parse_manifest(view.read_manifest(rb, sb), f"{rb}@{sb}")
    return diff_manifests(view, ma, mb)


def diff(root: str | os.PathLike[str] | Store, before: str, after: str) -> DiffReport:
    """:func:`diff_checkpoints` on the store at ``root`` (``stepvault diff`` in Python)."""
    store = root if isinstance(root, Store) else Store.open(root)
    return diff_checkpoints(store, before, after)
