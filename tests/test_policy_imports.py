"""The policy package has no import circle and sits below the layers that use it.

``a | b`` used to import the union class back from ``save``/``keep`` inside ``base``: a
circle hidden in a function body. These checks read every import statement of the
package, at any depth, so a function-level back-import fails them too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "stepvault" / "policy"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
# Layers above policy (DESIGN.md): policy must not reach up into them.
ABOVE = ("manager", "tiers", "catalog", "registry", "ops", "cli", "integrations", "ui", "api")


def _imports(module: str) -> set[str]:
    """Absolute names (``stepvault.policy.base``...) imported anywhere in ``module``."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["stepvault", "policy"][: 3 - node.level]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            # `from . import keep` names a module, not an attribute.
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    return {
        m: {n.rsplit(".", 1)[1] for n in _imports(m) if n.startswith("stepvault.policy.")}
        & set(MODULES)
        for m in MODULES
    }


def test_the_package_has_the_modules_this_test_checks():
    assert {"base", "keep", "save", "tier", "validate"} <= set(MODULES)


def test_no_import_circle_inside_policy_even_in_function_bodies():
    graph = _graph()
    # base is the bottom: the interfaces import no rule module.
    assert not graph["base"], graph["base"]
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                pytest.fail("import circle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [])


def test_policy_does_not_import_the_layers_above_it():
    for module in [*MODULES, "__init__"]:
        upward = [
            name
            for name in _imports(module)
            for layer in ABOVE
            if name == f"stepvault.{layer}" or name.startswith(f"stepvault.{layer}.")
        ]
        assert not upward, f"policy/{module}.py imports {upward}"


@pytest.mark.parametrize("first", MODULES)
def test_each_module_imports_first_in_a_fresh_interpreter(first):
    # Importing any module first (then the rest) must work and build the unions.
    others = [m for m in MODULES if m != first]
    code = "\n".join(
        [
            "import importlib",
            f"importlib.import_module('stepvault.policy.{first}')",
            *[f"importlib.import_module('stepvault.policy.{m}')" for m in others],
            "from stepvault.policy import KeepAny, KeepLast, KeepBest, AnyOf, Every",
            "assert isinstance(KeepLast(1) | KeepBest(1, 'loss'), KeepAny)",
            "assert isinstance(Every(steps=2) | Every(minutes=1), AnyOf)",
            "from stepvault.tiers import HotLast, CopyEvery, TierAny",
            "assert isinstance(HotLast(1) | CopyEvery('cold', steps=2), TierAny)",
        ]
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
