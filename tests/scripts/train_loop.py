"""A training process for crash and preemption tests (run as a subprocess).

Prints ``RESUMED <step>`` / ``FRESH``, ``SAVE_START <step>`` before each save, and
``FINAL <digest>`` (BLAKE3 of every parameter and optimizer-state byte) at the end, so the
parent can compare an interrupted run with an uninterrupted one bitwise.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from blake3 import blake3

import stepvault
from stepvault.manager.options import GCOptions, ManagerOptions
from stepvault.policy import Every, KeepLast, OnSignal


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = blake3()
    for t in model.state_dict().values():
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            h.update(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tier_options(cold: str | None, mem: str | None = None, disk_every: int = 0) -> dict:
    from stepvault.tiers import CopyEvery, HotLast, MemLast

    if mem:  # the mem tier (issue 16): node memory first, disk every n-th step
        policy = MemLast(2) | CopyEvery("hot", steps=disk_every) if disk_every else MemLast(2)
        return {"tiers": {"mem": mem}, "tier_policy": policy}
    if not cold:
        return {}
    return {
        "tiers": {"archive": cold},
        "tier_policy": HotLast(2) | CopyEvery("archive", steps=6),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--run", default="job")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--slow-writes", type=float, default=0.0, help="sleep per object write")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--cold", help="a directory as cold tier: every 6th step copied, hot keeps 2")
    p.add_argument("--mem", help="a mem tier root (MemLast(2))")
    p.add_argument("--disk-every", type=int, default=0, help="with --mem: disk every n-th step")
    args = p.parse_args()

    torch.set_num_threads(1)
    if args.slow_writes:
        from _slow_writes import slow_object_writes

        slow_object_writes(args.slow_writes)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width), torch.nn.Tanh(), torch.nn.Dropout(0.1),
        torch.nn.Linear(args.width, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1),
    )  # fmt: skip
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
        save=Every(steps=args.save_every) | OnSignal(),
        keep=KeepLast(3),
        async_save=not args.sync,
        options=ManagerOptions(gc=GCOptions(grace_seconds=0.0)),
        total_steps=args.steps,
        **_tier_options(args.cold, args.mem, args.disk_every),
    )
    info = mgr.restore(state)
    print(f"RESUMED {info.step}" if info else "FRESH", flush=True)
    if info is not None:
        print(f"FROM {info.tier} {info.seconds:.6f}", flush=True)
    start = state["step"]
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        state["step"] = step
        print(f"STEP {step}", flush=True)
        if mgr.should_save(step):
            print(f"SAVE_START {step}", flush=True)
        mgr.save(step, state, metrics={"loss": loss.item()})
        time.sleep(args.step_sleep)
    mgr.close()
    print(f"FINAL {digest(model, opt)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
