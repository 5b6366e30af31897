"""Accelerate jobs started the way Accelerate's users start them: ``accelerate launch
--config_file <yaml>`` with a 2-process config (CPU, gloo), not ``torchrun`` (which every
other Accelerate multi-process test uses): FSDP2, FSDP1, DeepSpeed ZeRO-2 and DDP.

What ``accelerate launch`` does with such a config (accelerate 1.16,
``accelerate/commands/launch.py``): ``distributed_type: FSDP`` selects its
``multi_gpu_launcher`` whatever the device (only the ``--cpu`` flag would send it to the
one-process ``simple_launcher``); that runs torch's elastic agent *in the launcher's own
process* (``torch.distributed.run.run``) with the config turned into environment
variables (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION=2``, ...). A ``MULTI_CPU`` config starts
one process unless an MPI hostfile is given, so FSDP on CPU goes through the FSDP config.
The FSDP2 worker (``tests/scripts/accelerate_fsdp2_train.py``) keeps its test-only patch: on
CPU processes Accelerate itself trains with DDP whatever the config says (its FSDP type is
honoured only for GPU-like devices), and the patch sets the FSDP type before ``prepare``;
the FSDP1 worker (``tests/scripts/accelerate_fsdp1_train.py``, flat parameters) likewise.
``distributed_type: DEEPSPEED`` selects ``deepspeed_launcher``, which on one machine also
runs the elastic agent in the launcher's process; the DeepSpeed worker
(``tests/scripts/accelerate_deepspeed_train.py``, no patch) then leaves the plugin to
Accelerate, which builds it from the config's ``deepspeed_config_file`` (ZeRO-2; the config
names no ``mixed_precision``: Accelerate refuses one beside a DeepSpeed file). DDP on CPU:
``distributed_type: MULTI_GPU`` with ``use_cpu: true`` (the ``multi_gpu_launcher``, 2
processes; ``MULTI_CPU`` would start one) runs ``examples/accelerate_train.py`` as is.

Each job is SIGKILLed (launcher and workers, as a lost node ends it) after a committed
checkpoint and started again with ``accelerate launch``: it resumes before an epoch
boundary, crosses it and ends bitwise equal to an uninterrupted ``accelerate launch`` run
(FSDP2, FSDP1 and ZeRO-2: weights, both AdamW moments, LR, ``accelerator.step``, every
rank's RNG draw; DDP: the example's digest of the final weights). FSDP2 also: SIGTERM to
the launcher alone (a container's PID 1): the elastic agent forwards it to the workers,
which write one preemption checkpoint and exit 143; the launcher itself exits 143
(Accelerate turns the agent's ``SignalException`` into ``128 + signal``; ``torchrun`` exits
1). The job started again resumes from that checkpoint, bitwise.

``extended``: a multi-process framework test outside CI's 30 minutes (``-m extended``).
"""

from __future__ import annotations

import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ddp_util import EXAMPLES, kill_job_when_saved, run_job
from sharded_jobs import assert_preempted_once, preempt_job

import stepvault

pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

SCRIPTS = Path(__file__).parent / "scripts"

#: What ``accelerate config`` writes for one machine and 2 processes (written by hand:
#: ``accelerate config`` is interactive), less the lines of each kind below.
#: ``main_process_port: 0``: a free port each run.
MACHINE = """\
compute_environment: LOCAL_MACHINE
use_cpu: true
num_machines: 1
num_processes: 2
machine_rank: 0
main_process_port: 0
rdzv_backend: static
same_network: true
debug: false
"""

FSDP2 = """\
distributed_type: FSDP
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: NO_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_offload_params: false
  fsdp_cpu_ram_efficient_loading: false
"""

#: The FSDP1 worker builds its own plugin (flat parameters, each Linear its own unit) and
#: prints no config line: the config picks the launcher, as for a user's FSDP1 job.
FSDP1 = """\
distributed_type: FSDP
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 1
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_auto_wrap_policy: NO_WRAP
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_use_orig_params: false
  fsdp_offload_params: false
  fsdp_cpu_ram_efficient_loading: false
"""

#: ``{ds}``: the DeepSpeed JSON beside the config (torch AdamW needs
#: ``zero_allow_untested_optimizer``, which the yaml's own fields cannot say).
DEEPSPEED = """\
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds}
  zero3_init_flag: false
"""
DEEPSPEED_JSON = """\
{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
 "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": true,
 "steps_per_print": 10000}
"""

DDP = """\
distributed_type: MULTI_GPU
mixed_precision: 'no'
"""


@dataclass(frozen=True)
class Job:
    """One kind of ``accelerate launch`` job: its config, worker, run name, what rank 0
    prints to show the config reached the worker, and the steps of one epoch."""

    config: str
    script: Path
    run: str
    launched: str | None  # None: the worker prints no config line
    args: tuple[str, ...] = ()
    epoch: int = 8
    writes_out: bool = True  # --out FILE; else the example's ``FINAL <digest>`` line
    kill_after: int = 8  # SIGKILL once a checkpoint at this step or later is committed


JOBS = {
    "fsdp2": Job(FSDP2, SCRIPTS / "accelerate_fsdp2_train.py", "accfsdp", "fsdp_version=2"),
    "fsdp1": Job(FSDP1, SCRIPTS / "accelerate_fsdp1_train.py", "accfsdp1", None),
    "deepspeed": Job(DEEPSPEED, SCRIPTS / "accelerate_deepspeed_train.py", "accds", "zero_stage=2"),
    # examples/accelerate_train.py: 16 batches a rank an epoch, 2 accumulated a step.
    "ddp": Job(
        DDP,
        EXAMPLES / "accelerate_train.py",
        "acc",
        None,
        ("--run-name", "acc", "--steps", "40", "--save-every", "10"),
        writes_out=False,
        kill_after=20,
    ),
}


def write_config(tmp_path: Path, job: Job) -> Path:
    """The job's config file (and DeepSpeed's JSON beside it)."""
    ds = tmp_path / "ds_zero2.json"
    ds.write_text(DEEPSPEED_JSON)
    config = tmp_path / "accelerate_cpu.yaml"
    config.write_text(MACHINE + job.config.format(ds=ds))
    return config


def accelerate_launch(config: Path, script: Path, *args: str) -> list[str]:
    """``accelerate launch --config_file config script args`` (the venv's console script)."""
    cli = Path(sys.executable).parent / "accelerate"
    head = (
        [str(cli)] if cli.exists() else [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
    )
    return [*head, "launch", "--config_file", str(config), str(script), *args]


def final(job: Job, out: str, path: Path) -> dict[str, torch.Tensor] | str:
    """What the job ended with: its ``--out`` file, or the example's final weight digest."""
    assert "DONE" in out if job.writes_out else "FINAL" in out, out
    if job.writes_out:
        return torch.load(path)
    found = re.search(r"^FINAL (\w+)$", out, re.M)
    assert found, out
    return found.group(1)


def _same(want: dict[str, torch.Tensor] | str, got: dict[str, torch.Tensor] | str) -> None:
    if isinstance(want, str) or isinstance(got, str):
        assert want == got
        return
    assert want.keys() == got.keys() and any("exp_avg_sq" in k for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ


def _resumed(job: Job, step: int) -> str:
    """The line rank 0 prints on a resume from ``step`` (the example prints the step only)."""
    if not job.writes_out:
        return f"RESUMED {step}\n"
    return f"RESUMED {step} epoch={step // job.epoch} skipped=0"


@pytest.mark.parametrize("kind", list(JOBS))
def test_accelerate_launch_killed_and_resumed_is_bitwise(tmp_path, kind):
    pytest.importorskip("accelerate")
    if kind == "deepspeed":
        pytest.importorskip("deepspeed")
    job = JOBS[kind]
    config = write_config(tmp_path, job)

    def launch(root: Path, *more: str, out: Path | None = None) -> list[str]:
        args = [*job.args, "--root", str(root), *more]
        return accelerate_launch(config, job.script, *args, *(["--out", str(out)] if out else []))

    ref_path = tmp_path / "ref.pt"
    out = run_job(launch(tmp_path / "ref", out=ref_path if job.writes_out else None))
    assert "FRESH" in out and (job.launched is None or f"LAUNCH-CONFIG {job.launched}" in out)
    ref = final(job, out, ref_path)

    # SIGKILL to the launcher and both workers once a checkpoint at `kill_after` or later is
    # committed: the resume starts before a later epoch boundary (every 8 steps in all three
    # jobs) and crosses it.
    root = tmp_path / "killed"
    min_step = job.kill_after
    steps, status = kill_job_when_saved(
        launch(root, "--step-sleep", "0.2"), root, job.run, min_step=min_step
    )
    assert status == -signal.SIGKILL and min_step <= steps[-1] < 2 * min_step, (status, steps)
    manifest = stepvault.open(root).manifest(job.run, steps[-1])
    assert manifest.sharded and manifest.metadata["framework"] == "accelerate"
    got_path = tmp_path / "killed.pt"
    out = run_job(launch(root, out=got_path if job.writes_out else None))
    assert _resumed(job, steps[-1]) in out, out
    _same(ref, final(job, out, got_path))
    if kind != "fsdp2":
        return

    # SIGTERM to the launcher alone: it forwards it to the workers.
    root = tmp_path / "preempted"
    cmd = launch(root, "--step-sleep", "0.2")
    preempted = preempt_job(cmd, root, job.run, job.script, min_step=4, launcher_only=True)
    step = assert_preempted_once(preempted, root, job.run, every=4)  # every worker exited 143
    assert preempted.launcher == 143, (preempted.launcher, preempted.stderr[-4000:])
    resumed = tmp_path / "preempted.pt"
    out = run_job(launch(root, out=resumed))
    assert _resumed(job, step) in out, out
    _same(ref, final(job, out, resumed))
