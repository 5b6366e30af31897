"""Metrics and user metadata as a manifest stores them (checked at save time)."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

from ..errors import UnsupportedTypeError
from ..format import Encoder


def _scalar(v: Any) -> Any:
    """A 0-d tensor or numpy scalar as a Python number (torch is not imported for this)."""
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(v, torch.Tensor):
        return v.item()
    if np is not None and isinstance(v, np.ndarray | np.generic):
        return v.item()
    return v


def encode_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """``metrics`` as finite floats by name; a name or value that is not a number is refused
    with its name. A NaN or infinite value (a diverged loss) is left out with a
    ``RuntimeWarning``: refusing it would cost the checkpoint exactly when the run may need
    it, and a best-by rule ranks a checkpoint without the metric neither best nor worst."""
    out: dict[str, float] = {}
    dropped: list[str] = []
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            raise UnsupportedTypeError(f"metric names must be str, got {k!r}")
        v = _scalar(v)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise UnsupportedTypeError(f"metric {k!r} must be a number, got {type(v).__name__}")
        v = float(v)
        if not math.isfinite(v):
            dropped.append(f"{k}={v}")
            continue
        out[k] = v
    if dropped:
        import warnings

        warnings.warn(
            f"metrics {', '.join(dropped)} are not finite: saved without them (a diverged "
            "loss? the checkpoint itself is saved; keep the value in metadata= if you need it)",
            RuntimeWarning,
            stacklevel=3,
        )
    return out


def encode_metadata(metadata: Any) -> Any:
    """User metadata in the safe encoding; tensors belong in the state, not here."""

    def no_arrays(name: str, value: Any) -> None:
        raise UnsupportedTypeError(
            f"metadata[{name!r}] is a tensor/array; put tensors in the state, not metadata"
        )

    return None if metadata is None else Encoder(no_arrays).encode(metadata, ("metadata",))
