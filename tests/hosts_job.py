"""The training job of the namespaced-host tests (``tests/hosts.py``), started by
``torchrun`` on every host: every rank trains the same deterministic model (no collective
in the step, so the reference is a plain replay, :func:`reference`), saves every step
through a ``CheckpointManager`` with the replicated mem tier in its host's ``/dev/shm``
(disk every ``--disk-every`` steps), restores first, and writes what it did under
``--out``: ``restore-<launch>-<rank>.json`` (step, tier, digest), ``progress-<rank>`` (the
last step saved) and ``final-<launch>-<rank>.json`` (the final digest, replication state).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from replication_workers import make_state, train_step


def digest(state: dict) -> str:
    """One hash of every tensor of the model and the optimizer and of the plain values."""
    h = hashlib.sha256()
    for key, value in sorted(state["model"].state_dict().items()):
        h.update(key.encode() + value.detach().contiguous().numpy().tobytes())
    for i, per in enumerate(state["opt"].state.values()):
        h.update(f"opt{i}".encode() + per["momentum_buffer"].numpy().tobytes())
    h.update(json.dumps(state["extra"], sort_keys=True).encode())
    return h.hexdigest()


def make(width: int) -> dict:
    """The job's state: the replication tests' small model, or (``width`` > 0) two
    ``width`` x ``width`` layers (a benchmark's size: 16 bytes per parameter with momentum)."""
    if not width:
        return make_state(0)
    torch.manual_seed(1000)
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 8))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return {"model": model, "opt": opt, "extra": {"seen": 0}}


def reference(steps: int, width: int = 0) -> list[str]:
    """Digests of the uninterrupted run after each step (index 0: the fresh state)."""
    torch.set_num_threads(1)
    state = make(width)
    out = [digest(state)]
    for step in range(1, steps + 1):
        train_step(state, 0, step)
        out.append(digest(state))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True, help="the hot store (a shared path or s3://)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--disk-every", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.1, help="seconds per training step")
    p.add_argument("--launch", type=int, default=0)
    p.add_argument("--timeout", type=float, default=20.0, help="collective timeout (s)")
    p.add_argument("--width", type=int, default=0, help="a bigger model (see make)")
    args = p.parse_args()
    torch.set_num_threads(1)
    import torch.distributed as dist

    from stepvault import CheckpointManager, Every
    from stepvault.manager.options import MemOptions
    from stepvault.tiers import CopyEvery

    out = Path(args.out)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    os.environ.setdefault("STEPVAULT_MEM_ROOT", "/dev/shm/stepvault")  # this host's memory
    (out / f"progress-{rank}").write_text("starting")
    mgr = CheckpointManager(
        args.root,
        "r",
        save=Every(steps=1),
        tiers={"mem": MemOptions(replicate=True)},
        tier_policy=CopyEvery("hot", steps=args.disk_every),
        lineage=False,
    )
    state = make(args.width)
    (out / f"progress-{rank}").write_text("restoring")
    t0 = time.perf_counter()
    info = mgr.restore(state)
    seconds = time.perf_counter() - t0
    start = info.step if info is not None else 0
    doc = {"step": start, "tier": info.tier if info else None, "digest": digest(state),
           "seconds": seconds}  # fmt: skip
    (out / f"restore-{args.launch}-{rank}.json").write_text(json.dumps(doc))
    for step in range(start + 1, args.steps + 1):
        train_step(state, 0, step)
        mgr.save(step, state, force=step == args.steps)  # the last one on disk too
        (out / f"progress-{rank}").write_text(str(step))
        time.sleep(args.sleep)
    mgr.wait(replicated=True)
    replication = mgr.stats().get("replication")
    mgr.close()
    final = {"digest": digest(state), "replication": replication, "host": os.uname().nodename}
    (out / f"final-{args.launch}-{rank}.json").write_text(json.dumps(final, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
