"""A 2-rank Accelerate job with an FSDP1 plugin for tests/test_sharded_accelerate.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        accelerate_fsdp1_train.py --root DIR [--steps 20] [--orig-params] [--out FILE]

``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1, ...))`` wraps a
small MLP with dropout (every rank's RNG matters) in ``FullyShardedDataParallel`` (each
Linear its own unit; flat parameters, or the original ones with ``--orig-params``), with
torch AdamW and a StepLR scheduler; data is drawn by step from a per-epoch permutation (8
batches an epoch, so runs cross epoch boundaries). ``AcceleratorCheckpointer`` saves every
``--save-every`` steps (asynchronously) with ``extra={"epoch": ...}`` and resumes at start.
Rank 0 prints ``FRESH`` / ``RESUMED <step> epoch=<e> skipped=<n>``; at the end it writes
the full weights, both Adam moments of every parameter (by name), the scheduler's LR,
``accelerator.step`` and a draw of each rank's torch RNG to ``--out`` (``torch.save``).

TEST-ONLY PATCH: Accelerate honours an FSDP plugin only for GPU-like distributed types;
on CPU processes it silently trains with DDP. ``cpu_fsdp1_accelerator`` sets the FSDP
distributed type and the plugin in Accelerate's shared state (as
accelerate_fsdp2_state.py does), and the device to plain ``cpu`` (FSDP1 refuses a
``device_id`` of ``cpu:0`` for parameters on ``cpu``). Nothing of it belongs in the
package: on GPUs ``Accelerator(fsdp_plugin=...)`` is what users run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from stepvault.integrations.accelerate import AcceleratorCheckpointer
from stepvault.policy import Every, KeepLast

BATCHES_PER_EPOCH = 8


def cpu_fsdp1_accelerator(orig_params: bool) -> Accelerator:
    """TEST-ONLY: an Accelerator whose prepare() wraps with FSDP1 on CPU processes."""
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        sharding_strategy="FULL_SHARD",
        state_dict_type="SHARDED_STATE_DICT",
        use_orig_params=orig_params,
        sync_module_states=False,  # FSDP1 syncs module states on a GPU only
        auto_wrap_policy="size_based_wrap",
        min_num_params=100,
    )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    # Both shared states: every AcceleratorState() made later copies PartialState's.
    PartialState().distributed_type = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    PartialState().device = acc.state.device = torch.device("cpu")
    return acc


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 8)
    )


def batch(step: int, rank: int) -> torch.Tensor:
    epoch, index = divmod(step, BATCHES_PER_EPOCH)
    order = torch.randperm(BATCHES_PER_EPOCH, generator=torch.Generator().manual_seed(epoch))
    g = torch.Generator().manual_seed(1000 * int(order[index]) + rank)
    return torch.randn(4, 16, generator=g)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run", default="accfsdp1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--orig-params", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument("--out", default="")
    args = p.parse_args()

    torch.set_num_threads(1)
    accelerator = cpu_fsdp1_accelerator(args.orig_params)
    rank = dist.get_rank()
    # FSDP1 replaces the parameters (flat ones): the model first, then its optimizer
    model = accelerator.prepare(build())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    opt, sched = accelerator.prepare(opt, sched)
    assert isinstance(model, FSDP) and len(FSDP.fsdp_modules(model)) == 3, model  # FSDP1
    torch.manual_seed(100 + rank)  # the ranks' RNGs differ

    progress = {"epoch": 0}
    ckpt = AcceleratorCheckpointer(
        accelerator,
        args.root,
        run=args.run,
        save=Every(steps=args.save_every),
        keep=KeepLast(3),
        extra=progress,
    )
    info = ckpt.restore()
    step = 0 if info is None else info.step
    if rank == 0:
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
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        progress["epoch"] = step // BATCHES_PER_EPOCH
        if ckpt.save(step, epoch=progress["epoch"], metrics={"loss": loss.item()}):
            ckpt.wait()  # committed before the test looks

    full_options = StateDictOptions(full_state_dict=True)
    full: dict[str, torch.Tensor] = {}
    for name, t in get_model_state_dict(model, options=full_options).items():
        full[name] = t.clone()
    osd = get_optimizer_state_dict(model, opt, options=full_options)
    for name, s in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{name}.{key}"] = s[key].clone()
    full["lr"] = torch.tensor(sched.get_last_lr())
    draws = [torch.zeros(4) for _ in range(dist.get_world_size())]
    dist.all_gather(draws, torch.rand(4))  # every rank's RNG, where the run left it
    full["rng"] = torch.stack(draws)
    full["accelerate_step"] = torch.tensor(accelerator.step)
    ckpt.close()
    if rank == 0 and args.out:
        torch.save(full, args.out)
        print("DONE", flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # see tests/scripts/accelerate_ddp_state.py
