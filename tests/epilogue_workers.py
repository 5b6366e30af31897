"""Rank tasks of tests/test_commit_epilogue.py (spawned on a gloo group; importable at
module level). Each rank writes "ok" or its traceback to ``out/rank<N>.txt``."""

from __future__ import annotations

import json
import warnings

import torch
from helpers import run_rank_task


def run(rank: int, world: int, port: int, task: str, root: str, out: str) -> None:
    run_rank_task(globals(), rank, world, port, task, root, out)


def _ddp_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optimizer": opt, "step": 0}


def _train(state: dict, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    loss = state["model"](torch.randn(4, 8, generator=g)).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["step"] = step


def task_light_under_group(rank, world, root, out):
    """A save policy that emits light saves, then ``stepvault.save(kind="light")``, both
    under the group: every save is written full, one warning in all."""
    import stepvault

    state = _ddp_state()
    kinds = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count what stepvault emits, not what the filter lets
        with stepvault.CheckpointManager(
            root, "m", save=stepvault.Every(steps=1, what="light"), lineage=False
        ) as mgr:
            for step in (1, 2):
                _train(state, step)
                handle = mgr.save(step, state, metrics={"loss": float(step)})
                assert handle is not None
                handle.result()
                kinds.append(handle.kind)
        _train(state, 3)
        info = stepvault.save(root, state, run="s", step=3, kind="light", lineage=False)
        kinds.append(info.kind)
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    ours = [w for w in ours if "light saves under a process group" in str(w.message)]
    (out / f"result{rank}.json").write_text(
        json.dumps({"kinds": kinds, "warnings": [str(w.message) for w in ours]})
    )


def task_save_into_delta_store(rank, world, root, out):
    """The state of ``r@3`` (in ``root/hot``) saved collectively straight into the xor
    cold tier's store (``root/cold``), where its chunks are delta objects."""
    import stepvault

    ck = stepvault.open(root / "hot").checkpoint("r", 3)
    same_state = {k: ck.tensor(k) for k in ck.tensor_names()}
    stepvault.save(root / "cold", {"state": same_state}, run="direct", step=1, collective=True)


def _fsdp(widths: tuple[int, ...], mesh, *, extra_buffer: bool = False) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        layers += [torch.nn.Linear(widths[i], widths[i + 1]), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    if extra_buffer:  # a key the checkpoint does not have
        model.register_buffer("temperature", torch.ones(1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
        for k, v in model.state_dict().items()
    }


def task_restore_mismatched_full(rank, world, root, out):
    """A single-process checkpoint (``root``, run ``f``: Linear 16-32-32-4 + AdamW) restored
    under the group into states it does not fit: refused, nothing changed."""
    from torch.distributed.device_mesh import init_device_mesh

    import stepvault
    from stepvault.distributed.full_checkpoint import restore_full_checkpoint
    from stepvault.errors import StateMismatchError
    from stepvault.store import Store

    mesh = init_device_mesh("cpu", (world,))
    both = ("stepvault.restore", "restore_full_checkpoint")
    cases = {
        "wrong shape": (_fsdp((16, 33, 32, 4), mesh), {}, both),
        "live entry missing from checkpoint": (_fsdp((16, 32, 32, 4), mesh), {"ema": 0.5}, both),
        # stepvault.restore goes through the restore planner's own check (distributed/restoring.py)
        "module key missing from checkpoint": (
            _fsdp((16, 32, 32, 4), mesh, extra_buffer=True),
            {},
            ("restore_full_checkpoint",),
        ),
    }
    store = Store.open(root)
    for what, (model, extra, entries) in cases.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = {"model": model, "optimizer": opt, "step": 0, **extra}
        for entry in entries:
            before = _full(model)
            try:
                if entry == "stepvault.restore":
                    stepvault.restore(root, state, run="f")
                else:
                    restore_full_checkpoint(store, state, "f", 3)
            except StateMismatchError as exc:
                assert "nothing was changed" in str(exc), exc
            else:
                raise AssertionError(f"{what}: {entry} restored a state it does not fit")
            after = _full(model)
            for k, v in before.items():
                assert torch.equal(after[k], v), (what, entry, k)
            assert not opt.state and state["step"] == 0, (what, entry)
    # The check passes a state that fits: the same function restores it, every rank
    # keeping its shards of the saved tensors.
    model = _fsdp((16, 32, 32, 4), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": opt, "step": 0}
    restore_full_checkpoint(store, state, "f", 3)
    expected = torch.load(root.parent / "expected.pt", weights_only=True)
    restored = _full(model)
    assert restored.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(restored[k], v), k
    assert state["step"] == 3 and len(opt.state) == len(list(model.parameters()))
