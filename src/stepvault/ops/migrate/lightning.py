"""Lightning ``.ckpt`` files: ``state_dict``, optimizer and scheduler states, loops."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

from ...errors import StepvaultError
from .base import ImportedState, Importer, kind_for, plain, step_from
from .pickles import load_pickle


def _looks_like_lightning(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and "state_dict" in obj
        and ("pytorch-lightning_version" in obj or ("global_step" in obj and "loops" in obj))
    )


def _from_lightning(obj: Any, imported: ImportedState) -> None:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("state_dict"), Mapping):
        raise StepvaultError(
            f"{imported.source}: not a Lightning checkpoint (no 'state_dict' dict); "
            "use format='torch' for a plain torch.save file"
        )
    tree = imported.tree
    tree["model"] = dict(obj["state_dict"])
    rest = {k: v for k, v in obj.items() if k != "state_dict"}
    layout: dict[str, list[str]] = {}
    for src, name in (("optimizer_states", "optimizer"), ("lr_schedulers", "scheduler")):
        if src not in rest:
            # ModelCheckpoint(save_weights_only=True) writes neither; an empty list (a
            # module without schedulers) is complete. A resume starts these fresh.
            imported.missing[name] = (
                f"the .ckpt has no {src!r} (written with save_weights_only=True?)"
            )
        items = rest.pop(src, None) or []
        if not isinstance(items, list):
            raise StepvaultError(f"{imported.source}: {src!r} is not a list")
        keys = [name if i == 0 else f"{name}_{i}" for i in range(len(items))]
        tree.update(zip(keys, items))
        layout[src] = keys
    tree["lightning"] = rest
    imported.kinds = {k: kind_for(v) for k, v in tree.items()}
    imported.kinds["model"] = "module"  # even when a model has no parameters
    imported.kinds["lightning"] = "value"
    imported.metadata["lightning_layout"] = layout
    imported.step = step_from(obj.get("global_step"), "the checkpoint's global_step")
    epoch = obj.get("epoch")
    imported.epoch = epoch if isinstance(epoch, int) and epoch >= 0 else None


def read_lightning_checkpoint(path: str, *, trust: bool = False) -> ImportedState:
    """Read a Lightning ``.ckpt`` file (see :data:`LAYOUTS` for what goes where)."""
    imported = ImportedState(
        "lightning", os.path.abspath(path), {}, {}, files=[os.path.basename(path)]
    )
    obj = load_pickle(path, trust=trust)
    _from_lightning(plain(obj) if trust else obj, imported)
    return imported


def to_lightning_checkpoint(tree: Mapping[str, Any], layout: Mapping[str, list[str]]) -> dict:
    """Rebuild Lightning's checkpoint dict from an imported tree (``Checkpoint.load()``)
    and ``metadata["lightning_layout"]``: what ``Trainer.fit(ckpt_path=...)`` reads.

    ``StepvaultCheckpoint`` does this when it resumes from an imported checkpoint. A source
    without optimizer states or schedulers (``metadata["missing"]``) gets empty lists, so
    that Lightning resumes with those fresh instead of refusing.
    """
    out = dict(tree["lightning"])
    out["state_dict"] = tree["model"]
    for src, keys in layout.items():
        out[src] = [tree[k] for k in keys]
    return out


def as_lightning(imported: ImportedState) -> ImportedState | None:
    """A torch file that is really a Lightning checkpoint (saved under a ``.pt`` name),
    split the Lightning way; None when it is not one."""
    if not _looks_like_lightning(imported.tree):
        return None
    lit = ImportedState("lightning", imported.source, {}, {}, files=imported.files)
    _from_lightning(imported.tree, lit)
    return lit


class LightningImporter(Importer):
    name = "lightning"
    suffixes = (".ckpt",)
    layout: ClassVar[dict[str, str]] = {
        "model": "module: checkpoint['state_dict']",
        "optimizer": "checkpoint['optimizer_states'][0] (optimizer_1... for the others)",
        "scheduler": "checkpoint['lr_schedulers'][0] (scheduler_1... for the others)",
        "lightning": "every other key: epoch, global_step, loops, callbacks, hyper_parameters",
    }

    def read(self, path: str, *, trust: bool = False) -> ImportedState:
        return read_lightning_checkpoint(path, trust=trust)
