"""Import of the HF Trainer's FSDP2 ``checkpoint-N`` folder as ONE resumable checkpoint.

A real 2-process Trainer job (torchrun, gloo on CPU, FSDP2 through the test-only patch of
``scripts/transformers_sharded_train.py``) checkpoints with the Trainer's own save: with
``FULL_STATE_DICT``, ``model.safetensors``, ``pytorch_model_fsdp.bin`` and ``optimizer.bin``
(keyed by parameter names); with ``SHARDED_STATE_DICT``, the DCP folders
``pytorch_model_fsdp_0/`` and ``optimizer_0/``; then ``scheduler.pt``,
``rng_state_<rank>.pth``, ``trainer_state.json``. The folder is imported with the CLI;
``StepvaultTrainer`` resumes from the import on 2 FSDP2 ranks and ends bitwise where the
Trainer's own resume of the same folder ends (weights, both Adam moments, LR, every rank's
RNG draw). Before, the import left ``optimizer.bin`` out (the resume started the optimizer
fresh), refused the sharded folder, and the sharded resume found no TrainerState to place
the data by.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch

import stepvault

pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

SCRIPT = Path(__file__).parent / "scripts" / "transformers_sharded_train.py"


def _run(*args: str, timeout: float = 400) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*cmd, "--nproc_per_node", "2", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return done.stdout


@pytest.mark.parametrize(
    ("state_dict_type", "optimizer_file"),
    [("FULL_STATE_DICT", "optimizer.bin"), ("SHARDED_STATE_DICT", "optimizer_0")],
)
def test_trainer_fsdp2_checkpoint_import_resumes_bitwise_like_the_trainers_own(
    tmp_path, state_dict_type, optimizer_file
):
    common = ["--shard", "fsdp2", "--save-every", "4", "--state-dict-type", state_dict_type]
    native = tmp_path / "native"
    _run(*common, "--backend", "native", "--root", str(native), "--max-steps", "4")
    folder = native / "checkpoint-4"
    files = set(os.listdir(folder))
    assert {optimizer_file, "rng_state_1.pth", "trainer_state.json"} <= files, files
    theirs = tmp_path / "theirs"  # the Trainer's own resume writes checkpoint-8 beside it
    shutil.copytree(native, theirs)

    store = tmp_path / "store"
    cli = [sys.executable, "-m", "stepvault.cli.main", "--root", str(store), "import"]
    done = subprocess.run(
        [*cli, str(folder), "--run", "gpt", "--trust"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "missing" not in done.stdout, done.stdout
    kinds = stepvault.open(store).manifest("gpt", 4).state_kinds
    assert kinds["optimizer"] == "optimizer" and "rng_ranks" in kinds, kinds

    ours_final, theirs_final = tmp_path / "ours.pt", tmp_path / "theirs.pt"
    out = _run(*common, "--root", str(store), "--max-steps", "8", "--resume",
               "--final", str(ours_final))  # fmt: skip
    assert "RESUMED 4 skipped=0" in out, out
    _run(*common, "--backend", "native", "--root", str(theirs), "--max-steps", "8",
         "--resume", "--final", str(theirs_final))  # fmt: skip
    want, got = torch.load(theirs_final), torch.load(ours_final)
    assert want.keys() == got.keys() and any(k.startswith("exp_avg_sq.") for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ
