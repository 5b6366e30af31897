"""Start-up cost of the command line: listing and inspecting a store must not import torch.

``stepvault ls`` on 10k checkpoints took 3.7 s in a new process, ~2.5 s of it importing
torch for a command that only reads JSON. These run the real command in a new
interpreter and look at ``sys.modules`` when it is done.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import cli_in_new_process

import stepvault


def _cli(*args: str) -> tuple[str, dict[str, bool]]:
    out, _, mods = cli_in_new_process(*args, modules=("torch", "stepvault.api"))
    return out, mods


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, stepvault.cli.main; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_ls_and_show_run_without_torch(tmp_path):
    model = torch.nn.Linear(4, 3)
    for step in (1, 2):
        stepvault.save(
            tmp_path,
            {"model": model, "epoch": step},
            run="r",
            step=step,
            metrics={"loss": 1.0 / step},
        )
    out, mods = _cli("--root", str(tmp_path), "ls", "r", "--json")
    rows = json.loads(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["metrics"] == {"loss": 0.5}
    assert mods == {"torch": False, "stepvault.api": False}
    out, mods = _cli("--root", str(tmp_path), "ls", "--json")
    assert json.loads(out) == [{"run": "r", "checkpoints": 2, "latest": 2}]
    assert not mods["torch"]
    out, mods = _cli("--root", str(tmp_path), "show", "r@2")
    assert out.startswith("r@2") and "tensors: 2" in out
    assert not mods["torch"]


def test_verify_and_du_run_without_torch(tmp_path):
    stepvault.save(tmp_path, {"model": torch.nn.Linear(4, 3)}, run="r", step=1)
    for args in (["verify"], ["verify", "--deep"], ["du"]):
        out, mods = _cli("--root", str(tmp_path), *args)
        assert out.strip(), args
        assert not mods["torch"], args


def test_ops_names_resolve_lazily():
    import stepvault.ops as ops

    for name in ops.__all__:
        assert getattr(ops, name) is not None, name
    from stepvault.ops.gc import collect_garbage

    assert ops.collect_garbage is collect_garbage
    with pytest.raises(AttributeError, match="no_such_op"):
        ops.no_such_op  # noqa: B018
