"""``torch.save`` files (``.pt``/``.pth``/``.bin``): one state dict, or a dict of them and
plain values."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import ClassVar

import torch

from ...errors import StepvaultError
from .base import ImportedState, Importer, is_flat_state_dict, kind_for, plain
from .dcp import note_missing_optimizer, optimizers_by_index
from .pickles import load_pickle


def read_torch_file(path: str, *, trust: bool = False) -> ImportedState:
    """Read a ``torch.save`` file: one state dict (→ ``model``), or a dict of entries."""
    obj = load_pickle(path, trust=trust)
    if trust:
        obj = plain(obj)
    imported = ImportedState("torch", os.path.abspath(path), {}, {}, files=[os.path.basename(path)])
    if is_flat_state_dict(obj):
        imported.tree["model"] = dict(obj)
    elif isinstance(obj, Mapping):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise StepvaultError(
                f"{path}: top-level keys must be strings to become state entries, found {bad[0]!r}"
            )
        if not obj:
            raise StepvaultError(f"{path}: the saved dict is empty; nothing to import")
        imported.tree.update(obj)
    elif isinstance(obj, torch.Tensor):
        imported.tree["tensor"] = obj
    else:
        raise StepvaultError(
            f"{path}: holds a {type(obj).__name__}; expected a state dict or a dict of "
            "state dicts and values"
        )
    optimizers_by_index(imported)  # a get_state_dict optimizer: numbered like state_dict()
    imported.kinds = {k: kind_for(v) for k, v in imported.tree.items()}
    note_missing_optimizer(imported)
    for key in ("global_step", "step"):
        value = obj.get(key) if isinstance(obj, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            imported.step = value
            break
    epoch = obj.get("epoch") if isinstance(obj, Mapping) else None
    if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0:
        imported.epoch = epoch
    return imported


class TorchImporter(Importer):
    name = "torch"
    suffixes = (".pt", ".pth", ".bin", ".tar")
    layout: ClassVar[dict[str, str]] = {
        "model": "the file itself when it is one flat state dict",
        "<key>": "otherwise each top-level key of the saved dict, unchanged",
    }

    def read(self, path: str, *, trust: bool = False) -> ImportedState:
        return read_torch_file(path, trust=trust)
