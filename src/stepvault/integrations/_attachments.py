"""The files the integrations attach to every checkpoint, so that it exports as a model
folder (``stepvault export RUN@STEP -o DIR``) with nothing added by hand.

* Transformers: the model's ``config.json`` (with ``architectures`` set, as
  ``save_pretrained`` writes it), its ``generation_config.json`` when it generates, and the
  files of the Trainer's ``processing_class`` (tokenizer, processor) as its own
  ``save_pretrained`` writes them.
* Lightning: the module's ``save_hyperparameters()`` values as ``hparams.json`` (and
  ``hparams.yaml``, the file Lightning's loggers write, when PyYAML is present).

Unchanged files cost nothing in later checkpoints (content addressing).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import warnings
from typing import Any

from ..format.attachments import MAX_ATTACHMENT_BYTES


def _saved_files(obj: Any) -> dict[str, bytes]:
    """What ``obj.save_pretrained(dir)`` writes (flat files only)."""
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="stepvault-attach-") as tmp:
        obj.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            path = os.path.join(tmp, name)
            if os.path.isfile(path) and os.path.getsize(path) <= MAX_ATTACHMENT_BYTES:
                with open(path, "rb") as f:
                    files[name] = f.read()
    return files


def transformers_files(model: Any, processing_class: Any = None) -> dict[str, bytes]:
    """config.json, generation_config.json and the processing class's files."""
    files: dict[str, bytes] = {}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        config.architectures = [type(model).__name__]  # what model.save_pretrained records
        files.update(_saved_files(config))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        files.update(_saved_files(generation))
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        try:
            files.update(_saved_files(processing_class))
        except Exception as exc:  # a processor that cannot save must not stop training
            warnings.warn(
                f"stepvault: could not attach the files of {type(processing_class).__name__}: "
                f"{exc}",
                RuntimeWarning,
                stacklevel=3,
            )
    return files


def hparams_files(hparams: Any) -> dict[str, bytes]:
    """``hparams.json`` (and ``hparams.yaml``) of Lightning's ``hyper_parameters``."""
    if not hparams:
        return {}
    plain = json.loads(json.dumps(dict(hparams), sort_keys=True, default=str))
    files = {"hparams.json": (json.dumps(plain, indent=2, sort_keys=True) + "\n").encode()}
    try:
        import yaml  # type: ignore[import-untyped]  # PyYAML ships no stubs
    except ImportError:
        return files
    files["hparams.yaml"] = yaml.safe_dump(plain, sort_keys=True).encode()
    return files
