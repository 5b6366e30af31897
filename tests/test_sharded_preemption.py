"""Preemption of sharded jobs through the frameworks: SIGTERM to a running 2-rank job (gloo,
CPU, launched as users launch it) whose save policy is ``Every(...) | OnSignal()``.

The contract checked for each (INTEGRATIONS.md, "Limits"; RELIABILITY.md): the job writes
one new collective checkpoint at the step it reached (a step ``Every`` would not save), the
checkpoint verifies, every rank process exits with the policy's code (143 for SIGTERM) and
the run's log records that exit after that save. Schedulers send the notice either to every
process of the job (SLURM's ``scancel``, spot/preemptible VMs) or to the launcher alone (a
container's PID 1: torchrun forwards it to its workers); both are tested.

The DeepSpeed job is the short one in CI's slow run; the other frameworks' jobs are
``extended`` (``-m extended``, outside CI's 30 minutes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from ddp_util import ENV, torchrun
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
def test_accelerate_fsdp2_sigterm(tmp_path, launcher_only):
    pytest.importorskip("accelerate")
    script = SCRIPTS / "accelerate_fsdp2_train.py"
    root = tmp_path / "store"
    cmd = torchrun(script, "--root", str(root), "--steps", "200", "--step-sleep", "0.2")
    job = preempt_job(cmd, root, "accfsdp", script, min_step=4, launcher_only=launcher_only)
    assert_preempted_once(job, root, "accfsdp", every=4)


@pytest.mark.extended
@pytest.mark.parametrize("shard", ["zero2", "fsdp2"])
def test_trainer_sharded_sigterm_to_every_process(tmp_path, shard):
    pytest.importorskip("transformers")
    if shard == "zero2":
        pytest.importorskip("deepspeed")
    script = SCRIPTS / "transformers_sharded_train.py"
    root = tmp_path / "store"
    env = {**DS_ENV, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), ENV.get("PYTHONPATH", "")])}
    cmd = torchrun(script, "--shard", shard, "--root", str(root), "--max-steps", "200",
                   "--save-every", "4", "--on-signal", "--step-sleep", "0.3")  # fmt: skip
    job = preempt_job(cmd, root, "gpt", script, min_step=4, env=env)
    assert_preempted_once(job, root, "gpt", every=4)


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
