"""Lazy module attributes (PEP 562): heavy submodules (torch) are imported on first use.

:func:`lazy_surface` builds a package's whole public surface from one table (name ->
defining module): ``__all__``, ``__getattr__`` and ``__dir__`` all come from it, so they
cannot drift apart. The ``if TYPE_CHECKING:`` imports that type checkers read cannot be
generated at run time; ``tests/test_public_surface.py`` checks that they name exactly the
table's entries.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

#: The value of a table entry that is a subpackage (``stepvault.errors``), not a name
#: defined in a module: ``"verify": ".verify"`` would be ambiguous between the two.
MODULE = "<module>"


def lazy_getattr(package: str, table: Mapping[str, str], namespace: dict[str, Any]) -> Callable:
    """A module ``__getattr__`` that imports ``table[name]`` (relative to ``package``) on use.

    A name whose entry is :data:`MODULE` is the subpackage of that name. The value is
    stored in ``namespace`` (the module's globals), so later lookups are plain.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if module == MODULE:
            value = importlib.import_module(f".{name}", package)
        else:
            value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    return __getattr__


def lazy_surface(
    package: str, table: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` of ``package``, all three from ``table``.

    ``__all__`` is the table's names in its order; ``__dir__`` adds what the module
    already defines (``__version__``, names looked up before).
    """

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return list(table), lazy_getattr(package, table, namespace), __dir__
