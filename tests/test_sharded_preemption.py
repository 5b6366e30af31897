"""Preemption of sharded jobs through the frameworks: SIGTERM to a running 2-rank job (gloo,
CPU, launched as users launch it) whose save policy is ``Every(...) | OnSignal()``.

The contract checked for each (INTEGRATIONS.md, "Limits"; RELIABILITY.md): the job writes
one new collective checkpoint at the step it reached (a step ``Every`` would not save), the
checkpoint verifies, every rank process exits with the policy's code (143 for SIGTERM) and
the run's log records that exit after that save. Schedulers send the notice either to every
process of the job (SLURM's ``scancel``, spot/preemptible VMs) or to the launcher alone (a
container's PID 1: torchrun forwards it to its workers); both are tested. The Accelerate
FSDP2 and Trainer jobs are then started again: they resume from the preemption checkpoint
and end bitwise equal to an uninterrupted run.

The DeepSpeed job is the short one in CI's slow run; the other frameworks' jobs are
``extended`` (``-m extended``, outside CI's 30 minutes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_util import ENV, run_job, torchrun
from sharded_jobs import assert_preempted_once, preempt_job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

SCRIPTS = Path(__file__).parent / "scripts"
DS_ENV = {**ENV, "DS_ACCELERATOR": "cpu"}


def test_deepspeed_zero2_sigterm_to_every_process_saves_once_and_every_rank_exits_143(tmp_path):
    pytest.importorskip("deepspeed")
    script = SCRIPTS / "deepspeed_train.py"
    root = tmp_path / "store"
    cmd = torchrun(script, "--root", str(root), "--steps", "200", "--save-every", "4",
                   "--on-signal", "--step-sleep", "0.2")  # fmt: skip
    job = preempt_job(cmd, root, "ds", script, min_step=4, env=DS_ENV)
    assert_preempted_once(job, root, "ds", every=4)


@pytest.mark.extended
def test_accelerate_deepspeed_sigterm_to_every_process(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("deepspeed")
    script = SCRIPTS / "accelerate_deepspeed_train.py"
    root = tmp_path / "store"
    cmd = torchrun(script, "--root", str(root), "--steps", "200", "--step-sleep", "0.2")
    job = preempt_job(cmd, root, "accds", script, min_step=4, env=DS_ENV)
    assert_preempted_once(job, root, "accds", every=4)


@pytest.mark.extended
@pytest.mark.parametrize("launcher_only", [False, True], ids=["every_process", "torchrun_only"])
def test_accelerate_fsdp2_sigterm_then_resume_is_bitwise(tmp_path, launcher_only):
    """Also: the job started again resumes from the preemption checkpoint (mid-epoch) and
    ends bitwise equal to an uninterrupted run."""
    pytest.importorskip("accelerate")
    script = SCRIPTS / "accelerate_fsdp2_train.py"
    root = tmp_path / "store"
    cmd = torchrun(script, "--root", str(root), "--steps", "20")
    job = preempt_job(
        [*cmd, "--step-sleep", "0.2"], root, "accfsdp", script, min_step=4,
        launcher_only=launcher_only,
    )  # fmt: skip
    step = assert_preempted_once(job, root, "accfsdp", every=4)
    out = run_job([*cmd, "--out", str(tmp_path / "resumed.pt")])
    assert f"RESUMED {step} epoch={step // 8} skipped=0" in out, out
    ref = torchrun(script, "--root", str(tmp_path / "ref"), "--steps", "20")
    run_job([*ref, "--out", str(tmp_path / "ref.pt")])
    _same(tmp_path / "ref.pt", tmp_path / "resumed.pt")


@pytest.mark.extended
@pytest.mark.parametrize("shard", ["zero2", "fsdp2"])
def test_trainer_sharded_sigterm_then_resume_is_bitwise(tmp_path, shard):
    """Also: the Trainer job started again resumes from the preemption checkpoint and ends
    bitwise equal to an uninterrupted run (weights, every rank's moments, LR, RNG draws)."""
    pytest.importorskip("transformers")
    if shard == "zero2":
        pytest.importorskip("deepspeed")
    script = SCRIPTS / "transformers_sharded_train.py"
    root = tmp_path / "store"
    env = {**DS_ENV, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), ENV.get("PYTHONPATH", "")])}
    common = ["--shard", shard, "--max-steps", "16", "--save-every", "4"]
    cmd = torchrun(script, *common, "--root", str(root))
    job = preempt_job(
        [*cmd, "--on-signal", "--step-sleep", "0.3"], root, "gpt", script, min_step=4, env=env
    )
    step = assert_preempted_once(job, root, "gpt", every=4)
    out = _run([*cmd, "--resume", "--final", str(tmp_path / "resumed.pt")], env)
    assert f"RESUMED {step} skipped=0" in out, out[-3000:]
    ref = torchrun(script, *common, "--root", str(tmp_path / "ref"))
    _run([*ref, "--final", str(tmp_path / "ref.pt")], env)
    _same(tmp_path / "ref.pt", tmp_path / "resumed.pt")


def _run(cmd: list[str], env: dict[str, str], timeout: float = 420) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def _same(want_path: Path, got_path: Path) -> None:
    want, got = torch.load(want_path), torch.load(got_path)
    assert want.keys() == got.keys() and any("exp_avg_sq" in k for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ


@pytest.mark.extended
def test_lightning_fsdp1_sigterm_to_every_process(tmp_path):
    """Lightning's own launcher (the main process is rank 0 and starts rank 1); FSDP1
    through the test-only CPU strategy of the worker. (ModelParallel and DeepSpeed are
    preempted in tests/test_sharded_lightning.py; their exit status is rank 0's only.)"""
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("torchdata.stateful_dataloader")
    script = SCRIPTS / "lightning_sharded_train.py"
    root = tmp_path / "store"
    cmd = [sys.executable, str(script), "--root", str(root), "--run", "sharded",
           "--strategy", "fsdp", "--max-steps", "200", "--save-every", "3",
           "--step-sleep", "0.2"]  # fmt: skip
    job = preempt_job(cmd, root, "sharded", script, min_step=3)
    assert_preempted_once(job, root, "sharded", every=3)
