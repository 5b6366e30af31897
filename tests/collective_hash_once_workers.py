"""Rank tasks of ``test_collective_hash_once`` (run by ``replication_workers.run`` as
``"collective_hash_once_workers:TASK"``; each rank simulates its node there)."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from pathlib import Path

import torch

import stepvault.engine.writer as writer_module
from stepvault import CheckpointManager
from stepvault.format import parse_manifest
from stepvault.manager.options import MemOptions

STEPS = (1, 2)


def _state(fresh: bool = False) -> dict:
    """Data-parallel state, the same on every rank (DCP writes a replicated tensor once,
    spread over the ranks): big weights (one chunk each), small biases (bundled)."""
    torch.manual_seed(99 if fresh else 7)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "opt": opt, "extra": {"seen": 0}}


def _train(state: dict, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 512, generator=g), torch.randn(8, 256, generator=g)
    loss = torch.nn.functional.mse_loss(state["model"](x), y)
    state["opt"].zero_grad()
    loss.backward()
    state["opt"].step()
    state["extra"]["seen"] += 8


def _fsdp(world: int, fresh: bool = False) -> dict:
    """FSDP2 state: every rank its own shards (DTensors) of the model and the moments
    (a 2 MiB shard of the big weight per rank), an RNG state and a value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import stepvault

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(99 if fresh else 7)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 16)
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optimizer": opt, "rng": stepvault.RNGState(), "extra": {"seen": 0}}


def _fsdp_train(state: dict, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(rank * 100 + step)  # each rank its own batch
    loss = state["model"](torch.randn(8, 1024, generator=g)).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["extra"]["seen"] += 8


def _flat(state: dict) -> dict[str, torch.Tensor]:
    if "optimizer" in state:  # FSDP2: this rank's local shards
        from manager_replication_workers import _local_shards

        return _local_shards(state)
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for i, s in enumerate(state["opt"].state.values()):
        for k, v in s.items():
            out[f"opt.{i}.{k}"] = v.clone()
    return out


def _manager(mem: Path, out: Path, async_save: bool) -> CheckpointManager:
    os.environ["STEPVAULT_MEM_ROOT"] = str(mem)  # this rank's node memory
    return CheckpointManager(
        out / "hot",
        "r",
        tiers={"mem": MemOptions(replicate=True)},  # every save to memory and disk
        async_save=async_save,
        lineage=False,
    )


def task_save(rank, world, mem, out, arg):
    """Save steps 1 and 2 to memory and disk (``arg``: "sync|async-ddp|fsdp"), counting per
    save the bytes this rank's write path hashes (both destinations); then die like a
    crashed job (memory kept)."""
    mode, kind = arg.split("-")
    lock = threading.Lock()
    hashed: Counter[str] = Counter()
    hashed_bytes = [0]
    real = writer_module.content_hash

    def counting(data):  # type: ignore[no-untyped-def]
        digest = real(data)
        with lock:
            hashed[digest] += 1
            hashed_bytes[0] += memoryview(data).nbytes
        return digest

    writer_module.content_hash = counting  # type: ignore[assignment]
    mgr = _manager(mem, out, mode == "async")
    state = _state() if kind == "ddp" else _fsdp(world)
    rank_mem = mgr._p.rank_mem
    assert rank_mem is not None
    report = []
    for step in STEPS:
        if kind == "ddp":
            _train(state, step)
        else:
            _fsdp_train(state, rank, step)
        hashed.clear()
        hashed_bytes[0] = 0
        assert mgr.save(step, state) is not None
        mgr.wait()
        # this rank's bytes: its memory copy (DDP: the whole state; FSDP2: its shards)
        mem_copy = parse_manifest(rank_mem.tier.store.read_manifest(rank_mem.run, step))
        logical = mem_copy.logical_bytes
        small_tensor = int(rank_mem.tier.store.settings.get("small_tensor", 1 << 20))
        small = sum(t.nbytes for t in mem_copy.tensors.values() if t.nbytes < small_tensor)
        report.append(
            {
                "step": step,
                "logical": logical,
                "small": small,
                "hashed_bytes": hashed_bytes[0],
                "most_hashed": max(hashed.values()),
            }
        )
        torch.save(_flat(state), out / f"expected{step}_{rank}.pt")
    rank_mem.replicator.wait()  # replicas written before the kill
    (out / f"hashed{rank}.json").write_text(json.dumps(report))
    (out / f"extra{rank}.json").write_text(json.dumps(state["extra"]))
    # no close(): SIGKILLed by the harness with everything in memory


def task_restore(rank, world, mem, out, arg):
    """Restore the latest (step 2) through the manager; check it bitwise; report where
    the bytes came from."""
    mgr = _manager(mem, out, False)
    state = _state(fresh=True) if arg == "ddp" else _fsdp(world, fresh=True)
    info = mgr.restore(state)
    assert info is not None and info.step == STEPS[-1], info
    expected = torch.load(out / f"expected{info.step}_{rank}.pt", weights_only=True)
    got = _flat(state)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), (key, info.tier)
    assert state["extra"] == json.loads((out / f"extra{rank}.json").read_text())
    (out / f"info{rank}.json").write_text(json.dumps({"step": info.step, "tier": info.tier}))
    # no close(): a close would flush or remove memory the next restore must not find
