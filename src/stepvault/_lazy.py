"""Lazy module attributes (PEP 562): heavy submodules (torch) are imported on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, table: dict[str, str], namespace: dict[str, Any]) -> Callable:
    """A module ``__getattr__`` that imports ``table[name]`` (relative to ``package``) on use.

    The value is stored in ``namespace`` (the module's globals), so later lookups are plain.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    return __getattr__
