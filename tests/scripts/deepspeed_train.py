"""A 2-rank DeepSpeed ZeRO job for tests/test_sharded_deepspeed.py: launch with
``python -m torch.distributed.run --standalone --nproc_per_node 2 deepspeed_train.py ...``
(gloo on CPU, ``DS_ACCELERATOR=cpu``).

A small MLP with dropout (so every rank's RNG matters), torch AdamW under ZeRO 1/2/3
(``zero_allow_untested_optimizer``), a WarmupLR scheduler, data drawn by step from a
per-epoch permutation (8 batches an epoch, so runs cross epoch boundaries). ``--mode
stepvault`` checkpoints through :class:`DeepSpeedCheckpointer`; ``--mode native`` through
DeepSpeed's own ``save_checkpoint``/``load_checkpoint`` (each rank's RNG in a side file,
as DeepSpeed keeps none). ``--hold-after N``: after the checkpoint at step N is committed,
rank 0 prints ``COMMITTED N`` and every rank waits to be killed (``--pid-dir``: where
each rank writes its pid). ``--on-signal``: the policy also saves on SIGTERM, then every
rank exits with 143 (``--step-sleep`` slows the steps for a signal to land mid-run). At the
end rank 0 writes the full fp32 weights and Adam moments to ``--out`` (``torch.save``, read
by the test).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

BATCHES_PER_EPOCH = 8


def batch(step: int, rank: int) -> torch.Tensor:
    epoch, index = divmod(step, BATCHES_PER_EPOCH)
    order = torch.randperm(BATCHES_PER_EPOCH, generator=torch.Generator().manual_seed(epoch))
    g = torch.Generator().manual_seed(1000 * int(order[index]) + rank)
    return torch.randn(4, 16, generator=g)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["stepvault", "native"], default="stepvault")
    p.add_argument("--root", required=True)
    p.add_argument("--run", default="ds")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--hold-after", type=int, default=0)
    p.add_argument("--out", default="")
    p.add_argument("--pid-dir", default="", help="each rank writes rank<r>.pid here")
    p.add_argument("--on-signal", action="store_true", help="save on SIGTERM, then exit 143")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    p.add_argument(
        "--no-moments",
        action="store_true",
        help="--out holds the weights only (DeepSpeed links the Adam moments to the "
        "parameters at the first step after a load: a job that takes none cannot read them)",
    )
    args = p.parse_args()

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    if args.pid_dir:  # torchrun starts its workers in sessions of their own
        with open(os.path.join(args.pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 8)
    )
    torch.manual_seed(100 + rank)  # the ranks' RNGs differ
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    ckpt = None
    if args.mode == "stepvault":
        from stepvault.integrations.deepspeed import DeepSpeedCheckpointer
        from stepvault.policy import Every, KeepLast, OnSignal

        policy = Every(steps=args.save_every)
        ckpt = DeepSpeedCheckpointer(
            engine,
            args.root,
            args.run,
            save=policy | OnSignal() if args.on_signal else policy,
            keep=KeepLast(3),
        )
        info = ckpt.resume()
        if rank == 0:
            print("FRESH" if info is None else f"RESUMED {info.step} skipped={len(info.skipped)}")
    else:
        path, _ = engine.load_checkpoint(args.root)
        if path is not None:
            rng = torch.load(os.path.join(args.root, f"rng{rank}.pt"), weights_only=False)
            torch.set_rng_state(rng)
        if rank == 0:
            print("FRESH" if path is None else f"RESUMED {engine.global_steps}")
    sys.stdout.flush()

    while engine.global_steps < args.steps:
        if args.step_sleep:
            time.sleep(args.step_sleep)
        x = batch(engine.global_steps, rank)
        loss = (engine(x) - x[:, :8].sin()).square().mean()
        engine.backward(loss)
        engine.step()
        step = engine.global_steps
        saved = None
        if ckpt is not None:
            saved = ckpt.save(metrics={"loss": loss.item()})
            if saved is not None:
                ckpt.wait()  # committed before anyone is told
        elif step % args.save_every == 0:
            engine.save_checkpoint(args.root)
            torch.save(torch.get_rng_state(), os.path.join(args.root, f"rng{rank}.pt"))
            saved = True
        if saved is not None and step == args.hold_after:
            dist.barrier()
            if rank == 0:
                print(f"COMMITTED {step}", flush=True)
            while True:  # the test kills the job now (SIGKILL)
                time.sleep(1)

    full: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():
        full[name] = safe_get_full_fp32_param(param).clone()
        for key in () if args.no_moments else ("exp_avg", "exp_avg_sq"):
            full[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).clone()
    if ckpt is not None:
        ckpt.close()
    if rank == 0 and args.out:
        torch.save(full, args.out)
        print("DONE", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
