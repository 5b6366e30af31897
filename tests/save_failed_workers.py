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
