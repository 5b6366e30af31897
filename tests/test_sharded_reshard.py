"""Resharding through the frameworks: a checkpoint written by a 2-rank sharded (FSDP2) job
resumed by the same job under another layout, as users change layouts: on one process
without FSDP (Accelerate), and under DDP (Lightning, the HF Trainer). The state the new
job starts from (full weights, both AdamW moments, the LR, the step) equals the sharded
job's state at that checkpoint, bitwise; the new job trains on and commits checkpoints of
its own layout. (2 -> 4 ranks: test_sharded_lightning.py.)

Multi-process framework jobs: ``extended`` (``-m extended``, outside CI's 30 minutes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_util import ENV, run_job, torchrun

import stepvault

pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

SCRIPTS = Path(__file__).parent / "scripts"


def _line(out: str, tag: str) -> str:
    return next(line.split()[1] for line in out.splitlines() if line.startswith(tag))


def _equal(want: dict, got: dict, keys: list[str]) -> None:
    assert keys and all(k in got for k in keys), sorted(set(keys) - set(got))
    differ = [k for k in keys if not torch.equal(want[k], got[k])]
    assert not differ, differ


def test_accelerate_fsdp2_checkpoint_of_2_ranks_resumes_on_one_process(tmp_path):
    """2 -> 1: the FSDP2 job's checkpoint resumed by the same Accelerate job on one process
    without FSDP (``AcceleratorCheckpointer.restore``), then trained on."""
    pytest.importorskip("accelerate")
    script = SCRIPTS / "accelerate_fsdp2_train.py"
    root = tmp_path / "store"
    two = tmp_path / "two.pt"
    out = run_job(torchrun(script, "--root", str(root), "--steps", "12", "--out", str(two)))
    assert "FRESH" in out
    assert stepvault.open(root).manifest("accfsdp", 12).sharded

    one = tmp_path / "one.pt"
    plain = [sys.executable, str(script), "--plain", "--root", str(root)]
    out = run_job([*plain, "--steps", "12", "--out", str(one)])  # resumes, trains nothing
    assert "RESUMED 12 epoch=1 skipped=0" in out, out
    want, got = torch.load(two), torch.load(one)
    _equal(want, got, [k for k in want if k.split(".")[0] in ("w", "exp_avg", "exp_avg_sq")])
    _equal(want, got, ["lr", "accelerate_step", "epoch"])
    # rank 0's RNG travels to the one process: its next draw is rank 0's
    assert torch.equal(want["rng"][0], got["rng"][0])

    out = run_job([*plain, "--steps", "16", "--out", str(one)])  # and trains on
    assert "RESUMED 12" in out
    vault = stepvault.open(root)
    assert vault.steps("accfsdp")[-1] == 16 and not vault.manifest("accfsdp", 16).sharded


def test_lightning_model_parallel_checkpoint_resumes_under_ddp(tmp_path):
    """FSDP2 -> DDP under Lightning: a ``ModelParallelStrategy`` job's checkpoint at 8,
    resumed by the same job under ``DDPStrategy`` (2 processes, Lightning's launcher).
    Lightning loads a DDP checkpoint before it builds its optimizers: the integration
    restores into the live module and optimizers from ``configure_optimizers``, each rank
    reading the full tensors alone. The DDP job starts from the sharded job's state at 8
    bitwise (a hash of the full weights and AdamW state), trains on to 12 in the next
    epoch (8 batches per rank and epoch), commits checkpoints of its own layout and ends
    bitwise where the sharded job's own resume to 12 ends (full weights, AdamW state, the
    last loss)."""
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("torchdata.stateful_dataloader")
    script = SCRIPTS / "lightning_fsdp_to_ddp.py"
    root, copy = tmp_path / "store", tmp_path / "ddp-store"

    def job(store: Path, strategy: str, steps: int) -> str:
        cmd = [sys.executable, str(script), "--root", str(store), "--strategy", strategy]
        return run_job([*cmd, "--max-steps", str(steps)], timeout=420)

    sharded = job(root, "model_parallel", 8)  # saves at 4 and 8
    assert "FRESH" in sharded and stepvault.open(root).manifest("layout", 8).sharded
    shutil.copytree(root, copy)
    ddp = job(copy, "ddp", 12)
    assert "RESUMED 8" in ddp and "REFUSED" not in ddp, ddp
    assert f"RESTORED {_line(sharded, 'FINAL')} at 8" in ddp  # the state at 8, bitwise
    vault = stepvault.open(copy)
    assert vault.steps("layout")[-1] == 12 and not vault.manifest("layout", 12).sharded
    own = job(root, "model_parallel", 12)  # the sharded job's own resume to 12
    assert "RESUMED 8" in own
    assert _line(ddp, "FINAL") == _line(own, "FINAL")  # the same end, bitwise
    assert _line(ddp, "LOSS") == _line(own, "LOSS")


def test_trainer_fsdp2_checkpoint_resumes_under_ddp(tmp_path):
    """FSDP2 -> DDP under the HF Trainer: the FSDP2 job's checkpoint at 12, resumed by the
    same Trainer job under plain DDP (torchrun, 2 processes). The DDP job starts from the
    FSDP2 job's state at 12 bitwise (full weights, both AdamW moments, LR), trains on to 16
    across the epoch boundary at 15 (5 steps an epoch) and ends bitwise where the FSDP2
    job's own resume to 16 ends: weights, moments, LR and every rank's RNG draw (each rank
    took the RNG state the same rank saved)."""
    pytest.importorskip("transformers")
    env = {**ENV, "DS_ACCELERATOR": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")])
    root, copy = tmp_path / "store", tmp_path / "ddp-store"
    sharded = [SCRIPTS / "transformers_sharded_train.py", "--shard", "fsdp2", "--root"]
    at12 = tmp_path / "fsdp12.pt"
    _run(torchrun(*sharded, str(root), "--max-steps", "12", "--final", str(at12)), env)
    assert stepvault.open(root).manifest("gpt", 12).sharded
    shutil.copytree(root, copy)
    fsdp16 = tmp_path / "fsdp16.pt"
    out = _run(torchrun(*sharded, str(root), "--max-steps", "16", "--resume",
                        "--final", str(fsdp16)), env)  # fmt: skip
    assert "RESUMED 12" in out

    restored, ddp16 = tmp_path / "restored.pt", tmp_path / "ddp16.pt"
    ddp = torchrun(SCRIPTS / "transformers_ddp_resume.py", "--root", str(copy), "--max-steps",
                   "16", "--restored", str(restored), "--final", str(ddp16))  # fmt: skip
    out = _run(ddp, env)
    assert "RESUMED 12 skipped=0" in out, out
    want, got = torch.load(at12), torch.load(restored)
    state_keys = [k for k in want if k.split(".")[0] in ("w", "exp_avg", "exp_avg_sq")]
    _equal(want, got, [*state_keys, "lr"])  # the restored state, bitwise
    want, got = torch.load(fsdp16), torch.load(ddp16)
    assert sorted(got) == sorted(want)
    _equal(want, got, [*state_keys, "lr", "rng.rank0", "rng.rank1"])  # the same end, bitwise
    vault = stepvault.open(copy)
    assert vault.steps("gpt")[-1] == 16 and not vault.manifest("gpt", 16).sharded  # DDP's


def _run(cmd: list[str], env: dict[str, str], timeout: float = 420) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout
