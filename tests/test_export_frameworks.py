"""Sharded checkpoints of the frameworks exported to a ``from_pretrained`` folder (issue 30):
a transformers model trained by 2 processes through Lightning's ``ModelParallelStrategy``
(FSDP2) inside a LightningModule, and through Accelerate with FSDP2 and with DeepSpeed
ZeRO-2/3. Each job saves through stepvault's integration; the test exports its checkpoint
(one tensor at a time) and loads the folder with ``from_pretrained``: the logits equal the
job's own (its sharded model, eval mode) on the same input.

Multi-process framework jobs: ``extended`` (outside CI's runs; ``-m extended``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the jobs' model configs and inputs


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")])
    return env


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def _torchrun(script: str, *args: str) -> None:
    _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(SCRIPTS / script), *args]
    )  # fmt: skip


def _logits_of(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.slow
@pytest.mark.extended
def test_lightning_model_parallel_export_of_a_transformers_module_loads_with_from_pretrained(
    tmp_path,
):
    pytest.importorskip("lightning.pytorch")
    from lightning_hf_export_job import LanguageModel, tokens
    from typer.testing import CliRunner

    from stepvault.cli.main import app
    from stepvault.ops.export_hf import export_checkpoint
    from stepvault.store import Store

    store = tmp_path / "store"
    _run([sys.executable, str(SCRIPTS / "lightning_hf_export_job.py"), "--root", str(store),
          "--out", str(tmp_path / "logits.pt")])  # fmt: skip
    job = torch.load(tmp_path / "logits.pt")

    # the API: the LightningModule itself names its transformers model (config, prefix)
    folder = tmp_path / "hf"
    report = export_checkpoint(Store.open(store), "lm", 4, folder, config=LanguageModel())
    assert report.format == "hf" and "lm_head.weight" in report.tied
    torch.testing.assert_close(_logits_of(folder, tokens()), job, rtol=1e-5, atol=1e-5)

    # the CLI: a config.json and the prefix of the model inside the LightningModule
    LanguageModel().model.save_pretrained(tmp_path / "cfg")  # what a user has at hand
    out = CliRunner().invoke(
        app,
        ["export", "lm@4", "-o", str(tmp_path / "hf2"), "--root", str(store),
         "--config", str(tmp_path / "cfg"), "--strip-prefix", "model.", "--json"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["format"] == "hf"
    torch.testing.assert_close(_logits_of(tmp_path / "hf2", tokens()), job, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize(
    "backend,stage", [("fsdp2", 0), ("deepspeed", 2), ("deepspeed", 3)], ids=str
)
def test_accelerate_export_loads_with_from_pretrained(tmp_path, backend, stage):
    pytest.importorskip("accelerate")
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    from accelerate_hf_export_job import CONFIG, tokens
    from transformers import GPT2Config

    from stepvault.ops.export_hf import export_checkpoint
    from stepvault.store import Store

    store = tmp_path / "store"
    _torchrun("accelerate_hf_export_job.py", "--backend", backend, "--stage", str(stage),
              "--root", str(store), "--out", str(tmp_path / "logits.pt"))  # fmt: skip
    job = torch.load(tmp_path / "logits.pt")
    config = GPT2Config(**CONFIG, architectures=["GPT2LMHeadModel"])
    folder = tmp_path / "hf"
    report = export_checkpoint(Store.open(store), "acc", 3, folder, config=config.to_dict())
    assert report.format == "hf"
    torch.testing.assert_close(_logits_of(folder, tokens()), job, rtol=1e-5, atol=1e-5)
