"""A 2-rank Accelerate job with a DeepSpeed plugin (ZeRO) for tests/test_sharded_accelerate.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        accelerate_deepspeed_train.py --root DIR [--stage 2] [--steps 20] [--out FILE]

or ``accelerate launch --config_file DEEPSPEED_CONFIG accelerate_deepspeed_train.py ...``
(tests/test_accelerate_launch.py): the plugin then comes from the config's
``deepspeed_config_file`` (``--stage`` is ignored) and rank 0 prints
``LAUNCH-CONFIG zero_stage=<s>``.

``Accelerator(deepspeed_plugin=...)`` prepares a small MLP with dropout (every rank's RNG
matters), torch AdamW (``zero_allow_untested_optimizer``) and a StepLR scheduler; data is
drawn by step from a per-epoch permutation (8 batches an epoch, so runs cross epoch
boundaries). ``AcceleratorCheckpointer`` saves every ``--save-every`` steps (and on SIGTERM,
then every rank exits 143) with ``extra={"epoch": ...}`` and resumes at start. Rank 0
prints ``FRESH`` / ``RESUMED <step> epoch=<e> skipped=<n>``; at the end it writes the full
fp32 weights, both Adam moments of every parameter, the scheduler's LR and a draw of each
rank's torch RNG to ``--out`` (``torch.save``, read by the test).

No test-only patch: on CPU processes Accelerate picks no process-group backend by itself
(it would train each rank alone), so the job names gloo with ``InitProcessGroupKwargs`` as a
CPU user does; ``DS_ACCELERATOR=cpu`` selects DeepSpeed's CPU accelerator.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

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
    p.add_argument("--run", default="accds")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument("--out", default="")
    args = p.parse_args()

    torch.set_num_threads(1)
    # Under `accelerate launch` with a DeepSpeed config, Accelerate builds the plugin from the
    # config (its `deepspeed_config_file`), as a user's script leaves it to the launcher.
    launched = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    plugin = (
        None
        if launched
        else DeepSpeedPlugin(
            hf_ds_config={
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": args.stage},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 10_000,
            }
        )
    )
    accelerator = Accelerator(
        deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")]
    )
    rank = dist.get_rank()
    if launched and rank == 0:
        stage = accelerator.state.deepspeed_plugin.zero_stage
        print(f"LAUNCH-CONFIG zero_stage={stage}", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    torch.manual_seed(100 + rank)  # the ranks' RNGs differ

    progress = {"epoch": 0}
    ckpt = AcceleratorCheckpointer(
        accelerator,
        args.root,
        run=args.run,
        save=Every(steps=args.save_every) | OnSignal(),  # SIGTERM: save, exit 143
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

    full: dict[str, torch.Tensor] = {}
    for name, param in model.module.named_parameters():
        full[name] = safe_get_full_fp32_param(param).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).clone()
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
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
