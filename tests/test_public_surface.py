"""The public surface is generated from one list (``stepvault._PUBLIC``): ``__all__``,
``dir()``, the lazy lookups and the type checkers' imports must name the same things;
every exception lives in ``stepvault.errors``; "latest" means one thing everywhere."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stepvault
from stepvault._lazy import MODULE

INIT = Path(stepvault.__file__)
SRC = INIT.parent


def _type_checking_imports(path: Path) -> dict[str, str]:
    """name -> module of every import under ``if TYPE_CHECKING:`` in ``path``."""
    tree = ast.parse(path.read_text())
    blocks = [
        n
        for n in tree.body
        if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1, "one `if TYPE_CHECKING:` block"
    found: dict[str, str] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.dump(node)
        for alias in node.names:
            # "X as X": an explicit re-export for checkers that cannot read __all__
            assert alias.asname in (None, alias.name), alias.name
            assert alias.name not in found, f"{alias.name} imported twice"
            found[alias.name] = MODULE if node.module is None else f".{node.module}"
    return found


def test_one_list_gives_all_dir_and_the_type_checking_imports():
    table = stepvault._PUBLIC
    assert stepvault.__all__ == list(table)
    assert _type_checking_imports(INIT) == table
    assert set(table) <= set(dir(stepvault))
    assert "__version__" in dir(stepvault)


def test_the_top_level_is_small_and_every_name_resolves_to_its_module():
    names = [n for n, m in stepvault._PUBLIC.items() if m != MODULE]
    assert 20 <= len(names) <= 25, names
    for name, module in stepvault._PUBLIC.items():
        value = getattr(stepvault, name)
        if module == MODULE:
            assert inspect.ismodule(value) and value.__name__ == f"stepvault.{name}"
        else:
            assert value is getattr(sys.modules[f"stepvault{module}"], name), name
    namespace: dict = {}
    exec("from stepvault import *", namespace)
    assert namespace["restore"] is stepvault.restore
    with pytest.raises(AttributeError, match="no_such_name"):
        stepvault.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "gone",
    ["CheckpointSummary", "verify", "Registry", "Signer", "StepvaultError", "LeaseHeldError"],
)
def test_names_that_moved_to_a_namespace_are_not_at_the_top(gone):
    with pytest.raises(AttributeError):
        getattr(stepvault, gone)


def test_namespaces_hold_what_left_the_top_level():
    assert stepvault.ops.verify.__module__ == "stepvault.ops.verify"
    for name in ("annotate", "hold", "usage", "parse_ref", "resolve_ref"):
        assert name in stepvault.ops.__all__ and callable(getattr(stepvault.ops, name))
    for name in ("Registry", "ModelVersion", "RegistryError", "Lineage", "fingerprint_files"):
        assert getattr(stepvault.registry, name) is not None
    assert stepvault.signing.Signer.__module__ == "stepvault.store.signing"
    assert stepvault.signing.SigningError is stepvault.errors.SigningError
    assert callable(stepvault.state.register_type) and callable(stepvault.planning.plan)
    for name in ("AtSteps", "FirstStep", "KeepPinned", "KeepPeriodic", "MoveAfter", "MemLast"):
        assert name in stepvault.policy.__all__


def test_shims_are_gone():
    for module in ("stepvault.dist", "stepvault.ops.importing"):
        with pytest.raises(ModuleNotFoundError):
            __import__(module)
    assert not hasattr(stepvault.catalog.vault, "CheckpointSummary")


def _exception_classes() -> dict[str, str]:
    """name -> file of every class deriving from an exception, defined anywhere in src."""
    classes = []  # (name, base names, file) of every class in src
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                classes.append((node.name, bases, str(path.relative_to(SRC))))
    out: dict[str, str] = {}
    grew = True
    while grew:  # a class deriving from one found already counts too (PreconditionFailed)
        grew = False
        for name, bases, where in classes:
            if name not in out and any(
                b.endswith(("Error", "Exception", "Warning")) or b in out for b in bases
            ):
                out[name] = where
                grew = True
    return out


#: Not errors: control flow that must not be caught as one (``except Exception``).
SIGNALS = {"Interrupted": "testing/resume_check.py"}  # a BaseException, like KeyboardInterrupt


def test_every_exception_is_defined_in_errors():
    classes = _exception_classes()
    for name, where in SIGNALS.items():
        assert classes.pop(name) == where
    outside = {n: f for n, f in classes.items() if f != "errors.py"}
    assert outside == {}, "define exceptions and warnings in stepvault/errors.py"
    errors = stepvault.errors
    assert sorted(errors.__all__) == sorted(classes)
    for name in errors.__all__:
        cls = getattr(errors, name)
        # errors derive from StepvaultError; warnings from a standard warning category
        base = Warning if name.endswith("Warning") else errors.StepvaultError
        assert issubclass(cls, base), name
    # the old homes still name the same class (their users import it from there)
    from stepvault.store.lease import LeaseHeldError
    from stepvault.tiers import TierError
    from stepvault.ui.readonly import ReadOnlyError

    assert LeaseHeldError is errors.LeaseHeldError and TierError is errors.TierError
    assert issubclass(ReadOnlyError, PermissionError)  # read-only credentials look alike


def test_import_stepvault_and_every_namespace_but_state_without_torch():
    code = (
        "import sys, json, stepvault\n"
        "names = ['errors', 'ops', 'policy', 'registry', 'signing', 'planning']\n"
        "for n in names: getattr(stepvault, n)\n"
        "print(json.dumps('torch' in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False


# -- "latest" means the newest full checkpoint, everywhere ---------------------------------


def _run_with_a_newer_light_and_weights_checkpoint(root: Path) -> dict:
    """Steps 1, 2 full; 3 light; 4 weights-only (what a KeepLast run of a thinned or a
    light-saving job leaves): 'latest' is 2 everywhere."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    state = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    with stepvault.CheckpointManager(root, "r", async_save=False, lineage=False) as mgr:
        mgr.save(1, state, force=True)
        mgr.save(2, state, force=True)
        mgr.save(3, state, force=True, kind="light")
        mgr.save(4, state, force=True, kind="weights")
        mgr.wait()
        assert [r.kind for r in mgr.checkpoints()] == ["full", "full", "light", "weights"]
        assert mgr.latest_step == 2  # was 4: the newest of any kind
    return state


def test_latest_is_the_newest_full_checkpoint_everywhere(tmp_path):
    state = _run_with_a_newer_light_and_weights_checkpoint(tmp_path)
    assert stepvault.restore(tmp_path, state, run="r").step == 2
    vault = stepvault.open(tmp_path)
    assert vault.checkpoint("r").step == 2  # was 4
    assert vault.checkpoint("r@latest").step == 2
    assert vault.checkpoint("r", 4).manifest.kind == "weights"  # named: taken as it is
    assert stepvault.ops.resolve_ref(vault.store, "r@latest") == ("r", 2)
    assert stepvault.ops.resolve_ref(vault.store, "r@3") == ("r", 3)
    with stepvault.ops.hold(tmp_path, "r@latest", ttl=60, owner="t") as held:
        assert held.record.step == 2  # was 4
    from typer.testing import CliRunner

    from stepvault.cli.main import app

    out = CliRunner().invoke(app, ["--root", str(tmp_path), "hold", "r@latest", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["step"] == 2


def test_no_full_checkpoint_is_one_clear_error(tmp_path):
    model = torch.nn.Linear(8, 8)
    stepvault.save(tmp_path, {"model": model}, run="w", step=5, kind="weights")
    store = stepvault.open(tmp_path).store
    errors = stepvault.errors
    # every resolver raises the same error, naming the step to ask for instead
    for resolve in (
        lambda: stepvault.open(tmp_path).checkpoint("w@latest"),
        lambda: stepvault.ops.hold(tmp_path, "w"),
        lambda: stepvault.ops.resolve_ref(store, "w@latest"),
    ):
        with pytest.raises(errors.CheckpointNotFoundError, match=r"no full checkpoint.*w@5"):
            resolve()
    with pytest.raises(errors.CheckpointNotFoundError, match="no committed checkpoint"):
        stepvault.ops.resolve_ref(store, "nothing@latest")
    with pytest.raises(errors.InvalidNameError, match="RUN@STEP"):
        stepvault.ops.resolve_ref(store, "w@@1")
