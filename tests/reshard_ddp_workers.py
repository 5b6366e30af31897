"""Workers of tests/test_reshard_ddp.py (spawned; importable at module level): a 2-rank
FSDP2 job saves collectively, then a DDP job of the same model restores that checkpoint on
every rank through rank-local readers (the FSDP -> DDP layout change)."""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

RUN = "fsdp"


def run(rank: int, world: int, port: int, task: str, root: str, out: str) -> None:
    """Join a gloo group, run ``task_<task>``, report ``ok`` or the traceback per rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=180))
    try:
        globals()[f"task_{task}"](rank, world, root, out)
        result = "ok"
    except BaseException as exc:
        result = f"error {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(result)
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see tests/dist_workers.py: no C++ static destructors after the report


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _state(model: torch.nn.Module) -> dict:
    import stepvault

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, 2),
        "rng": stepvault.RNGState(),
        "step": 0,
    }


def _train(state: dict, module: torch.nn.Module) -> None:
    """One step; the data depends on the step only (every rank, every layout alike)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + state["step"]))
    loss = module(x).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["scheduler"].step()
    state["step"] += 1


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Full weights and optimizer state by name (collective for FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(model, opt, options=opts)
    flat = {f"model.{k}": v.clone() for k, v in msd.items()}
    for name, st in osd["state"].items():
        for k, v in st.items():
            flat[f"opt.{name}.{k}"] = torch.as_tensor(v).clone()
    flat["lr"] = torch.tensor([g["lr"] for g in opt.param_groups])
    return flat


def task_fsdp_save(rank, world, root, out):
    """FSDP2 on 2 ranks, a collective manager: saves at 1, 2, 3. After the save of 2 it
    records the full state and each rank's next RNG draw."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import stepvault

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = _state(model)
    torch.manual_seed(10 + rank)  # every rank's RNG its own
    with stepvault.CheckpointManager(root, RUN, async_save=False) as mgr:
        for step in (1, 2, 3):
            _train(state, model)
            mgr.save(step, state)
            if step == 2:
                full = _full(model, state["optimizer"])  # collective
                if rank == 0:
                    torch.save(full, os.path.join(out, "saved2.pt"))
                torch.save(torch.rand(4), os.path.join(out, f"draw{rank}.pt"))


def task_ddp_resume(rank, world, root, out):
    """DDP on ``world`` ranks resumes the FSDP2 run: rank 0 through a rank-local manager
    (what Lightning and the HF Trainer hold), the others through ``stepvault.restore``
    with ``collective=False``. No rank takes part in another's read."""
    import stepvault

    torch.manual_seed(1)  # other initial weights than the FSDP job's
    module = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    state = _state(module)
    torch.manual_seed(50 + rank)
    if rank == 0:
        mgr = stepvault.CheckpointManager(root, RUN, collective=False, async_save=False)
        info = mgr.restore(state)
    else:
        info = stepvault.restore(root, state, run=RUN, collective=False)
    assert info is not None
    torch.save(
        {
            "step": info.step,
            "skipped": [k.step for k in info.skipped],
            "state_step": state["step"],
            "full": _full(module, state["optimizer"]),
            "draw": torch.rand(4),
        },
        os.path.join(out, f"resumed{rank}.pt"),
    )
    dist.barrier()
    for _ in range(2):  # DDP trains on from the restored state
        _train(state, ddp)
    if rank == 0:
        mgr.save(state["step"], state)
        mgr.close()
    dist.barrier()


def task_ddp_resume_wider(rank, world, root, out):
    """DDP on more ranks than the FSDP2 job had: every rank reads step 2 alone. Each gets
    the whole model and optimizer; a rank the checkpoint has no RNG state for keeps its
    own RNG and is warned."""
    import warnings

    import stepvault

    torch.manual_seed(1)
    module = _model()
    state = _state(module)
    torch.manual_seed(50 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = stepvault.restore(root, state, run=RUN, step=2, collective=False)
    assert info is not None and info.step == 2
    torch.save(
        {
            "full": _full(module, state["optimizer"]),
            "draw": torch.rand(4),
            "warnings": [str(w.message) for w in caught if "RNG" in str(w.message)],
        },
        os.path.join(out, f"wider{rank}.pt"),
    )
