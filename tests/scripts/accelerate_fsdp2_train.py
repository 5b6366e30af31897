"""A training job with Accelerate's FSDP2 for tests/test_sharded_faults.py,
tests/test_sharded_preemption.py and tests/test_sharded_reshard.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        accelerate_fsdp2_train.py --root DIR [--steps 20] [--save-every 4] [--out FILE]

or ``accelerate launch --config_file FSDP2_CONFIG accelerate_fsdp2_train.py ...``
(tests/test_accelerate_launch.py; rank 0 then prints ``LAUNCH-CONFIG fsdp_version=<v>``).

``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`` prepares a small
MLP with dropout (every rank's RNG matters), torch AdamW and a StepLR scheduler; data is
drawn by step from a per-epoch permutation (8 batches an epoch, so runs cross epoch
boundaries). ``AcceleratorCheckpointer`` saves every ``--save-every`` steps (and on SIGTERM,
then every rank exits 143) with ``extra={"epoch": ...}`` and resumes at start. Rank 0
prints ``FRESH`` / ``RESUMED <step> epoch=<e> skipped=<n>``; at the end it writes the full
weights, both AdamW moments of every parameter (gathered from the shards), the scheduler's
LR, ``accelerator.step`` and a draw of each rank's torch RNG to ``--out`` (``torch.save``).
``--plain`` (one process, ``python accelerate_fsdp2_train.py --plain ...``, no torchrun): the
same job on one process without FSDP, as a user evaluates or fine-tunes on one machine; it
resumes from the 2-rank FSDP2 checkpoint (the restore planner gathers the shards).

TEST-ONLY PATCH: Accelerate honours an FSDP plugin only for GPU-like distributed types; on
CPU processes it silently trains with DDP. ``cpu_fsdp2_accelerator`` (from
accelerate_fsdp2_state.py) sets the FSDP distributed type in Accelerate's shared state
before ``prepare``. On GPUs ``Accelerator(fsdp_plugin=...)`` is what users run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate_fsdp2_state import cpu_fsdp2_accelerator
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from stepvault.integrations.accelerate import AcceleratorCheckpointer
from stepvault.policy import Every, KeepLast, OnSignal

BATCHES_PER_EPOCH = 8


def batch(step: int, rank: int) -> torch.Tensor:
    epoch, index = divmod(step, BATCHES_PER_EPOCH)
    order = torch.randperm(BATCHES_PER_EPOCH, generator=torch.Generator().manual_seed(epoch))
    g = torch.Generator().manual_seed(1000 * int(order[index]) + rank)
    return torch.randn(4, 16, generator=g)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run", default="accfsdp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument("--out", default="")
    p.add_argument("--pid-dir", default="", help="each rank writes rank<r>.pid here")
    p.add_argument("--plain", action="store_true", help="one process, no FSDP")
    args = p.parse_args()

    torch.set_num_threads(1)
    # Set by `accelerate launch` from an FSDP config (tests/test_accelerate_launch.py); read
    # before the Accelerator is built, as it sets ACCELERATE_USE_FSDP itself.
    launch_fsdp = os.environ.get("FSDP_VERSION", "")
    if args.plain:
        acc = Accelerator(cpu=True)
        rank = 0
    else:
        if not dist.is_initialized():  # Accelerate picks no backend on CPU: gloo, as users do
            dist.init_process_group("gloo")
        acc = cpu_fsdp2_accelerator()
        rank = dist.get_rank()
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    sharded = any(isinstance(q, DTensor) for q in model.parameters())
    assert args.plain or (acc.is_fsdp2 and sharded), acc.distributed_type  # the patch holds
    torch.manual_seed(100 + rank)  # the ranks' RNGs differ

    progress = {"epoch": 0}
    ckpt = AcceleratorCheckpointer(
        acc,
        args.root,
        run=args.run,
        save=Every(steps=args.save_every) | OnSignal(),  # SIGTERM: save, exit 143
        keep=KeepLast(3),
        extra=progress,
    )
    info = ckpt.restore()
    step = 0 if info is None else info.step
    if rank == 0:
        if launch_fsdp:
            print(f"LAUNCH-CONFIG fsdp_version={launch_fsdp}", flush=True)
        print(
            "FRESH"
            if info is None
            else f"RESUMED {info.step} epoch={progress['epoch']} skipped={len(info.skipped)}",
            flush=True,
        )

    while step < args.steps:
        if args.step_sleep:
            time.sleep(args.step_sleep)
        x = batch(step, rank)
        loss = (model(x) - x[:, :8].sin()).square().mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        progress["epoch"] = step // BATCHES_PER_EPOCH
        if ckpt.save(step, epoch=progress["epoch"], metrics={"loss": loss.item()}):
            ckpt.wait()  # committed before the test looks

    if args.plain:
        draws = [torch.rand(4)]  # the RNG where the run left it
    else:
        draws = [torch.zeros(4) for _ in range(dist.get_world_size())]
        dist.all_gather(draws, torch.rand(4))  # every rank's RNG, where the run left it
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(model, opt.optimizer, options=options)  # collective
    full: dict[str, torch.Tensor] = {f"w.{k}": v.detach().clone() for k, v in msd.items()}
    for name, s in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{key}.{name}"] = torch.as_tensor(s[key]).clone()
    full["lr"] = torch.tensor(sched.get_last_lr())
    full["rng"] = torch.stack(draws)
    full["accelerate_step"] = torch.tensor(acc.step)
    full["epoch"] = torch.tensor(progress["epoch"])
    ckpt.close()
    if rank == 0 and args.out:
        torch.save(full, args.out)
        print("DONE", flush=True)
    if not args.plain:
        dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown (see tests/scripts/accelerate_ddp_state.py)
