"""A multi-rank training job for crash tests: launch with ``python -m torch.distributed.run
--standalone --nproc_per_node N train_loop_dist.py --store DIR`` (gloo on CPU).

FSDP2 (``fully_shard``) over all ranks, AdamW, a scheduler, dropout (so every rank's RNG
matters), a collective ``CheckpointManager`` with asynchronous sharded saves, a keep policy
with immediate GC and optionally slowed object writes. Rank 0 prints ``RESUMED <step>`` /
``FRESH``, ``STEP <n>`` and at the end ``FINAL <digest>``: BLAKE3 of the full (gathered)
parameters and optimizer state, so the parent can compare interrupted and uninterrupted jobs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from blake3 import blake3
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import stepvault
from stepvault.manager.options import GCOptions, ManagerOptions
from stepvault.policy import Every, KeepLast


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(model, opt, options=opts)
    h = blake3()
    for name in sorted(msd):
        h.update(msd[name].contiguous().view(torch.uint8).numpy().tobytes())
    for name in sorted(osd["state"]):
        for k in sorted(osd["state"][name]):
            v = osd["state"][name][k]
            h.update(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--run", default="job")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--slow-writes", type=float, default=0.0, help="sleep per object write")
    p.add_argument("--pid-dir", help="write rank<r>.pid here (so a test can kill one rank)")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    if args.slow_writes:
        from _slow_writes import slow_object_writes

        slow_object_writes(args.slow_writes)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width), torch.nn.Tanh(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.width, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1),
    )  # fmt: skip
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(1000 + rank)  # each rank its own dropout stream, saved per rank
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=100)
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "rng": stepvault.RNGState(),
        "step": 0,
    }
    mgr = stepvault.CheckpointManager(
        args.store,
        args.run,
        save=Every(steps=args.save_every),
        keep=KeepLast(2),
        async_save=True,
        options=ManagerOptions(gc=GCOptions(grace_seconds=0.0)),
    )
    info = mgr.restore(state)
    if rank == 0:
        print(f"RESUMED {info.step}" if info else "FRESH", flush=True)
    for step in range(state["step"] + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)  # the data: a function of step
        x = torch.randn(16, 32, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        state["step"] = step
        if rank == 0:
            print(f"STEP {step}", flush=True)
        mgr.save(step, state, metrics={"loss": loss.item()})
    mgr.close()
    final = digest(model, opt)
    if rank == 0:
        print(f"FINAL {final}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see tests/dist_workers.py: no C++ static destructors after the work is done


if __name__ == "__main__":
    sys.exit(main())
