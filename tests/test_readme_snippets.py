"""Every code block of the README runs as written (issue 28).

Each fenced block is listed in :data:`SNIPPETS` by a line it contains, with what runs it:

- ``Run``: the block itself, in a fresh process in an empty directory. A block that is a
  fragment of a larger program (``model`` defined earlier, a GPU job's mesh...) gets a
  ``prelude`` that makes that context, never a changed line of its own; ``paths`` maps a
  path of the example (``/ssd/ckpts``, ``s3://bucket/...``) to one under the test's
  directory. Bash blocks run line by line through ``bash -e`` with ``stepvault`` on PATH.
- ``Elsewhere``: a block another test runs as written (named, and checked to exist), or
  one that cannot run inside a test (the set-up commands are what CI runs; the dashboard
  is a server the browser test starts).

A README block that is in neither fails :func:`test_every_readme_block_is_accounted_for`:
a new example cannot land untested.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Run:
    prelude: str = ""
    paths: dict[str, str] = field(default_factory=dict)
    #: after the block: checks of what it did (python blocks), run in the same process
    check: str = ""
    #: torchrun with this many processes (a block written for every rank)
    ranks: int = 0
    slow: bool = False


@dataclass(frozen=True)
class Elsewhere:
    why: str
    #: "tests/file.py::test_name" that runs the block as written
    test: str = ""


# A small checkpoint store the read-side examples open: run exp1, steps 9000 and 12000 of
# a Linear model (its tensor "model/weight"), with a config.json for an HF-style export.
_STORE = """
import json, torch, stepvault
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(10, 128))
        self.bias = torch.nn.Parameter(torch.zeros(10))
    def forward(self, x):
        return x @ self.weight.T + self.bias
torch.manual_seed(0)
_net = Net()
for _step in (9000, 12000):
    stepvault.save("ckpts", {"model": _net}, run="exp1", step=_step, metrics={"val_loss": 2.5})
"""

# A run a CheckpointManager wrote: plan measures its save cost and step time from its log.
_MANAGED = """
import time, torch, stepvault
m = torch.nn.Linear(64, 64)
with stepvault.CheckpointManager("ckpts", run="exp1", save=stepvault.Every(steps=10)) as mgr:
    for step in range(1, 51):
        time.sleep(0.01)  # a training step
        mgr.save(step, {"model": m})
"""

_LIGHTNING = """
import torch, lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from stepvault import Every, KeepLast

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Data(pl.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(400, 4, generator=g)  # 50 steps an epoch: Every(steps=500) saves once
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

model, dm = Model(), Data()
"""

_RANKS = """
import functools, os, torch, torch.distributed as dist, stepvault
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as _fully_shard
from stepvault import CheckpointManager, Every, KeepLast
dist.init_process_group("gloo")
# a GPU job's default mesh is CUDA; on these CPU machines the mesh is made explicitly
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
fully_shard = functools.partial(_fully_shard, mesh=mesh)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
step = 1000
"""

SNIPPETS: dict[str, Run | Elsewhere] = {
    "./scripts/demo.sh     #": Elsewhere("the set-up commands: .ci/run runs ./scripts/test.sh"),
    "info = stepvault.restore(": Elsewhere(
        "the quick start", "tests/test_docs_api.py::test_readme_quick_start_runs_and_resumes"
    ),
    'KeepBest(3, metric="val_loss", mode="min")': Elsewhere(
        "the manager example",
        "tests/test_docs_api.py::test_readme_manager_example_runs_keeps_by_val_loss_and_resumes",
    ),
    "StagingOptions(memory=": Elsewhere(
        "the options example", "tests/test_docs_api.py::test_readme_options_example_runs"
    ),
    "MemOptions(budget=": Elsewhere(
        "the mem tier example", "tests/test_docs_api.py::test_readme_mem_tier_example_runs"
    ),
    "pip install 'stepvault[ui]'": Elsewhere(
        "a server", "tests/test_ui_browser.py::test_every_page_renders_without_console_errors"
    ),
    "stepvault --root ckpts ls                    # runs": Elsewhere(
        "the CLI synopsis ([optional] parts): every command and option it names exists",
        "tests/test_readme_snippets.py::test_the_cli_synopsis_names_real_commands_and_options",
    ),
    "model = fully_shard(model)": Run(
        prelude=_RANKS,
        ranks=2,
        check="mgr.close()\nassert mgr.latest_step == 1000\ndist.destroy_process_group()",
        slow=True,
    ),
    "ArchiveProtected(": Run(
        paths={"/ssd/ckpts": "ssd", "s3://bucket/ckpts": "archive"},
        check=(
            "import torch\nm = torch.nn.Linear(4, 4)\n"
            "for s in range(1, 11):\n    mgr.save(s, {'model': m})\n"
            "mgr.close()\nimport stepvault\n"
            "assert stepvault.open('ssd').steps('exp1')[-1] == 10"
        ),
        slow=True,
    ),
    "StepvaultCheckpoint(": Run(
        prelude=_LIGHTNING,
        check="import stepvault\nassert trainer.global_step == 500\n"
        "assert stepvault.open('ckpts').steps('exp1') == [500]",
        slow=True,
    ),
    "vault = stepvault.open(": Run(
        prelude=_STORE, check="assert w.shape == (10, 128) and 'model' in everything"
    ),
    "weights = ckpt.load(mmap=True)": Run(
        prelude=_STORE + "ckpt = stepvault.open('ckpts').checkpoint('exp1@12000')\n",
        check="assert torch.equal(model.weight, _net.weight)",
    ),
    "stepvault export gpt@2000": Elsewhere(
        "the same command on a trained GPT-2, loaded by from_pretrained (running the block "
        "here would add two transformers imports for the same path)",
        "tests/test_export_hf.py::test_gpt2_export_loads_with_no_warnings_and_same_logits",
    ),
    "stepvault annotate exp1@9000": Run(prelude=_STORE, slow=True),
    "stepvault plan exp1 --mtbf 24h": Run(prelude=_MANAGED, slow=True),
}


def _blocks() -> list[tuple[str, str]]:
    """(language, body) of every fenced block of the README, in order."""
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer((ROOT / "README.md").read_text())]


def _entry(body: str) -> tuple[str, Run | Elsewhere] | None:
    found = [(marker, how) for marker, how in SNIPPETS.items() if marker in body]
    return found[0] if len(found) == 1 else None


def test_every_readme_block_is_accounted_for() -> None:
    unlisted = [body.splitlines()[0] for _, body in _blocks() if _entry(body) is None]
    assert not unlisted, (
        "README blocks with no entry (or two) in SNIPPETS; add how each runs:\n"
        + "\n".join(unlisted)
    )
    used = {marker for _, body in _blocks() for marker, _ in [_entry(body) or ("", None)]}
    assert set(SNIPPETS) <= used, f"SNIPPETS entries for blocks gone: {set(SNIPPETS) - used}"


def test_the_tests_named_for_blocks_exist() -> None:
    for how in SNIPPETS.values():
        if isinstance(how, Elsewhere) and how.test:
            path, _, name = how.test.partition("::")
            assert f"def {name}(" in (ROOT / path).read_text(), how.test


def _runnable() -> list:
    out = []
    for lang, body in _blocks():
        found = _entry(body)
        if found and isinstance(found[1], Run):
            marks = [pytest.mark.slow] if found[1].slow else []
            out.append(pytest.param(lang, body, found[1], id=found[0][:30], marks=marks))
    return out


def _env(cwd: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "STEPVAULT_MEM_ROOT": str(cwd / "shm"),
        "PYTHONWARNINGS": "ignore",
    }


@pytest.mark.parametrize(("lang", "body", "how"), _runnable())
def test_readme_block_runs_as_written(tmp_path: Path, lang: str, body: str, how: Run) -> None:
    for path, local in how.paths.items():
        body = body.replace(path, str(tmp_path / local))
    env = _env(tmp_path)
    if how.prelude:
        setup = how.prelude
        if lang == "bash":  # the store the commands work on, made by Python first
            done = subprocess.run(
                [sys.executable, "-c", textwrap.dedent(setup)],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stderr
    if lang == "bash":
        script = "set -e\n" + body
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        if how.check:
            done = subprocess.run(
                [sys.executable, "-c", how.check],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stderr
        return
    code = textwrap.dedent(how.prelude) + "\n" + body + "\n" + how.check + "\n"
    script = tmp_path / "snippet.py"
    script.write_text(code)
    if how.ranks:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={how.ranks}",
            str(script),
        ]
    else:
        cmd = [sys.executable, str(script)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"


def test_the_cli_synopsis_names_real_commands_and_options() -> None:
    """Each line of the README's CLI block names a command (and subcommand) that exists
    and only options that command takes (its ``--help`` lists them)."""
    from typer.testing import CliRunner

    from stepvault.cli.main import app

    body = next(b for _, b in _blocks() if "stepvault --root ckpts ls " in b)
    checked = 0
    for line in body.splitlines():
        code = line.split("#", 1)[0]
        # "a | b | c" alternatives: each part is its own command line
        for part in code.split(" | "):
            words = [w for w in part.replace("[", " ").replace("]", " ").split() if w]
            if words and words[0] == "stepvault":
                words = words[1:]
            if words[:2] == ["--root", "ckpts"]:
                words = words[2:]
            if not words or not re.fullmatch(r"[a-z][a-z-]*", words[0]):
                continue
            command = words[:1]
            if len(words) > 1 and re.fullmatch(r"[a-z][a-z-]*", words[1]):
                sub = CliRunner().invoke(app, [*command, words[1], "--help"])
                if sub.exit_code == 0:
                    command.append(words[1])
            shown = CliRunner().invoke(app, [*command, "--help"], terminal_width=200)
            assert shown.exit_code == 0, f"{line}: no command {' '.join(command)}"
            for option in re.findall(r"(?<![\w-])--[a-z][a-z-]*", part):
                if option != "--root":
                    assert option in shown.output, f"{line}: {' '.join(command)} has no {option}"
            checked += 1
    assert checked >= 25
