"""Framework state → a plain tree of tensors and safe values (what the format can store)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedTypeError


def is_stateful(obj: Any) -> bool:
    """Duck-typed ``Stateful``: has callable ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def kind_of(obj: Any) -> str:
    """Kind recorded in the manifest for a top-level state entry."""
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if is_stateful(obj):
        return "stateful"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if isinstance(obj, np.ndarray):
        return "ndarray"
    return "value"


def class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def capture(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Return ``(tree, kinds)``: each top-level value replaced by its state dict.

    ``kinds`` maps each key to ``module``/``optimizer``/``stateful:<class>``/``tensor``/
    ``ndarray``/``value`` so restore can check that the live object is of the same sort.
    """
    if not isinstance(state, Mapping):
        raise UnsupportedTypeError(
            f"state must be a dict of name -> object, got {type(state).__name__}"
        )
    tree: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for key, obj in state.items():
        if not isinstance(key, str):
            raise UnsupportedTypeError(f"state keys must be str, got {key!r}")
        kind = kind_of(obj)
        if kind == "module":
            tree[key] = dict(obj.state_dict())
        elif kind in ("optimizer", "stateful"):
            tree[key] = obj.state_dict()
            if kind == "stateful":
                kind = f"stateful:{class_name(obj)}"
        else:
            tree[key] = obj
        kinds[key] = kind
    return tree, kinds
