"""The training job of the namespaced-host tests (``tests/hosts.py``), started by
``torchrun`` on every host: every rank trains the same deterministic model (no collective
in the step, so the reference is a plain replay, :func:`reference`), saves every step
through a ``CheckpointManager`` with the replicated mem tier in its host's ``/dev/shm``
(disk every ``--disk-every`` steps), restores first, and writes what it did under
``--out``: ``restore-<launch>-<rank>.json`` (step, tier, digest, the launch that saved
it), ``progress-<launch>-<rank>`` (the last step saved), ``final-<launch>-<rank>.json`` (the final
digest, replication state) and, when the job fails, ``error-<launch>-<rank>.json`` (the
exception's type and message: what a user would read). Every save carries
``{"launch": N}`` as its metadata, so a test tells which launch committed a checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
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


_REFERENCES: dict[tuple[int, int], list[str]] = {}
_REFERENCE_LOCK = threading.Lock()


def reference(steps: int, width: int = 0) -> list[str]:
    """Digests of the uninterrupted run after each step (index 0: the fresh state).

    Computed once per process and shape, under a lock: it seeds and draws from torch's
    global RNG, so two campaign lanes (threads) computing it at once interleaved their
    draws and got a wrong reference (three first trials "broken" in a ``--parallel 3``
    round, none of them a product fault)."""
    with _REFERENCE_LOCK:
        if (steps, width) not in _REFERENCES:
            torch.set_num_threads(1)
            state = make(width)
            out = [digest(state)]
            for step in range(1, steps + 1):
                train_step(state, 0, step)
                out.append(digest(state))
            _REFERENCES[steps, width] = out
        return list(_REFERENCES[steps, width])


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
    p.add_argument("--stale-after", type=float, default=None, help="the lease's stale_after")
    args = p.parse_args()
    try:
        run(args)
    except BaseException as exc:
        # What the user reads on this rank; a test checks every rank failed cleanly.
        doc = {"type": type(exc).__name__, "message": str(exc), "host": os.uname().nodename}
        rank = os.environ.get("RANK", "x")
        (Path(args.out) / f"error-{args.launch}-{rank}.json").write_text(json.dumps(doc))
        raise


def run(args: argparse.Namespace) -> None:
    """The job: restore, train and save every step, wait for the replicas, close."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from stepvault import CheckpointManager, Every
    from stepvault.manager.options import LeaseOptions, ManagerOptions, MemOptions
    from stepvault.tiers import CopyEvery

    out = Path(args.out)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    os.environ.setdefault("STEPVAULT_MEM_ROOT", "/dev/shm/stepvault")  # this host's memory
    (out / f"progress-{args.launch}-{rank}").write_text("starting")
    (out / f"host-{args.launch}-{rank}").write_text(os.uname().nodename)  # where rank runs
    mgr = CheckpointManager(
        args.root,
        "r",
        save=Every(steps=1),
        tiers={"mem": MemOptions(replicate=True)},
        tier_policy=CopyEvery("hot", steps=args.disk_every),
        lineage=False,
        options=ManagerOptions(lease=LeaseOptions(stale_after=args.stale_after))
        if args.stale_after
        else None,
    )
    state = make(args.width)
    (out / f"progress-{args.launch}-{rank}").write_text("restoring")
    t0 = time.perf_counter()
    info = mgr.restore(state)
    seconds = time.perf_counter() - t0
    start = info.step if info is not None else 0
    saved_by = info.metadata.get("launch") if info and isinstance(info.metadata, dict) else None
    doc = {"step": start, "tier": info.tier if info else None, "digest": digest(state),
           "seconds": seconds, "saved_by": saved_by}  # fmt: skip
    (out / f"restore-{args.launch}-{rank}.json").write_text(json.dumps(doc))
    for step in range(start + 1, args.steps + 1):
        train_step(state, 0, step)
        # the last one on disk too
        mgr.save(step, state, force=step == args.steps, metadata={"launch": args.launch})
        (out / f"progress-{args.launch}-{rank}").write_text(str(step))
        time.sleep(args.sleep)
    mgr.wait(replicated=True)
    replication = mgr.stats().get("replication")
    mgr.close()
    final = {"digest": digest(state), "replication": replication, "host": os.uname().nodename}
    (out / f"final-{args.launch}-{rank}.json").write_text(json.dumps(final, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
