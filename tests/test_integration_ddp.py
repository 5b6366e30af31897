"""The trainer integrations under DDP: 2 real processes (gloo, CPU) per run.

Each test trains a 2-process job to the end (the reference), trains the same job again and
SIGKILLs every process of it once a checkpoint is committed (a lost node), runs the same
command again (it resumes from the newest checkpoint that verifies, on every rank) and
checks that the final weights are bitwise those of the reference. Then the 2-process
checkpoint is restored in this single process.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from ddp_util import ENV, example, kill_job_when_saved, run_job, torchrun
from helpers import final_digest
from integration_util import damage_newest

import stepvault

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]


def _load_example(name: str):
    """An example script as a module (its classes and digest function)."""
    from ddp_util import EXAMPLES

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lightning_ddp_preempted_killed_and_resumed_is_bitwise(tmp_path):
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("torchdata.stateful_dataloader")
    args = ["--run", "lit", "--max-steps", "40", "--save-every", "10", "--devices", "2"]
    ref = run_job(example("lightning_train.py", "--root", str(tmp_path / "a"), *args))
    reference = final_digest(ref)
    root = tmp_path / "b"
    cmd = [*example("lightning_train.py", "--root", str(root), *args), "--step-sleep", "0.1"]
    # SIGTERM to the main process (rank 0; Lightning passes it on to rank 1): OnSignal
    # saves at the next step boundary and every rank exits with 143.
    steps, status = kill_job_when_saved(
        cmd, root, "lit", min_step=10, sig=signal.SIGTERM, main_only=True
    )
    assert status == 143 and steps[-1] % 10 != 0 and steps[-1] < 20
    # 8 batches per rank and epoch: step 20 is in the middle of the third epoch.
    steps, status = kill_job_when_saved(cmd, root, "lit", min_step=20)
    assert status == -signal.SIGKILL and 20 <= steps[-1] < 40
    cmd = cmd[:-2]
    # The newest checkpoint is damaged: rank 0 skips it, and every rank resumes from the
    # one before (the step rank 0 chose), still bitwise.
    assert damage_newest(root, "lit") == steps[-1]
    out = run_job(cmd)
    assert f"RESUMED {steps[-2]}" in out
    assert final_digest(out) == reference
    vault = stepvault.open(root)
    assert stepvault.ops.verify(root, deep=True).ok
    # Rank 0 wrote it; every rank's RNG state is in it (the ranks seed differently).
    callbacks = vault.checkpoint("lit", 40).load()["lightning"]["callbacks"]
    rng_ranks = next(iter(callbacks.values()))["rng_ranks"]
    assert len(rng_ranks) == 2
    assert not torch.equal(rng_ranks[0]["torch"], rng_ranks[1]["torch"])

    # The 2-process checkpoint in one process: the weights, and a whole single-process
    # Trainer resume (at max_steps, nothing left to train: the same weights).
    lit = _load_example("lightning_train")
    from stepvault.integrations.lightning import StepvaultCheckpoint

    model = lit.Regressor()
    model.load_state_dict(StepvaultCheckpoint(root, run="lit").load("latest")["state_dict"])
    assert lit.digest(model) == reference
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # rank 0 finds its own RNG state
        out = run_job(example("lightning_train.py", "--root", str(root), *args[:-2]))
    assert "RESUMED 40" in out and final_digest(out) == reference


def test_hf_trainer_ddp_preempted_killed_and_resumed_is_bitwise(tmp_path):
    pytest.importorskip("transformers")
    # torchrun's own parser takes "--run" for its "--run-path": the example also reads
    # "--run-name".
    args = ["--run-name", "hf", "--max-steps", "30", "--save-every", "10"]
    ref = run_job(torchrun("hf_trainer.py", "--root", str(tmp_path / "a"), *args))
    reference = final_digest(ref)
    root = tmp_path / "b"
    cmd = torchrun("hf_trainer.py", "--root", str(root), *args)
    slow = [*cmd, "--step-sleep", "0.1"]
    # SIGTERM to every process of the job (as schedulers do): process zero's OnSignal
    # saves at the next step; the other rank records the signal instead of dying at once.
    steps, status = kill_job_when_saved(slow, root, "hf", min_step=10, sig=signal.SIGTERM)
    assert status != 0 and steps[-1] % 10 != 0 and steps[-1] < 20
    steps, status = kill_job_when_saved(slow, root, "hf", min_step=20)
    assert status == -signal.SIGKILL and 20 <= steps[-1] < 30
    out = run_job(cmd)
    assert f"RESUMED {steps[-1]}" in out
    assert final_digest(out) == reference
    assert stepvault.ops.verify(root, deep=True).ok
    rng = stepvault.open(root).checkpoint("hf", 30).load()["rng"]
    assert len(rng["ranks"]) == 2  # what rng_state_0.pth and rng_state_1.pth would hold
    assert not torch.equal(rng["ranks"][0]["torch"], rng["ranks"][1]["torch"])

    # In one process: the weights, and a whole Trainer resume (nothing left to train).
    hf = _load_example("hf_trainer")
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=128,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    stepvault.restore(root, {"model": model}, run="hf", strict=False)
    assert hf.digest(model) == reference
    out = run_job(example("hf_trainer.py", "--root", str(root), *args))
    assert "RESUMED 30" in out and final_digest(out) == reference


def test_accelerate_ddp_killed_and_resumed_is_bitwise(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("torchdata.stateful_dataloader")
    args = ["--run-name", "acc", "--steps", "40", "--save-every", "10"]
    ref = run_job(torchrun("accelerate_train.py", "--root", str(tmp_path / "a"), *args))
    reference = final_digest(ref)
    root = tmp_path / "b"
    cmd = torchrun("accelerate_train.py", "--root", str(root), *args)
    steps, status = kill_job_when_saved([*cmd, "--step-sleep", "0.1"], root, "acc", min_step=20)
    assert status == -signal.SIGKILL and 20 <= steps[-1] < 40
    out = run_job(cmd)
    assert f"RESUMED {steps[-1]}" in out
    assert final_digest(out) == reference
    assert stepvault.ops.verify(root, deep=True).ok
    # Every rank saved (collective): replicated tensors once, each rank's RNG state apart.
    checkpoint = stepvault.open(root).checkpoint("acc", 40)
    assert checkpoint.is_sharded
    rng = checkpoint.load()["rng"]
    assert sorted(rng) == ["rank0", "rank1"]
    assert not torch.equal(rng["rank0"]["torch"], rng["rank1"]["torch"])

    # In one process: the weights, and the whole example resumed (nothing left to train).
    acc = _load_example("accelerate_train")
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    stepvault.restore(root, {"model": model}, run="acc", strict=False)
    assert acc.digest(model) == reference
    out = run_job(example("accelerate_train.py", "--root", str(root), *args))
    assert "RESUMED 40" in out and final_digest(out) == reference


def _fails(cmd: list[str], timeout: float = 120) -> str:
    """Run a job that must fail on every rank (not hang in a collective); its stderr."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode != 0 and "FINISHED" not in proc.stdout
    return proc.stderr


def test_lightning_ddp_save_error_on_rank0_stops_every_rank(tmp_path):
    pytest.importorskip("lightning.pytorch")
    script = Path(__file__).parent / "scripts" / "lightning_ddp_fails.py"
    err = _fails([sys.executable, str(script), str(tmp_path)])
    key = "hyper_parameters']['data_dir']: cannot store a value of type pathlib.PosixPath"
    assert f"[rank0]: stepvault.errors.UnsupportedTypeError: state['lightning']['{key}" in err
    assert (
        "[rank1]: stepvault.errors.StepvaultError: the stepvault save of step 2 failed "
        "on rank 0: UnsupportedTypeError" in err
    )
    assert stepvault.open(tmp_path).steps("bad") == []
    stepvault.CheckpointManager(tmp_path, "bad").close()  # rank 0 released the lease


def test_hf_trainer_ddp_lease_held_elsewhere_stops_every_rank(tmp_path):
    pytest.importorskip("transformers")
    args = ["--root", str(tmp_path), "--run-name", "hf", "--max-steps", "4"]
    with stepvault.CheckpointManager(tmp_path, "hf"):  # another job writes this run
        err = _fails(torchrun("hf_trainer.py", *args))
    assert "[rank0]: stepvault.errors.LeaseHeldError" in err
    assert (
        "[rank1]: stepvault.errors.StepvaultError: opening the stepvault run failed on "
        "rank 0: LeaseHeldError" in err
    )
    assert stepvault.open(tmp_path).steps("hf") == []


def test_accelerate_save_state_load_state_on_2_ranks(tmp_path):
    pytest.importorskip("accelerate")
    script = Path(__file__).parent / "scripts" / "accelerate_ddp_state.py"
    out = run_job(torchrun(script, str(tmp_path)))
    assert "RANK 0 OK" in out and "RANK 1 OK" in out
    # The 2-rank checkpoint loads into one process's Accelerator.
    from accelerate import Accelerator

    from stepvault.integrations.accelerate import load_state

    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    progress = {"epoch": 0}
    assert load_state(acc, tmp_path, run="st", extra=progress).step == 3
    assert progress == {"epoch": 1}
    saved = stepvault.open(tmp_path).checkpoint("st", 3).load()
    assert all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"][0]["momentum_buffer"] is not None
