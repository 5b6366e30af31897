"""The importers, one per source format, and the choice among them: detection by
content/suffix and :func:`read_checkpoint`."""

from __future__ import annotations

import os
from typing import Literal

from ...errors import StepvaultError
from .base import ImportedState, Importer
from .dcp import DcpImporter
from .deepspeed import DeepSpeedImporter
from .hf import HF_WEIGHTS, HFImporter, hf_checkpoint_folders
from .lightning import LightningImporter, as_lightning
from .safetensors_file import SafetensorsImporter
from .torch_file import TorchImporter

#: Every importer by format name, in the order detection tries them (a directory that is
#: both an HF checkpoint and a DCP one is taken as HF).
IMPORTERS: dict[str, Importer] = {
    importer.name: importer
    for importer in (
        HFImporter(),
        LightningImporter(),
        TorchImporter(),
        SafetensorsImporter(),
        DcpImporter(),
        DeepSpeedImporter(),
    )
}

Format = Literal["hf", "lightning", "torch", "safetensors", "deepspeed"]
#: The formats :func:`import_checkpoint` takes (``format=``, ``stepvault import --format``).
FORMATS: tuple[str, ...] = tuple(n for n, i in IMPORTERS.items() if i.elsewhere is None)

#: Top-level entries each format produces (``*_1``, ``*_2``... for extra optimizers etc.).
LAYOUTS: dict[str, dict[str, str]] = {n: dict(IMPORTERS[n].layout) for n in FORMATS}


def detect_format(path: str | os.PathLike[str]) -> str:
    """``hf`` for a folder with model weights, else by suffix (``.ckpt`` → ``lightning``,
    ``.safetensors``, ``.pt``/``.pth``/``.bin`` → ``torch``); a clear error otherwise."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for importer in IMPORTERS.values():
            if importer.directory and importer.detect(path):
                elsewhere = importer.elsewhere_for(path)
                if elsewhere is not None:
                    raise StepvaultError(f"{path}: {elsewhere}")
                return importer.name
        if hf_checkpoint_folders(path):
            raise StepvaultError(
                f"{path}: a Trainer output directory holding checkpoint-N folders; import one "
                "of them, or all with import_checkpoints (CLI: stepvault import DIR --run R)"
            )
        raise StepvaultError(
            f"{path}: a directory without model weights ({', '.join(HF_WEIGHTS)}): not an "
            "HF checkpoint-N folder. Point at the checkpoint folder or file itself"
        )
    if not os.path.exists(path):
        raise StepvaultError(f"{path}: no such file or directory")
    for importer in IMPORTERS.values():
        if not importer.directory and importer.detect(path):
            return importer.name
    suffix = os.path.splitext(path)[1].lower()
    raise StepvaultError(
        f"{path}: cannot tell the format from the suffix {suffix or '(none)'!r}; pass "
        f"format= (CLI: --format) one of {', '.join(FORMATS)}"
    )


def read_checkpoint(
    path: str | os.PathLike[str], *, format: Format | None = None, trust: bool = False
) -> ImportedState:
    """Read a foreign checkpoint into memory (detecting its format unless given)."""
    path = os.fspath(path)
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    fmt = format or detect_format(path)
    importer = IMPORTERS[fmt]
    if not importer.directory and os.path.isdir(path):
        raise StepvaultError(f"{path}: a directory; format {fmt!r} needs a file")
    imported = importer.read(path, trust=trust)
    if format is None and fmt == "torch":
        # A Lightning checkpoint saved under a .pt name: split it the Lightning way.
        return as_lightning(imported) or imported
    return imported
