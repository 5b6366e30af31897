"""Rank workers for the memory-replication tests (spawned; importable at module level).

Each rank simulates its node with ``STEPVAULT_NODE`` and a per-node memory root
(``<mem>/<node>``): ranks ``0..W/2-1`` are node ``n0``, the rest node ``n1``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import stepvault
from stepvault.distributed.replication import Replicator, rank_run
from stepvault.store import Store


def node_of(rank: int, world: int) -> str:
    return f"n{rank // max(1, world // 2)}"


def run(rank: int, world: int, port: int, task: str, mem: str, out: str, arg: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("T16B_DUMP", "1e6")), exit=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["STEPVAULT_NODE"] = node_of(rank, world)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    result = "ok"
    try:
        # "module:task" runs a task of another worker module (the manager's tests)
        module, _, name = task.rpartition(":")
        tasks = vars(importlib.import_module(module)) if module else globals()
        tasks[f"task_{name}"](rank, world, Path(mem) / node_of(rank, world), Path(out), arg)
    except BaseException as exc:
        result = f"error {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    (Path(out) / f"rank{rank}.txt").write_text(result)
    # Every rank has reported before any dies (a dead rank makes the launcher stop the rest).
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every rank ends like a crashed job: no close, no clean-up of the memory roots.
    os.kill(os.getpid(), signal.SIGKILL)


def make_state(rank: int, *, fresh: bool = False) -> dict:
    torch.manual_seed(1000 + rank if not fresh else 99)  # a different "shard" per rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return {"model": model, "opt": opt, "extra": {"seen": 0}}


def train_step(state: dict, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(rank * 100 + step)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    loss = torch.nn.functional.mse_loss(state["model"](x), y)
    state["opt"].zero_grad()
    loss.backward()
    state["opt"].step()
    state["extra"]["seen"] += 16


def flat(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for i, s in enumerate(state["opt"].state.values()):
        out[f"opt.{i}"] = s["momentum_buffer"].clone()
    return out


def task_train_save(rank, world, mem, out, arg):
    """Train 3 steps, save each to the node's memory, replicate; the owner evicts step 1."""
    own = Store.open(mem / "own", create=True)
    rep = Replicator(own, mem)
    state = make_state(rank)
    for step in (1, 2, 3):
        train_step(state, rank, step)
        stepvault.save(own, state, run=rank_run("r", rank), step=step, collective=False)
        if step == 3:  # the mem tier keeps 2: step 1 leaves, and so must its replica
            own.delete_manifest(rank_run("r", rank), 1)
        rep.replicate("r", step)
    rep.wait()
    if rep.last_error is not None:
        raise rep.last_error
    torch.save(flat(state), out / f"expected{rank}.pt")
    (out / f"seen{rank}.json").write_text(json.dumps(state["extra"]))


def task_resume(rank, world, mem, out, arg):
    """Restart: restore from memory (own or the buddy's); report where it came from."""
    from stepvault.core.peer_restore import restore_from_memory

    own = Store.open(mem / "own", create=True)
    rep = Replicator(own, mem)
    state = make_state(rank, fresh=True)
    info = restore_from_memory(rep, state, run="r")
    if info is None:
        (out / f"info{rank}.json").write_text(json.dumps(None))
        return
    expected = torch.load(out / f"expected{rank}.pt", weights_only=True)
    got = flat(state)
    assert expected.keys() == got.keys(), (expected.keys(), got.keys())
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    assert state["extra"] == json.loads((out / f"seen{rank}.json").read_text())
    train_step(state, rank, 4)  # training continues from the restored state
    (out / f"info{rank}.json").write_text(json.dumps({"step": info.step, "tier": info.tier}))


def task_budget(rank, world, mem, out, arg):
    """Step 1's replica fits the budget; step 2's does not and is skipped."""
    own = Store.open(mem / "own", create=True)
    rep = Replicator(own, mem, budget_bytes=1 << 30)
    state = make_state(rank)
    train_step(state, rank, 1)
    stepvault.save(own, state, run=rank_run("r", rank), step=1, collective=False)
    rep.replicate("r", 1)
    rep.wait()
    train_step(state, rank, 2)
    stepvault.save(own, state, run=rank_run("r", rank), step=2, collective=False)
    from stepvault.distributed.replication import tree_bytes

    rep.budget_bytes = tree_bytes(mem) + 64  # room for nothing more than a few bytes
    before = tree_bytes(mem / "peers")
    dist.barrier()  # both nodes have measured before either receives
    rep.replicate("r", 2)
    rep.wait()
    (out / f"usage{rank}.json").write_text(
        json.dumps({"peers_before": before, "peers_after": tree_bytes(mem / "peers")})
    )


def task_replicate_loop(rank, world, mem, out, arg):
    """Save and replicate a larger state until killed (the crash campaign)."""
    own = Store.open(mem / "own", create=True)
    rep = Replicator(own, mem)
    torch.manual_seed(rank)
    state = {"w": torch.randn(int(arg) // 4)}
    for step in range(1, 10_000):
        state["w"].add_(1.0)
        stepvault.save(own, state, run=rank_run("r", rank), step=step, collective=False)
        old = [s for s in own.list_steps(rank_run("r", rank)) if s < step - 1]
        for s in old:
            own.delete_manifest(rank_run("r", rank), s)
        rep.replicate("r", step)
        (out / f"progress{rank}").write_text(str(step))
        rep.wait()


def task_resume_any(rank, world, mem, out, arg):
    """Restart and report which step and tier every rank got (None: fall back to disk)."""
    from stepvault.core.peer_restore import restore_from_memory

    own = Store.open(mem / "own", create=True)
    rep = Replicator(own, mem)
    state = {"w": torch.zeros(int(arg) // 4)} if arg else make_state(rank, fresh=True)
    info = restore_from_memory(rep, state, run="r")
    doc = None if info is None else {"step": info.step, "tier": info.tier}
    if info is not None and arg:  # the loop adds 1.0 per step to a seeded tensor
        torch.manual_seed(rank)
        ref = torch.randn(int(arg) // 4)
        for _ in range(info.step):  # the same float32 additions, the same rounding
            ref.add_(1.0)
        assert torch.equal(state["w"], ref)
    (out / f"info{rank}.json").write_text(json.dumps(doc))
