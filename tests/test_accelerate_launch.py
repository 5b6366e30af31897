"""An Accelerate FSDP2 job started the way Accelerate's users start it: ``accelerate launch
--config_file <yaml>`` with a multi-process FSDP2 config (2 processes on CPU, gloo), not
``torchrun`` (which every other Accelerate sharded test uses).

What ``accelerate launch`` does with such a config (accelerate 1.16,
``accelerate/commands/launch.py``): ``distributed_type: FSDP`` selects its
``multi_gpu_launcher`` whatever the device (only the ``--cpu`` flag would send it to the
one-process ``simple_launcher``); that runs torch's elastic agent *in the launcher's own
process* (``torch.distributed.run.run``) with the config turned into environment
variables (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION=2``, ...). A ``MULTI_CPU`` config starts
one process unless an MPI hostfile is given, so FSDP on CPU goes through the FSDP config.
The worker (``tests/scripts/accelerate_fsdp2_train.py``) keeps its test-only patch: on CPU
processes Accelerate itself trains with DDP whatever the config says (its FSDP type is
honoured only for GPU-like devices), and the patch sets the FSDP type before ``prepare``.

The job is SIGKILLed (launcher and workers, as a lost node ends it) after a committed
checkpoint and started again with ``accelerate launch``: it resumes before the epoch
boundary, crosses it and ends bitwise equal to an uninterrupted ``accelerate launch`` run
(weights, both AdamW moments, LR, ``accelerator.step``, every rank's RNG draw). SIGTERM to
the launcher alone (a container's PID 1): the elastic agent forwards it to the workers,
which write one preemption checkpoint and exit 143; the launcher itself exits 143
(Accelerate turns the agent's ``SignalException`` into ``128 + signal``; ``torchrun``
exits 1). The job started again resumes from that checkpoint, bitwise.

``extended``: a multi-process framework test outside CI's 30 minutes (``-m extended``).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch
from ddp_util import kill_job_when_saved, run_job
from sharded_jobs import assert_preempted_once, preempt_job

import stepvault

pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

SCRIPT = Path(__file__).parent / "scripts" / "accelerate_fsdp2_train.py"

#: What ``accelerate config`` writes for one machine, 2 processes, FSDP2 (written by hand:
#: ``accelerate config`` is interactive). ``main_process_port: 0``: a free port each run.
CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
use_cpu: true
num_machines: 1
num_processes: 2
machine_rank: 0
main_process_port: 0
rdzv_backend: static
same_network: true
mixed_precision: 'no'
debug: false
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: NO_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_offload_params: false
  fsdp_cpu_ram_efficient_loading: false
"""


def accelerate_launch(config: Path, *args: str) -> list[str]:
    """``accelerate launch --config_file config SCRIPT args`` (the venv's console script)."""
    cli = Path(sys.executable).parent / "accelerate"
    head = (
        [str(cli)] if cli.exists() else [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
    )
    return [*head, "launch", "--config_file", str(config), str(SCRIPT), *args]


def _same(want_path: Path, got_path: Path) -> None:
    want, got = torch.load(want_path), torch.load(got_path)
    assert want.keys() == got.keys() and any(k.startswith("exp_avg_sq.") for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ


def test_accelerate_launch_fsdp2_killed_preempted_and_resumed_is_bitwise(tmp_path):
    pytest.importorskip("accelerate")
    config = tmp_path / "fsdp2_cpu.yaml"
    config.write_text(CONFIG)
    ref = tmp_path / "ref.pt"
    out = run_job(accelerate_launch(config, "--root", str(tmp_path / "ref"), "--out", str(ref)))
    assert "FRESH" in out and "LAUNCH-CONFIG fsdp_version=2" in out and "DONE" in out, out

    # SIGKILL to the launcher and both workers once step 8 is committed: the resume starts
    # before the epoch boundary at 16 (8 batches an epoch) and crosses it.
    root = tmp_path / "killed"
    cmd = accelerate_launch(config, "--root", str(root), "--step-sleep", "0.2")
    steps, status = kill_job_when_saved(cmd, root, "accfsdp", min_step=8)
    assert status == -signal.SIGKILL and 8 <= steps[-1] < 16, (status, steps)
    manifest = stepvault.open(root).manifest("accfsdp", steps[-1])
    assert manifest.sharded and manifest.metadata["framework"] == "accelerate"
    final = tmp_path / "killed.pt"
    out = run_job(accelerate_launch(config, "--root", str(root), "--out", str(final)))
    assert f"RESUMED {steps[-1]} epoch={steps[-1] // 8} skipped=0" in out, out
    _same(ref, final)

    # SIGTERM to the launcher alone: it forwards it to the workers.
    root = tmp_path / "preempted"
    cmd = accelerate_launch(config, "--root", str(root), "--step-sleep", "0.2")
    job = preempt_job(cmd, root, "accfsdp", SCRIPT, min_step=4, launcher_only=True)
    step = assert_preempted_once(job, root, "accfsdp", every=4)  # every worker exited 143
    assert job.launcher == 143, (job.launcher, job.stderr[-4000:])
    resumed = tmp_path / "preempted.pt"
    out = run_job(accelerate_launch(config, "--root", str(root), "--out", str(resumed)))
    assert f"RESUMED {step} epoch={step // 8} skipped=0" in out, out
    _same(ref, resumed)
