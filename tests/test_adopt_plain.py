"""Adopting plain PyTorch checkpoints (issue 28): a ``torch.distributed.checkpoint``
directory in the ``get_state_dict`` layout, a ``torch.save`` checkpoint dict and a
safetensors weights file are imported with the real CLI, restored into fresh live objects
with ``stepvault.restore`` and trained on in a plain loop, compared bitwise with the
framework's own resume."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from typer.testing import CliRunner

import stepvault
from stepvault.cli.main import app
from stepvault.errors import ResumeGapWarning, StepvaultError

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_state_dict,
    set_state_dict,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
    )


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    with torch.no_grad():  # different from the trained weights: a restore must overwrite them
        for p in model.parameters():
            p.add_(1.0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, range(3))
    return model, opt


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


@pytest.fixture(autouse=True)
def _quiet_dcp():
    with warnings.catch_warnings():  # DCP's "assuming a single process" notice
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


@pytest.mark.parametrize("verb", ["import", "migrate"])
def test_dcp_get_state_dict_import_continues_like_dcp_resume(tmp_path, verb):
    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    assert isinstance(next(iter(osd["state"])), str)  # parameter names, not numbers
    src = tmp_path / "dcp"
    dcp.save({"model": msd, "optimizer": osd, "epoch": 3}, checkpoint_id=str(src))
    saved = {k: v.clone() for k, v in msd.items()}

    # The framework's own resume: dcp.load into the get_state_dict layout, set_state_dict.
    ref_model, ref_opt = _fresh()
    rmsd, rosd = get_state_dict(ref_model, ref_opt)
    loaded = {"model": rmsd, "optimizer": rosd, "epoch": 0}
    dcp.load(loaded, checkpoint_id=str(src))
    set_state_dict(ref_model, ref_opt, model_state_dict=rmsd, optim_state_dict=rosd)

    root = str(tmp_path / "store")
    out = _cli("--root", root, verb, str(src), "--run", "d", "--step", "3", "--trust")
    assert "model (module)" in out and "optimizer (optimizer)" in out, out
    assert "missing" not in out

    live_model, live_opt = _fresh()
    state = {"model": live_model, "optimizer": live_opt, "epoch": 0}
    stepvault.restore(root, state, run="d")
    assert state["epoch"] == 3
    assert len(live_opt.state) == len(list(live_model.parameters()))  # none ignored
    _same(live_model, ref_model)
    _train(ref_model, ref_opt, range(3, 6))
    _train(live_model, live_opt, range(3, 6))
    _same(live_model, ref_model)  # training continues bitwise like DCP's resume
    _train(model, opt, range(3, 6))
    _same(live_model, model)  # ... and like the run that never stopped

    exported = tmp_path / "export"
    _cli("--root", root, "export", "d@3", "-o", str(exported))
    from safetensors.torch import load_file

    weights = load_file(str(exported / "model.safetensors"))
    assert set(weights) == set(saved)
    assert all(torch.equal(weights[k], saved[k]) for k in saved)


def test_dcp_flattened_optimizer_import_continues_like_dcp_resume(tmp_path):
    """``StateDictOptions(flatten_optimizer_state_dict=True)`` (torchtitan, pipeline
    parallelism) writes ``state.<fqn>.<key>`` / ``param_groups.<fqn>.<key>``: it used to
    come in as a plain dict that a restore could not put into an optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def groups(model: torch.nn.Module) -> torch.optim.Optimizer:
        first, *rest = list(model.children())
        return torch.optim.AdamW(
            [
                {"params": first.parameters(), "lr": 1e-2},
                {"params": [p for m in rest for p in m.parameters()], "lr": 3e-3},
            ],
            weight_decay=0.1,
        )

    model = _model()
    opt = groups(model)
    _train(model, opt, range(3))
    msd, osd = get_state_dict(model, opt, options=flat)
    assert next(iter(osd)).startswith("state.")  # the flat layout
    src = tmp_path / "dcp"
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(src))

    ref_model = _fresh()[0]
    ref_opt = groups(ref_model)
    rmsd, rosd = get_state_dict(ref_model, ref_opt, options=flat)
    dcp.load({"model": rmsd, "optimizer": rosd}, checkpoint_id=str(src))
    set_state_dict(ref_model, ref_opt, model_state_dict=rmsd, optim_state_dict=rosd, options=flat)

    root = str(tmp_path / "store")
    out = _cli("--root", root, "import", str(src), "--run", "f", "--step", "3", "--trust")
    assert "optimizer (optimizer)" in out, out
    live_model = _fresh()[0]
    live_opt = groups(live_model)
    stepvault.restore(root, {"model": live_model, "optimizer": live_opt}, run="f")
    assert [g["lr"] for g in live_opt.param_groups] == [1e-2, 3e-3]
    assert len(live_opt.state) == len(list(live_model.parameters()))
    _train(ref_model, ref_opt, range(3, 6))
    _train(live_model, live_opt, range(3, 6))
    _same(live_model, ref_model)  # bitwise like DCP's own resume of the flat layout
    _train(model, opt, range(3, 6))
    _same(live_model, model)


def test_import_dcp_command_stores_kinds(tmp_path):
    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    src = tmp_path / "dcp"
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(src))
    root = str(tmp_path / "store")
    _cli("--root", root, "import-dcp", str(src), "--run", "d", "--step", "3", "--trust")
    live_model, live_opt = _fresh()
    stepvault.restore(root, {"model": live_model, "optimizer": live_opt}, run="d")
    assert live_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    _same(live_model, model)


def test_dcp_without_step_or_trust_is_a_clear_error(tmp_path):
    model, _ = _trained()
    src = tmp_path / "dcp"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(src))
    root = str(tmp_path / "store")
    for extra, needle in (([], "--step"), (["--step", "1"], "--trust")):
        result = CliRunner().invoke(app, ["--root", root, "import", str(src), "--run", "d", *extra])
        assert result.exit_code == 2 and needle in result.output, result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "store").exists()


def test_optimizer_state_the_groups_do_not_list_is_refused(tmp_path):
    model, opt = _trained()
    _, osd = get_state_dict(model, opt)
    osd["param_groups"][0]["params"] = osd["param_groups"][0]["params"][1:]
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": osd, "step": 3}, path)
    from stepvault.ops.migrate import import_checkpoint

    with pytest.raises(StepvaultError, match="load_state_dict would ignore it"):
        import_checkpoint(tmp_path / "store", path, run="t")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("layout", ["state_dict", "get_state_dict"])
def test_torch_save_dict_import_continues_like_torch_resume(tmp_path, layout):
    model, opt = _trained()
    osd = opt.state_dict() if layout == "state_dict" else get_state_dict(model, opt)[1]
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": osd, "epoch": 2, "step": 3}, path)

    ref_model, ref_opt = _fresh()  # the plain resume torch users write
    ckpt = torch.load(path, weights_only=True)
    ref_model.load_state_dict(ckpt["model"])
    if layout == "state_dict":
        ref_opt.load_state_dict(ckpt["optimizer"])
    else:
        set_state_dict(ref_model, ref_opt, model_state_dict={}, optim_state_dict=ckpt["optimizer"])

    root = str(tmp_path / "store")
    out = _cli("--root", root, "import", str(path), "--run", "t")
    assert "as t@3" in out and "optimizer (optimizer)" in out, out
    live_model, live_opt = _fresh()
    state = {"model": live_model, "optimizer": live_opt, "epoch": 0, "step": 0}
    stepvault.restore(root, state, run="t")
    assert (state["epoch"], state["step"]) == (2, 3) and len(live_opt.state) == 6
    _train(ref_model, ref_opt, range(3, 6))
    _train(live_model, live_opt, range(3, 6))
    _same(live_model, ref_model)


def test_safetensors_weights_import_says_it_has_no_optimizer(tmp_path):
    from safetensors.torch import save_file

    model, _ = _trained()
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(path))
    root = str(tmp_path / "store")
    # The real CLI in a subprocess: the note is in what the user reads.
    cli = os.path.join(os.path.dirname(sys.executable), "stepvault")
    done = subprocess.run(
        [cli, "--root", root, "migrate", str(path), "--run", "w", "--step", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "missing optimizer: the source holds weights only" in done.stdout, done.stdout
    ckpt = stepvault.open(root).checkpoint("w@0")
    assert ckpt.metadata["missing"] == {"optimizer": "the source holds weights only"}

    # Weights: a plain loop fine-tunes from them exactly as from load_state_dict.
    live_model, _ = _fresh()
    stepvault.restore(root, {"model": live_model}, run="w")
    ref_model, _ = _fresh()
    ref_model.load_state_dict(model.state_dict())
    live_opt = torch.optim.AdamW(live_model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(ref_model, ref_opt, range(3, 5))
    _train(live_model, live_opt, range(3, 5))
    _same(live_model, ref_model)

    # A full resume: strict says what is missing, strict=False warns.
    full_model, full_opt = _fresh()
    with pytest.raises(StepvaultError, match="optimizer: not in checkpoint"):
        stepvault.restore(root, {"model": full_model, "optimizer": full_opt}, run="w")
    with pytest.warns(
        ResumeGapWarning, match=r"holds no optimizer \(the source holds weights only\)"
    ):
        stepvault.restore(root, {"model": full_model, "optimizer": full_opt}, run="w", strict=False)


def test_migrate_is_listed_as_an_alias():
    out = _cli("--help")
    assert "migrate" in out and "import" in out
    assert "Alias of" in _cli("migrate", "--help")


def test_dcp_tutorial_app_state_layout_continues_like_dcp_resume(tmp_path):
    """The DCP tutorial's layout: one Stateful whose state dict is get_state_dict's pair."""
    from torch.distributed.checkpoint.stateful import Stateful

    class AppState(Stateful):
        def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            self.model, self.opt = model, opt

        def state_dict(self) -> dict:
            msd, osd = get_state_dict(self.model, self.opt)
            return {"model": msd, "optim": osd}

        def load_state_dict(self, sd: dict) -> None:
            set_state_dict(
                self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
            )

    model, opt = _trained()
    src = tmp_path / "dcp"
    dcp.save({"app": AppState(model, opt)}, checkpoint_id=str(src))
    ref_model, ref_opt = _fresh()
    dcp.load({"app": AppState(ref_model, ref_opt)}, checkpoint_id=str(src))

    root = str(tmp_path / "store")
    _cli("--root", root, "import", str(src), "--run", "app", "--step", "3", "--trust")
    live_model, live_opt = _fresh()
    stepvault.restore(root, {"app": AppState(live_model, live_opt)}, run="app")
    assert len(live_opt.state) == len(list(live_model.parameters()))
    _train(ref_model, ref_opt, range(3, 6))
    _train(live_model, live_opt, range(3, 6))
    _same(live_model, ref_model)


def test_imports_of_older_stores_still_warn_with_their_lacks_list(tmp_path):
    """Before the key was unified an import recorded ``metadata["lacks"]`` (a list); a
    resume from such a checkpoint still warns, with the same warning class."""
    model, _ = _trained()
    root = str(tmp_path / "store")
    stepvault.save(
        root,
        {"model": model},
        run="old",
        step=1,
        metadata={"imported_from": "/data/w.safetensors", "lacks": ["optimizer"]},
    )
    live_model, live_opt = _fresh()
    with pytest.warns(ResumeGapWarning, match=r"imported from /data/w.safetensors.*optimizer"):
        stepvault.restore(
            root, {"model": live_model, "optimizer": live_opt}, run="old", strict=False
        )
    _same(live_model, model)
