"""The restore contract on 2 ranks (gloo, CPU): a collective CheckpointManager over DDP.

Spawned by tests/test_restore_contract.py; must be importable at module level.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from helpers import run_rank_task


def run(rank: int, world: int, port: int, task: str, root: str, out: str) -> None:
    run_rank_task(globals(), rank, world, port, task, root, out)


def build(out_features: int = 4, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, out_features))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optimizer": opt, "step": 0}


def train(state: dict, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    loss = state["model"](torch.randn(4, 8, generator=g)).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["step"] = step


def damage_newest(root: str, run: str) -> int:
    """Flip a byte in an object only the newest checkpoint of ``run`` names; its step."""
    import stepvault

    vault = stepvault.open(root)
    steps = vault.steps(run)
    older: set[str] = set()
    for step in steps[:-1]:
        older |= set(vault.manifest(run, step).objects)
    only = sorted(set(vault.manifest(run, steps[-1]).objects) - older)
    path = os.path.join(root, "objects", only[0][:2], only[0])
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(bytes(data))
    return steps[-1]


def _count_parses(label: str) -> tuple[list[int], object]:
    """Count ``parse_manifest`` calls for ``label`` wherever stepvault bound it."""
    import stepvault.format.manifest as fm

    original = fm.parse_manifest
    count = [0]

    def counting(data, what="manifest", *a, **k):
        if what == label:
            count[0] += 1
        return original(data, what, *a, **k)

    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("stepvault") and getattr(module, "parse_manifest", None) is original:
            patched.append(module)
            module.parse_manifest = counting  # type: ignore[attr-defined]

    def undo() -> None:
        for module in patched:
            module.parse_manifest = original  # type: ignore[attr-defined]

    return count, undo


def _snapshot(state: dict) -> dict:
    return {
        "weight": state["model"].module.weight.detach().clone(),
        "opt": json.dumps(
            {
                str(k): {n: v.tolist() for n, v in s.items() if isinstance(v, torch.Tensor)}
                for k, s in state["optimizer"].state_dict()["state"].items()
            }
        ),
        "step": state["step"],
    }


def task_contract(rank, world, root, out):
    """(c) fresh start, then saves; the measured restore (one parse of the chosen manifest
    per rank, one broadcast of the candidates); (a) fallback past damage; (b) a mismatch
    refused on every rank with nothing changed."""
    import stepvault

    results: dict = {}
    # (c) a fresh start on an empty store
    state = build()
    with stepvault.CheckpointManager(root, "c", keep=stepvault.KeepLast(5)) as mgr:
        results["fresh"] = mgr.restore(state)
        for step in (1, 2):
            train(state, step)
            mgr.save(step, state, force=True)
        mgr.wait()
        dist.barrier()
    expected = state["model"].module.weight.detach().clone()

    # the measured restore: chosen manifest parsed once per rank, candidates shared once
    fresh = build(seed=1)
    with stepvault.CheckpointManager(root, "c") as mgr:
        count, undo = _count_parses("c@2")
        broadcasts = [0]
        real_broadcast = dist.broadcast_object_list

        def counting_broadcast(*a, **k):
            broadcasts[0] += 1
            return real_broadcast(*a, **k)

        dist.broadcast_object_list = counting_broadcast
        try:
            info = mgr.restore(fresh)
        finally:
            dist.broadcast_object_list = real_broadcast
            undo()
    results["measured"] = {"step": info.step, "parses": count[0], "broadcasts": broadcasts[0]}
    results["restored_bitwise"] = bool(torch.equal(fresh["model"].module.weight, expected))

    # (a) the newest damaged: every rank falls back to step 1 and reports step 2 skipped
    dist.barrier()
    if rank == 0:
        damage_newest(root, "c")
    dist.barrier()
    again = build(seed=2)
    with stepvault.CheckpointManager(root, "c") as mgr:
        info = mgr.restore(again)
    results["fallback"] = {"step": info.step, "skipped": [k.step for k in info.skipped]}

    # (b) a live state that does not fit: refused on every rank, nothing changed
    wrong = build(out_features=5, seed=3)
    train(wrong, 9)  # the optimizer has state (momentum) to keep
    fresh_wrong = build(out_features=5, seed=4)  # an optimizer without state stays so
    for name, live in (("trained", wrong), ("fresh", fresh_wrong)):
        before = _snapshot(live)
        with stepvault.CheckpointManager(root, "c") as mgr:
            try:
                mgr.restore(live)
                raised = None
            except BaseException as exc:  # which one is part of the contract
                if isinstance(exc, KeyboardInterrupt):  # (DCP's errors are BaseExceptions)
                    raise
                raised = type(exc).__name__
        after = _snapshot(live)
        results[f"mismatch_{name}"] = {
            "raised": raised,
            "weight_same": bool(torch.equal(before["weight"], after["weight"])),
            "opt_same": before["opt"] == after["opt"],
            "opt_empty": not live["optimizer"].state,
            "step_same": before["step"] == after["step"],
        }
    results["fresh"] = results["fresh"] is None
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(results, f)
