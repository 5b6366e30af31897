"""One checkpoint read whole and verified, as plain tensors and values (no live objects)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ManifestError
from ..format import Manifest, decode_value, parse_manifest
from ..store import Store
from .reader import CheckpointReader


def load_verified(
    store: Store, run: str, step: int, *, workers: int | None = None
) -> tuple[Manifest, dict[str, Any], int]:
    """Read one checkpoint completely and verify every object; ``(manifest, tree, bytes)``.

    Raises an :class:`IntegrityError` (or :class:`StoreVersionError`) on any damage.
    """
    manifest = parse_manifest(store.read_manifest(run, step), f"{run}@{step}")
    arrays = CheckpointReader(store, manifest, workers=workers).read_all()
    tree = decode_value(manifest.state, lambda kind, name: _pick(arrays, kind, name))
    return manifest, tree, manifest.logical_bytes


def _pick(arrays: dict[str, Any], kind: str, name: str) -> Any:
    try:
        value = arrays[name]
    except KeyError:
        raise ManifestError(f"state references unknown tensor {name!r}") from None
    is_tensor = isinstance(value, torch.Tensor)
    if (kind == "tensor") != is_tensor:
        raise ManifestError(f"state references {name!r} as {kind}, stored otherwise")
    return value
