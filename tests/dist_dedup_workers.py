"""Workers of tests/test_distributed_dedup.py and tests/test_one_rank_group.py: a
half-frozen FSDP2 fine-tune saved collectively on gloo ranks (spawned; importable at
module level)."""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

#: the frozen part of the model: small tensors (per rank a 16x32 weight shard of 2 KiB, a
#: LayerNorm's 64 B shards, 64 B biases), the kind a rank's bundle used to mix with trained ones
FROZEN = ("model.0.", "model.1.", "model.2.")


def plain_model() -> torch.nn.Module:
    """The fine-tune's module, unsharded (what one process restores a checkpoint into)."""
    return torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 32),
        torch.nn.Linear(32, 8),
    )  # fmt: skip


def build(mesh) -> dict:
    """The fine-tune: three small frozen modules, one trained Linear, AdamW, all FSDP2."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = plain_model()
    for layer in list(model)[:3]:
        layer.requires_grad_(False)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return {"model": model, "optimizer": opt, "step": 0}


def train(state: dict, rank: int) -> None:
    g = torch.Generator().manual_seed(10 * state["step"] + rank)
    loss = state["model"](torch.randn(8, 32, generator=g)).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["step"] += 1


def full(state: dict) -> dict[str, torch.Tensor]:
    """Model and optimizer gathered (every rank takes part), flat names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(state["model"], state["optimizer"], options=opts)
    flat = {f"model.{k}": v.clone() for k, v in msd.items()}
    for name, st in osd["state"].items():
        for k, v in st.items():
            flat[f"opt.{name}.{k}"] = v.clone()
    return flat


def task_fine_tune(rank: int, world: int, root: str, out: str) -> None:
    """Two saves of the fine-tune through an asynchronous collective manager, then a
    fresh state restored from each in new objects; plus one save in the layout of the
    writer before tensors started their own chunks (an existing store), restored too."""
    import stepvault
    from stepvault.distributed.storage import StepvaultWriter

    mesh = init_device_mesh("cpu", (world,))
    state = build(mesh)
    saved = {}
    with stepvault.CheckpointManager(
        root, "ft", save=stepvault.Every(steps=1), async_save=True
    ) as mgr:
        for _ in range(2):
            train(state, rank)
            mgr.save(state["step"], state)
            saved[state["step"]] = full(state)
    # An existing store's layout: the writer before this change bundled every tensor
    # under the store's small_tensor (1 MiB), i.e. all of a rank's shards here.
    StepvaultWriter.bundle_below = 1 << 20
    try:
        stepvault.save(root, state, run="old", step=2)
    finally:
        del StepvaultWriter.bundle_below  # back to the class default
    for run, step in (("ft", 1), ("ft", 2), ("old", 2)):
        fresh = build(mesh)
        info = stepvault.restore(root, fresh, run=run, step=step)
        assert info.step == step and fresh["step"] == step, (run, info.step, fresh["step"])
        got = full(fresh)
        assert got.keys() == saved[step].keys(), (run, step, sorted(got))
        for k, v in saved[step].items():
            assert torch.equal(got[k], v), (run, step, k)
    if rank == 0:
        torch.save(saved[2], os.path.join(out, "saved2.pt"))


def task_one_rank(rank: int, world: int, root: str, out: str) -> None:
    """FSDP2 on a group of one rank (a job debugged with ``torchrun --nproc_per_node 1``):
    the default manager refuses its DTensors naming ``collective=True`` and keeps the
    store empty; ``collective=True`` saves twice, and a new state restores the newest,
    bitwise, and a plain process restores it too (out/one_rank.pt: what it saved)."""
    import pytest

    import stepvault
    from stepvault.errors import StepvaultError

    assert world == 1
    state = build(init_device_mesh("cpu", (1,)))
    train(state, rank)
    mgr = stepvault.CheckpointManager(root, "one", async_save=False)
    with mgr, pytest.raises(StepvaultError, match="collective=True"):
        mgr.save(1, state, force=True)
    # Refused at the restore too (it was only at the first due save, after training).
    mgr = stepvault.CheckpointManager(root, "one", async_save=False)
    with mgr, pytest.raises(StepvaultError, match="collective=True"):
        mgr.restore(state)
    assert stepvault.open(root).steps("one") == []
    with stepvault.CheckpointManager(root, "one", collective=True) as mgr:
        for _ in range(2):
            train(state, rank)
            mgr.save(state["step"], state, force=True)
        mgr.wait()
        saved = full(state)
        fresh = build(init_device_mesh("cpu", (1,)))
        info = mgr.restore(fresh)
    assert info is not None and info.step == 3 == fresh["step"], info
    got = full(fresh)
    assert got.keys() == saved.keys()
    assert all(torch.equal(got[k], v) for k, v in saved.items())
    torch.save(saved, os.path.join(out, "one_rank.pt"))


def run(rank: int, world: int, port: int, task: str, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        globals()[f"task_{task}"](rank, world, root, out)
        result = "ok"
    except BaseException as exc:  # reported to the parent through a file per rank
        result = f"error {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(result)
        dist.destroy_process_group()
    # As dist_workers.run: skip C++ static destructors (a joinable gloo thread can abort
    # the process at exit after the rank reported).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
