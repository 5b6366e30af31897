"""Rank tasks for replication you can see (issue 33), run by ``replication_workers.run`` as
``"replica_visibility_workers:TASK"``: each rank simulates its node there."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from manager_replication_workers import _manager

from stepvault.catalog.events import read_events


def _groups() -> int:
    """Process groups alive in this process (the default one included)."""
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


def _report(out: Path, name: str, rank: int, doc: object) -> None:
    (out / f"{name}{rank}.json").write_text(json.dumps(doc, default=str))


def task_visible(rank, world, mem, out, arg):
    """torchrun's layout on simulated nodes: each node's one rank keeps the launcher's
    LOCAL_RANK (0 on n0, 1 on n1). Saves 1 and 2 go to memory only and are replicated;
    ``wait(replicated=True)`` says so on every rank; close destroys the groups the manager
    made. A second manager whose rank 1 has no room in memory saves step 3 to disk."""
    os.environ["LOCAL_RANK"] = str(rank)
    before = _groups()
    mgr = _manager(mem, out)
    state = {"w": torch.zeros(4096)}
    for step in (1, 2):
        state["w"].add_(1.0)
        mgr.save(step, state, force=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.wait(replicated=True)
    stats = mgr.stats()["replication"]
    during = _groups()
    state["w"].add_(1.0)
    mgr.save(3, state, force=True)  # due on disk: close removes the memory
    mgr.close()
    after_first = _groups()
    mgr = _manager(mem, out, budget=4096 if rank == 1 else "1GB")
    state["w"].add_(1.0)
    mgr.save(4, state, force=True)  # rank 1 has no room: every rank writes it to disk
    mgr.close()
    _report(
        out,
        "visible",
        rank,
        {
            "stats": stats,
            "warnings": [str(w.message) for w in caught if "stepvault" in str(w.message)],
            "groups": [before, during, after_first, _groups()],
        },
    )


def task_solo(rank, world, mem, out, arg):
    """A forgotten STEPVAULT_NODE: every rank reports one node, so nobody has a buddy."""
    os.environ["STEPVAULT_NODE"] = "solo"
    with warnings.catch_warnings(record=True) as made:
        warnings.simplefilter("always")
        mgr = _manager(mem, out)
    mgr.save(1, {"w": torch.ones(16)}, force=True)
    with warnings.catch_warnings(record=True) as waited:
        warnings.simplefilter("always")
        mgr.wait(replicated=True)
    stats = mgr.stats()["replication"]
    mgr.save(3, {"w": torch.ones(16)}, force=True)  # on disk: close cleans up
    mgr.close()
    dist.barrier()
    events = [e for e in read_events(mgr.store, "r") if e["event"] == "replica_no_buddy"]
    _report(
        out,
        "solo",
        rank,
        {
            "made": [str(w.message) for w in made if "stepvault" in str(w.message)],
            "waited": [str(w.message) for w in waited if "stepvault" in str(w.message)],
            "stats": stats,
            "events": events,
        },
    )
