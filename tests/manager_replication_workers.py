"""Rank tasks for the manager's replicated mem tier (run by ``replication_workers.run``
as ``"manager_replication_workers:TASK"``; each rank simulates its node there)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from replication_workers import flat, make_state, train_step

from stepvault import CheckpointManager
from stepvault.manager.options import MemOptions
from stepvault.tiers import CopyEvery


# Data-parallel training: every rank holds the same replicated state (a DCP save on disk
# keeps one copy of a replicated tensor, so per-rank values would not survive it).
def _state(fresh: bool = False) -> dict:
    return make_state(0, fresh=fresh)


def _train(state: dict, step: int) -> None:
    train_step(state, 0, step)


def _manager(mem: Path, out: Path, budget: int | str | None = None) -> CheckpointManager:
    os.environ["STEPVAULT_MEM_ROOT"] = str(mem)  # this rank's node memory
    return CheckpointManager(
        out / "hot",
        "r",
        tiers={"mem": MemOptions(budget=budget, replicate=True)},
        tier_policy=CopyEvery("hot", steps=3),  # disk every 3rd save; the rest in memory
        lineage=False,
    )


def _report(rank: int, out: Path, name: str, doc: object) -> None:
    (out / f"{name}{rank}.json").write_text(json.dumps(doc))


def task_train(rank, world, mem, out, arg):
    """Train and save steps 1..5 (disk: step 3 only), then die like a crashed job."""
    mgr = _manager(mem, out)
    assert mgr.restore(_state()) is None  # a fresh start
    state = _state()
    for step in range(1, 6):
        _train(state, step)
        handle = mgr.save(step, state)
        assert handle is not None
        if step in (3, 4):  # the expected checkpoints (their saves committed: wait)
            mgr.wait()
            torch.save(flat(state), out / f"expected{step}_{rank}.pt")
    mgr.wait()
    mgr._p.rank_mem.replicator.wait()  # replicas written before the kill
    torch.save(flat(state), out / f"expected5_{rank}.pt")
    # no close(): SIGKILLed by the harness with everything in memory


def _check(state: dict, out: Path, step: int, rank: int, info) -> None:
    expected = torch.load(out / f"expected{step}_{rank}.pt", weights_only=True)
    got = flat(state)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), (key, info.step, info.tier)
    assert state["extra"] == {"seen": 16 * info.step}  # plain values come back too


def task_resume(rank, world, mem, out, arg):
    """Restart through the manager: restore step 4 by number (only in memory), then
    ``latest``; check both bitwise (the latter against step ``arg``); train one more step
    and save it (step 6: due on disk), close."""
    mgr = _manager(mem, out)
    state = _state(fresh=True)
    by_step = mgr.restore(state, step=4)
    assert by_step is not None and by_step.step == 4
    _check(state, out, 4, rank, by_step)
    state = _state(fresh=True)
    info = mgr.restore(state)
    assert info is not None
    _check(state, out, int(arg), rank, info)
    _train(state, info.step + 1)
    mgr.save(info.step + 1, state, force=True)
    mgr.wait()
    torch.save(flat(state), out / f"expected{info.step + 1}_{rank}.pt")
    restores = [e for e in mgr.events() if e["event"] == "restore"]
    mgr.close()
    _report(
        rank,
        out,
        "info",
        {
            "step": info.step,
            "tier": info.tier,
            "step4_tier": by_step.tier,
            "event": {k: restores[-1].get(k) for k in ("step", "tier", "rank_tiers")},
            "mem_left": sorted(p.name for p in mem.iterdir()) if mem.exists() else [],
        },
    )


def task_reopen(rank, world, mem, out, arg):
    """Five managers in turn in the same job (each closed): close keeps memory that holds
    the only copy; a later one restores it; memory older than disk is not restored; with
    both nodes' memory gone, disk; a save one rank cannot fit into memory goes to disk."""
    mgr = _manager(mem, out)
    state = {"w": torch.zeros(64)}
    for step in range(1, 6):
        state["w"].add_(1.0)
        mgr.save(step, state)
    mgr.close()  # step 5 is only in memory: kept (a mem_kept event)
    assert mgr.store.list_steps("r") == [3]

    mgr = _manager(mem, out)
    own = mgr._p.rank_mem.tier
    assert own.steps() == [1, 2, 3, 4, 5]
    got = {"w": torch.zeros(64)}
    info = mgr.restore(got)
    assert (info.step, info.tier) == (5, "mem") and torch.equal(got["w"], torch.full((64,), 5.0))
    got["w"].add_(1.0)
    mgr.save(6, got, force=True)  # due on disk: close may remove the memory now
    mgr.close()
    assert not Path(own.path).exists()
    assert mgr.store.list_steps("r") == [3, 6]

    # Memory that holds only steps older than the newest on disk: disk wins.
    mgr = _manager(mem, out)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((64,), float(step))}, force=True)
    mgr.wait()
    assert mgr._p.rank_mem.tier.steps() == [1, 2]
    got = {"w": torch.zeros(64)}
    info = mgr.restore(got)
    assert (info.step, info.tier) == (6, "hot"), (info.step, info.tier)
    assert torch.equal(got["w"], torch.full((64,), 6.0))
    mgr.close()  # memory older than disk is never restored: removed
    assert not Path(mgr._p.rank_mem.tier.path).exists()

    # Both nodes replaced: no memory anywhere, so every rank restores from disk.
    dist.barrier()
    shutil.rmtree(mem)
    mgr = _manager(mem, out)
    got = {"w": torch.zeros(64)}
    info = mgr.restore(got)
    assert (info.step, info.tier) == (6, "hot") and torch.equal(got["w"], torch.full((64,), 6.0))
    mgr.close()

    # Rank 0's memory is too small for a save that is not due on disk: every rank saves
    # it to disk (DCP stays collective), and rank 1 also into its memory.
    mgr = _manager(mem, out, budget=4096 if rank == 0 else "1GB")
    half = 2048 if rank == 0 else 500_000_000  # the node's budget: half own, half replicas
    rank_mem = mgr._p.rank_mem
    assert rank_mem.tier.budget == rank_mem.replicator.budget_bytes == half
    mgr.save(7, got)
    mgr.wait()
    assert mgr.store.list_steps("r") == [3, 6, 7]
    assert mgr._p.rank_mem.tier.steps() == ([] if rank == 0 else [7])
    mgr.close()


# FSDP2: every rank holds its own shards (DTensors) of the model and the optimizer moments.
def _fsdp_state(world: int, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import stepvault

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6)
    )  # fmt: skip
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt, "rng": stepvault.RNGState(), "extra": {"seen": 0}}


def _fsdp_train(state: dict, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(rank * 100 + step)  # each rank its own batch
    loss = state["model"](torch.randn(8, 16, generator=g)).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["extra"]["seen"] += 8


def _local_shards(state: dict) -> dict[str, torch.Tensor]:
    """This rank's shards of the parameters and of every optimizer state tensor."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"p.{n}": local(p) for n, p in state["model"].named_parameters()}
    for i, per_param in enumerate(state["optimizer"].state.values()):
        out.update({f"o.{i}.{k}": local(v) for k, v in per_param.items()})
    return out


def task_fsdp_train(rank, world, mem, out, arg):
    """FSDP2 state, saves 1..5 into memory (disk: step 3), then die like a crashed job."""
    mgr = _manager(mem, out)
    state = _fsdp_state(world, 0)
    assert mgr.restore(state) is None  # a fresh start: nothing in memory or on disk
    assert not state["optimizer"].state  # and the optimizer was left as it was
    for step in range(1, 6):
        _fsdp_train(state, rank, step)
        mgr.save(step, state)
    mgr.wait()
    mgr._p.rank_mem.replicator.wait()  # replicas written before the kill
    assert [e["event"] for e in mgr.events()].count("mem_save_failed") == 0
    torch.save(_local_shards(state), out / f"fsdp5_{rank}.pt")
    torch.save(torch.get_rng_state(), out / f"rng5_{rank}.pt")


def task_fsdp_resume(rank, world, mem, out, arg):
    """A fresh FSDP2 model and optimizer (no moments yet) restore step 5 from memory."""
    mgr = _manager(mem, out)
    state = _fsdp_state(world, 7)
    info = mgr.restore(state)
    expected = torch.load(out / f"fsdp5_{rank}.pt", weights_only=True)
    got = _local_shards(state)
    assert expected.keys() == got.keys(), (sorted(expected), sorted(got))
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert torch.equal(torch.get_rng_state(), torch.load(out / f"rng5_{rank}.pt"))
    assert state["extra"] == {"seen": 40}
    _fsdp_train(state, rank, 6)  # the restored shards train on
    _report(rank, out, "fsdp", {"step": info.step, "tier": info.tier})
