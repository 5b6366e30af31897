"""One ``.safetensors`` file: the weights of a model, read without pickle."""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from ...errors import StepvaultError
from .base import WEIGHTS_ONLY, ImportedState, Importer


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


def read_safetensors_file(path: str) -> ImportedState:
    """Read one ``.safetensors`` file as the ``model`` module's weights (weights only:
    ``metadata["missing"]`` records that it holds no optimizer state)."""
    weights = load_safetensors(path)
    return ImportedState(
        "safetensors",
        os.path.abspath(path),
        {"model": weights},
        {"model": "module"},
        files=[os.path.basename(path)],
        missing={"optimizer": WEIGHTS_ONLY},
    )


class SafetensorsImporter(Importer):
    name = "safetensors"
    suffixes = (".safetensors",)
    layout: ClassVar[dict[str, str]] = {"model": "module: the tensors of the file"}

    def read(self, path: str, *, trust: bool = False) -> ImportedState:
        return read_safetensors_file(path)
