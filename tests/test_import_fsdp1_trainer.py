"""Import of the HF Trainer's FSDP1 ``checkpoint-N`` folder, resumed by ``StepvaultTrainer``
on 2 FSDP1 ranks (issue 30).

A real 2-process Trainer job (torchrun, gloo on CPU, ``fsdp="full_shard"`` version 1 with
flat parameters through the test-only patch of ``scripts/transformers_sharded_train.py``)
checkpoints with the Trainer's own ``SHARDED_STATE_DICT`` save (``pytorch_model_fsdp_0/``,
``optimizer_0/``, ``scheduler.pt``, ``rng_state_<rank>.pth``, ``trainer_state.json``; its
``FULL_STATE_DICT`` save fails inside torch's FSDP1 on CPU). ``checkpoint-4`` is imported
with the CLI as one checkpoint; ``StepvaultTrainer`` resumes from it and ends at step 8
bitwise where the uninterrupted job ends (full weights, both Adam moments by name, LR,
every rank's RNG draw). The reference is the uninterrupted job, not the Trainer's own
resume of the folder: that one starts the optimizer fresh under FSDP1 (checked by hand:
85 of the 88 tensors differ at 8). Before, the resume was refused: the fit check counted
FSDP1's flat parameters ("param group 0 has 28 params in checkpoint, 3 live").
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from test_import_fsdp_trainer import _run

import stepvault

pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]


def test_trainer_fsdp1_checkpoint_import_resumes_bitwise_like_the_uninterrupted_job(tmp_path):
    common = ["--shard", "fsdp1", "--save-every", "4", "--state-dict-type", "SHARDED_STATE_DICT"]
    native, straight = tmp_path / "native", tmp_path / "straight.pt"
    _run(*common, "--backend", "native", "--root", str(native), "--max-steps", "8",
         "--final", str(straight))  # fmt: skip
    folder = native / "checkpoint-4"
    assert {"pytorch_model_fsdp_0", "optimizer_0", "rng_state_1.pth"} <= {
        p.name for p in folder.iterdir()
    }

    store = tmp_path / "store"
    cli = [sys.executable, "-m", "stepvault.cli.main", "--root", str(store), "import"]
    done = subprocess.run(
        [*cli, str(folder), "--run", "gpt", "--trust"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "missing" not in done.stdout, done.stdout
    kinds = stepvault.open(store).manifest("gpt", 4).state_kinds
    assert kinds["optimizer"] == "optimizer" and "rng_ranks" in kinds, kinds

    ours = tmp_path / "ours.pt"
    out = _run(*common, "--root", str(store), "--max-steps", "8", "--resume", "--final", str(ours))
    assert "RESUMED 4 skipped=0" in out, out
    want, got = torch.load(straight), torch.load(ours)
    assert want.keys() == got.keys() and any(k.startswith("exp_avg_sq.") for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ
