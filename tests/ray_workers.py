"""The per-worker training function of tests/test_tracker_ray.py (imported by Ray's
worker processes, which get this directory on their PYTHONPATH)."""

from __future__ import annotations

import json
import os
import signal

import torch

#: steps in all, a checkpoint every SAVE_EVERY, and where the first attempt dies
TOTAL, SAVE_EVERY, KILL_AT = 12, 3, 7


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of ``step`` on ``rank``: a function of both alone (a resumed run sees
    the same batches as a straight one)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :2].sin()


def train_fn(config: dict) -> None:
    import ray.train

    import stepvault
    from stepvault.integrations.ray import RayCheckpointer

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": opt, "step": 0}
    ckpt = RayCheckpointer(config["root"], "ray", save=stepvault.Every(steps=SAVE_EVERY))
    info = ckpt.restore(state)
    with open(os.path.join(config["log"], f"attempt-{rank}-{os.getpid()}.json"), "w") as f:
        json.dump(
            {"rank": rank, "step": info.step if info else None,
             "skipped": [s.step for s in info.skipped] if info else []},
            f,
        )  # fmt: skip
    first_attempt = info is None
    for step in range(state["step"], TOTAL):
        if first_attempt and rank == 1 and step + 1 == KILL_AT:
            # Damage the newest checkpoint, then die mid-run: the restarted group must
            # skip the damaged one and resume from the one before, bitwise.
            vault = stepvault.open(config["root"])
            newest, older = KILL_AT - 1, KILL_AT - 1 - SAVE_EVERY
            only = sorted(
                set(vault.manifest("ray", newest).objects)
                - set(vault.manifest("ray", older).objects)
            )
            path = os.path.join(config["root"], "objects", only[0][:2], only[0])
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 1]))
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank)
        loss = (ddp(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] = step + 1
        ckpt.save(step + 1, state, metrics={"loss": loss.item()})
    ckpt.close()


def reference(world: int = 2) -> torch.nn.Module:
    """The same training straight through in one process: DDP averages the ranks'
    gradients (each divided by the world size, then summed), done here by hand."""
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(TOTAL):
        grads = []
        for rank in range(world):
            x, y = batch(step, rank)
            model.zero_grad()
            (model(x) - y).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = grads[0][i] / world
            for g in grads[1:]:
                total = total + g[i] / world
            p.grad = total
        opt.step()
    return model
