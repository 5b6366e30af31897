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

The job checkpoints at 12 and resumes to 16 (5 steps an epoch: across the boundary at 15).

FSDP -> DDP: the import is a one-process checkpoint, so the same Trainer job under plain DDP
(``scripts/transformers_ddp_resume.py``: 2 processes, torchrun, no ``fsdp``) resumes from
it: it starts from the FSDP2 job's state at 12 bitwise (full weights, both AdamW moments,
LR) and ends at 16 bitwise where the Trainer's own FSDP2 resume of the folder ends (and
each rank with the RNG state the same rank saved). The Trainer's own resume under DDP does
not read the FSDP folder (transformers 5.25 loads ``optimizer.pt`` when FSDP is off; read in
its code, not run). Why 12 -> 16 and not 4 -> 8: step 5's gradient norm (1.026) is over
the Trainer's ``max_grad_norm`` (1.0), and the clipping factor comes from a total norm that
FSDP2 sums shard by shard and DDP over full tensors: the last bits differ (measured: 80 of
88 tensors at 8 differ, the embedding by 4e-9 at most; the restored state at 4, the LR and
the RNG draws are equal).
Steps 13-16 are not clipped, so the two layouts compute the same bits.
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
DDP_SCRIPT = SCRIPT.parent / "transformers_ddp_resume.py"


def _run(*args: str, script: Path = SCRIPT, timeout: float = 400) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*cmd, "--nproc_per_node", "2", str(script), *args],
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
    native, at12 = tmp_path / "native", tmp_path / "at12.pt"
    _run(*common, "--backend", "native", "--root", str(native), "--max-steps", "12",
         "--final", str(at12))  # fmt: skip
    folder = native / "checkpoint-12"
    files = set(os.listdir(folder))
    assert {optimizer_file, "rng_state_1.pth", "trainer_state.json"} <= files, files
    theirs = tmp_path / "theirs"  # the Trainer's own resume writes checkpoint-16 beside it
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
    kinds = stepvault.open(store).manifest("gpt", 12).state_kinds
    assert kinds["optimizer"] == "optimizer" and "rng_ranks" in kinds, kinds
    ddp_store = tmp_path / "ddp-store"  # the import as it is, for the DDP resume below
    shutil.copytree(store, ddp_store)

    ours_final, theirs_final = tmp_path / "ours.pt", tmp_path / "theirs.pt"
    out = _run(*common, "--root", str(store), "--max-steps", "16", "--resume",
               "--final", str(ours_final))  # fmt: skip
    assert "RESUMED 12 skipped=0" in out, out
    _run(*common, "--backend", "native", "--root", str(theirs), "--max-steps", "16",
         "--resume", "--final", str(theirs_final))  # fmt: skip
    want, got = torch.load(theirs_final), torch.load(ours_final)
    assert want.keys() == got.keys() and any(k.startswith("exp_avg_sq.") for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ

    # The same import resumed under DDP (no fsdp): the FSDP2 state at 12, then the same end.
    restored, ddp_final = tmp_path / "restored.pt", tmp_path / "ddp.pt"
    out = _run("--root", str(ddp_store), "--max-steps", "16", "--restored", str(restored),
               "--final", str(ddp_final), script=DDP_SCRIPT)  # fmt: skip
    assert "RESUMED 12 skipped=0" in out, out
    state = [k for k in want if k.split(".")[0] in ("w", "exp_avg", "exp_avg_sq")]
    assert any(k.startswith("exp_avg_sq.") for k in state), sorted(want)
    _equal(torch.load(at12), torch.load(restored), [*state, "lr"])
    _equal(want, torch.load(ddp_final), [*state, "lr", "rng.rank0", "rng.rank1"])
    vault = stepvault.open(ddp_store)
    assert vault.steps("gpt") == [12, 16] and not vault.manifest("gpt", 16).sharded  # DDP's


def _equal(want: dict, got: dict, keys: list[str]) -> None:
    assert keys and all(k in got for k in keys), sorted(set(keys) - set(got))
    differ = [k for k in keys if not torch.equal(want[k], got[k])]
    assert not differ, differ
