"""The save contract on 2 ranks (gloo, CPU): a collective CheckpointManager over a DDP
model and ``stepvault.save`` under the group.

Spawned by tests/test_save_contract.py (through ``helpers.spawn_ranks``); must be
importable at module level. Each rank writes "ok" or its traceback to
``out/rank<N>.txt`` and what it saw to ``out/result<N>.json``; the parent process checks
the store (summary rows, object lists, parents, events, bases) after the ranks are gone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from helpers import run_rank_task


def run(rank: int, world: int, port: int, task: str, root: str, out: str) -> None:
    run_rank_task(globals(), rank, world, port, task, root, out)


def build(seed: int = 0) -> dict[str, Any]:
    """A DDP-replicated Linear with an SGD optimizer (momentum: state to save)."""
    torch.manual_seed(seed)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optimizer": opt, "step": 0}


def train(state: dict[str, Any], step: int) -> None:
    g = torch.Generator().manual_seed(step)
    loss = state["model"](torch.randn(4, 8, generator=g)).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["step"] = step


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """The bytes that must come back: weights, momentum buffers, the step."""
    opt = state["optimizer"].state_dict()["state"]
    return {
        "weight": state["model"].module.weight.detach().clone(),
        "bias": state["model"].module.bias.detach().clone(),
        "momentum": {k: v["momentum_buffer"].clone() for k, v in opt.items()},
        "step": state["step"],
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["weight"], b["weight"])
        and torch.equal(a["bias"], b["bias"])
        and a["momentum"].keys() == b["momentum"].keys()
        and all(torch.equal(a["momentum"][k], b["momentum"][k]) for k in a["momentum"])
        and a["step"] == b["step"]
    )


def _failed(*calls) -> dict[str, Any] | None:
    """How the first of ``calls`` that raised failed: which call, the exception's type,
    whether it names the value, the ranks it names; None when none raised. (DCP's
    CheckpointException is a BaseException: caught too, it is part of what is checked.)"""
    for at, call in enumerate(calls):
        try:
            call()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            return {
                "at": at,
                "type": type(exc).__name__,
                "names_value": "['bad']" in str(exc),
                "names_ranks": [r for r in range(2) if f"rank {r}:" in str(exc)],
            }
    return None


def task_contract(rank: int, world: int, root: Path, out: Path) -> None:
    """Run ``m``: 3 saves through a collective manager (asynchronous DCP saves), then a
    save of a state with a value that cannot be encoded. Run ``s``: the same through
    ``stepvault.save``. Every earlier checkpoint of both is then restored on every rank
    and compared bitwise. Then both entry points save the state of ``r@3`` (in
    ``root/hot``) straight into the xor cold tier's store (``root/cold``)."""
    import stepvault

    store = root / "store"
    results: dict[str, Any] = {"pid": os.getpid()}
    expected: dict[str, dict[int, dict[str, Any]]] = {"m": {}, "s": {}}

    state = build()
    with stepvault.CheckpointManager(store, "m", lineage=False) as mgr:
        for step in (1, 2, 3):
            train(state, step)
            mgr.save(step, state, force=True, metadata={"entry": "m", "step": step})
            expected["m"][step] = snapshot(state)
        mgr.wait()
        bad = {**state, "bad": object()}  # to be refused at save(), before a byte is written
        results["m_failed"] = _failed(lambda: mgr.save(4, bad, force=True), mgr.wait)
    dist.barrier()

    state = build(seed=1)
    for step in (1, 2, 3):
        train(state, step)
        meta = {"entry": "s", "step": step}
        stepvault.save(store, state, run="s", step=step, lineage=False, metadata=meta)
        expected["s"][step] = snapshot(state)
    bad = {**state, "bad": object()}
    results["s_failed"] = _failed(lambda: stepvault.save(store, bad, run="s", step=4))
    # A value only rank 1 holds: refused on every rank alike (no rank left waiting in DCP).
    only_one = bad if rank == 1 else state
    results["s_failed_on_rank1"] = _failed(lambda: stepvault.save(store, only_one, run="s", step=4))
    dist.barrier()

    restored: dict[str, dict[str, bool]] = {}
    metadata: dict[str, dict[str, Any]] = {}
    for run_name, steps in expected.items():
        restored[run_name], metadata[run_name] = {}, {}
        for step, saved in steps.items():
            live = build(seed=9)
            info = stepvault.restore(store, live, run=run_name, step=step)
            ok = info is not None and info.step == step and same(snapshot(live), saved)
            restored[run_name][str(step)] = ok
            metadata[run_name][str(step)] = info.metadata if info is not None else None
    results["restored_bitwise"] = restored
    results["metadata"] = metadata

    # Straight into a store of xor delta objects: the same state as r@3, so every chunk is
    # one of r@3's deltas there, reused by content hash.
    ck = stepvault.open(root / "hot").checkpoint("r", 3)
    same_state = {k: ck.tensor(k) for k in ck.tensor_names()}
    with stepvault.CheckpointManager(root / "cold", "direct-m", lineage=False) as mgr:
        mgr.save(1, {"state": same_state}, force=True)
    stepvault.save(root / "cold", {"state": same_state}, run="direct-s", step=1, lineage=False)
    (out / f"result{rank}.json").write_text(json.dumps(results))
