"""Sharded jobs through the frameworks, killed and damaged, shaped like users' runs: a real
2-rank job (gloo, CPU) under its own launcher is SIGKILLed (every process, as a lost node
ends it) after a committed checkpoint; one object only rank 1 wrote in the newest
checkpoint is damaged; the job run again in new processes falls back to the checkpoint
before on every rank, crosses an epoch boundary and ends bitwise equal to an uninterrupted
run (weights, both AdamW moments, and what the job's output holds besides).

Accelerate with FSDP2 (torchrun) and Lightning's DeepSpeedStrategy, ZeRO-2 and ZeRO-3
(Lightning's launcher): the modes whose tests in test_sharded_accelerate.py /
test_sharded_lightning.py have no SIGKILL (and, for Accelerate FSDP2, no damaged shard or
epoch boundary). ``extended``: outside CI's 30 minutes (``-m extended``).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch
from ddp_util import kill_job_when_saved, run_job, torchrun
from helpers import final_digest
from sharded_jobs import damage_rank1_shard

import stepvault

pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

SCRIPTS = Path(__file__).parent / "scripts"


def test_accelerate_fsdp2_killed_damaged_and_resumed_is_bitwise(tmp_path):
    pytest.importorskip("accelerate")
    script = SCRIPTS / "accelerate_fsdp2_train.py"
    ref = tmp_path / "ref.pt"
    out = run_job(torchrun(script, "--root", str(tmp_path / "ref"), "--out", str(ref)))
    assert "FRESH" in out and "DONE" in out

    root = tmp_path / "store"
    cmd = torchrun(script, "--root", str(root), "--step-sleep", "0.2")
    steps, status = kill_job_when_saved(cmd, root, "accfsdp", min_step=12)
    assert status == -signal.SIGKILL and steps[-1] < 20, (status, steps)
    manifest = stepvault.open(root).manifest("accfsdp", steps[-1])
    assert manifest.sharded and manifest.metadata["framework"] == "accelerate"
    damaged = damage_rank1_shard(root, "accfsdp", steps[-1])
    before = steps[-2]
    assert before < 16  # the resume crosses the epoch boundary at 16 (8 batches an epoch)

    final = tmp_path / "final.pt"
    out = run_job(torchrun(script, "--root", str(root), "--out", str(final)))
    assert f"RESUMED {before} epoch={before // 8} skipped=1" in out, (damaged, out)
    want, got = torch.load(ref), torch.load(final)
    assert want.keys() == got.keys() and any(k.startswith("exp_avg_sq.") for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ
    assert stepvault.ops.verify(root, deep=True).ok  # the damaged one was quarantined


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_deepspeed_killed_damaged_and_resumed_is_bitwise(tmp_path, stage):
    """Lightning's DeepSpeedStrategy (ZeRO-2 and ZeRO-3; the worker's test-only CPU
    subclass) with StepvaultCheckpoint, SIGKILLed after a committed checkpoint (the
    preemption of the ZeRO-2 job is test_sharded_lightning.py's). The 2-rank checkpoint then
    exports as one safetensors file holding the job's final fp32 weights, bitwise."""
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("deepspeed")
    script = SCRIPTS / "lightning_deepspeed_train.py"

    def job(root: Path, *extra: str) -> list[str]:
        return [sys.executable, str(script), "--root", str(root), "--run", "ds", "--stage",
                str(stage), "--max-steps", "12", "--save-every", "3", *extra]  # fmt: skip

    ref_weights = tmp_path / "ref.pt"
    reference = final_digest(run_job(job(tmp_path / "ref", "--out", str(ref_weights)), timeout=400))
    root = tmp_path / "store"
    steps, status = kill_job_when_saved(job(root, "--step-sleep", "0.15"), root, "ds", min_step=6)
    assert status == -signal.SIGKILL and steps[-1] < 12, (status, steps)
    damaged = damage_rank1_shard(root, "ds", steps[-1])
    assert steps[-2] < 8  # 8 batches per rank and epoch: the resume crosses the boundary
    out = run_job(job(root), timeout=400)
    assert f"RESUMED {steps[-2]}" in out, (damaged, out)
    assert final_digest(out) == reference
    assert stepvault.ops.verify(root, deep=True).ok  # the damaged one was quarantined
    assert stepvault.open(root).manifest("ds", 12).sharded

    # the export: the ranks' partitions joined one tensor at a time, the job's weights
    from safetensors.torch import load_file

    from stepvault.store import Store

    stepvault.ops.export_weights(Store.open(root), "ds", 12, tmp_path / "w.safetensors")
    exported, want = load_file(tmp_path / "w.safetensors"), torch.load(ref_weights)
    assert exported.keys() == want.keys(), (sorted(exported), sorted(want))
    assert [k for k in want if not torch.equal(exported[k], want[k])] == []
