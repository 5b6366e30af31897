"""What every importer shares: the state read from a foreign checkpoint, the importer
interface, and how imported values are classified into manifest kinds."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ...errors import StepvaultError

#: why an import lacks an optimizer when its source holds weights alone
WEIGHTS_ONLY = "the source holds weights only"


@dataclass
class ImportedState:
    """A foreign checkpoint read into memory, ready to be committed as ``run@step``."""

    format: str
    source: str
    tree: dict[str, Any]
    kinds: dict[str, str]
    step: int | None = None
    epoch: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    #: files that were read, relative to the source
    files: list[str] = field(default_factory=list)
    #: (file, reason) for each file left out
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: the checkpoint's metrics (e.g. HF trainer_state.json's loss at that step)
    metrics: dict[str, float] = field(default_factory=dict)
    #: small files stored with the checkpoint (config.json, tokenizer...), name -> bytes
    attachments: dict[str, bytes] = field(default_factory=dict)
    #: training state a full resume needs that the source lacks: entry -> why
    missing: dict[str, str] = field(default_factory=dict)


class Importer(ABC):
    """One source format: how to recognise it and how to read it into memory.

    ``read`` returns the tensors and values as an :class:`ImportedState` and touches no
    store; committing it is the same for every format (:func:`commit_imported`). Importers
    are stateless; the registry (:data:`IMPORTERS`) holds one instance of each.
    """

    #: the ``format=`` name (``--format`` on the command line)
    name: ClassVar[str]
    #: top-level entries this format produces (see :data:`LAYOUTS`)
    layout: ClassVar[Mapping[str, str]]
    #: True when the source is a directory, False when it is one file
    directory: ClassVar[bool] = False
    #: None when :func:`import_checkpoint` takes the format; otherwise what to use instead
    #: (DCP needs ``trust=True`` up front and has its own command, ``import-dcp``)
    elsewhere: ClassVar[str | None] = None
    #: file name suffixes of a file format (lower case, with the dot)
    suffixes: ClassVar[tuple[str, ...]] = ()

    def elsewhere_for(self, path: str) -> str | None:
        """:attr:`elsewhere` for the detected ``path`` (an importer may name what it found)."""
        return self.elsewhere

    def detect(self, path: str) -> bool:
        """Whether ``path`` (an existing file or directory) is in this format; by default a
        file whose suffix is one of :attr:`suffixes` (directory formats look inside)."""
        return not os.path.isdir(path) and os.path.splitext(path)[1].lower() in self.suffixes

    @abstractmethod
    def read(self, path: str, *, trust: bool = False) -> ImportedState:
        """Read ``path`` into memory; pickles load weights-only unless ``trust``."""


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise StepvaultError(f"{path}: not a readable JSON file ({exc})") from None


def is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and "state" in value and "param_groups" in value


def is_flat_state_dict(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def kind_for(value: Any) -> str:
    """The manifest kind of an imported top-level entry.

    A flat name → tensor mapping is a ``module`` state dict; ``state``/``param_groups`` an
    ``optimizer``; any other dict is ``stateful`` (no class recorded, so it loads into any
    live object with ``load_state_dict``, or as a plain dict).
    """
    if is_flat_state_dict(value):
        return "module"
    if is_optimizer_state(value):
        return "optimizer"
    if isinstance(value, Mapping):
        return "stateful"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, np.ndarray):
        return "ndarray"
    return "value"


def plain(value: Any) -> Any:
    """Objects a *trusted* full unpickle may yield → plain values the encoding accepts."""
    if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
        return value.state_dict()
    if callable(getattr(value, "to_json_string", None)):  # transformers' TrainingArguments
        return json.loads(value.to_json_string())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if type(value).__name__ == "Namespace" and hasattr(value, "__dict__"):  # argparse
        return plain(vars(value))
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and type(value) in (list, tuple):
        return type(value)(plain(v) for v in value)
    return value


def step_from(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value != int(value) or value < 0:
        raise StepvaultError(f"{what} is {value!r}, not a step number; pass step=N (--step N)")
    return int(value)
