"""Rank tasks of tests/test_save_failed.py (spawned on a gloo group; importable at module
level). Each rank writes "ok" or its traceback to ``out/rank<N>.txt`` and its findings to
``out/result<N>.json``. The store is the S3 URL in ``STEPVAULT_TEST_S3_URL``, reached
through the test's fault proxy (``AWS_ENDPOINT_URL``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import run_rank_task


def run(rank: int, world: int, port: int, task: str, root: str, out: str) -> None:
    run_rank_task(globals(), rank, world, port, task, root, out)


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}


def task_upload_cut(rank: int, world: int, root: Path, out: Path) -> None:
    """Step 1 saved; then the proxy resets every object upload (``out/cut`` exists) and
    the save of step 2 fails; what each rank raised, what the store lists and what a
    restore gives are reported. Then the cut is lifted and step 2 is saved again."""
    import stepvault
    from stepvault.store import Store
    from stepvault.store.fsspec_backend import open_fsspec

    url = os.environ["STEPVAULT_TEST_S3_URL"]
    # Retries kept short (botocore 8 attempts x s3fs 3 by default: about two minutes).
    backend = open_fsspec(url, config_kwargs={"retries": {"max_attempts": 2, "mode": "standard"}})
    backend.fs.retries = 1
    if rank == 0:
        Store.open(backend, create=True)
    dist.barrier()
    result: dict = {}
    with stepvault.CheckpointManager(Store.open(backend), "r", lineage=False) as mgr:
        mgr.save(1, _state(1), force=True)
        mgr.wait()
        dist.barrier()
        if rank == 0:
            (out / "cut").touch()  # the link to the store's objects is cut from here on
        dist.barrier()
        try:
            mgr.save(2, _state(2), force=True)
            mgr.wait()
        except Exception as exc:  # not DCP's CheckpointException (a BaseException)
            result["error"] = {
                "type": type(exc).__name__,
                "message": str(exc),
                "step": getattr(exc, "step", None),
                "ranks": list(getattr(exc, "ranks", ())),
            }
        dist.barrier()
        result["listed"] = Store.open(url).list_steps("r")
        state = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
        info = stepvault.restore(url, state, run="r")
        result["restored"] = info.step
        result["bitwise"] = all(torch.equal(state[k], _state(1)[k]) for k in state)
        dist.barrier()
        if rank == 0:
            (out / "cut").unlink()  # the link is back
        dist.barrier()
        mgr.save(2, _state(2), force=True)  # the next save writes the whole state
        mgr.wait()
        result["events"] = [
            (e["event"], e.get("step")) for e in mgr.events() if e["event"].startswith("save")
        ]
    result["after"] = Store.open(url).list_steps("r")
    (out / f"result{rank}.json").write_text(json.dumps(result))


def _fill(path: Path) -> None:
    """Fill the filesystem of ``path`` to the last byte (a node's tmpfs run full)."""
    fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        size = 64 << 10
        while size:
            try:
                os.write(fd, b"\0" * size)
            except OSError:
                size //= 2  # the last partial blocks too
    finally:
        os.close(fd)


def task_mem_full(rank: int, world: int, root: Path, out: Path) -> None:
    """A collective manager with a replicated mem tier, disk every 3rd save. Rank 1's node
    memory (a small tmpfs) runs full after step 2: the save of step 3 (due on disk too)
    still goes to disk; step 4 (due in memory only) fails on rank 1. The run's event log
    is then read by every rank."""
    import stepvault
    from stepvault.manager.options import MemOptions
    from stepvault.store import Store
    from stepvault.tiers import CopyEvery

    mem = Path(os.environ[f"STEPVAULT_TEST_MEM{rank}"])
    os.environ["STEPVAULT_MEM_ROOT"] = str(mem)  # this rank's node memory
    os.environ["STEPVAULT_NODE"] = f"node{rank}"
    mgr = stepvault.CheckpointManager(
        root / "hot",
        "r",
        tiers={"mem": MemOptions(budget="64MB", replicate=True)},
        tier_policy=CopyEvery("hot", steps=3),
        lineage=False,
    )
    result: dict = {}
    for step in (1, 2):
        mgr.save(step, _state(step), force=True)
        mgr.wait()
    dist.barrier()
    if rank == 1:
        _fill(mem)
    dist.barrier()
    mgr.save(3, _state(3), force=True)  # due on disk: it goes there
    mgr.wait()
    try:
        mgr.save(4, _state(4), force=True)  # due in memory only
        mgr.wait()
    except Exception as exc:
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    dist.barrier()
    result["events"] = [
        {k: e.get(k) for k in ("event", "step", "rank", "result", "tier")}
        for e in mgr.events()
        if e["event"] in ("mem_save_failed", "save", "save_failed")
    ]
    result["on_disk"] = Store.open(root / "hot").list_steps("r")
    (out / f"result{rank}.json").write_text(json.dumps(result))
