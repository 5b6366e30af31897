"""A script that never closes its manager (or dies of an exception) still commits the
asynchronous save in flight when the interpreter exits, and releases the run's lease."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import stepvault
from stepvault.catalog.events import read_events
from stepvault.store import Store

SCRIPT = textwrap.dedent(
    """
    import sys, torch, stepvault
    from stepvault import CheckpointManager, Every
    model = torch.nn.Linear(512, 512)
    state = {"model": model, "step": 0}
    mgr = CheckpointManager(sys.argv[1], run="r", save=Every(steps=5), async_save=True)
    for step in range(1, 6):
        state["step"] = step
        handle = mgr.save(step, state)
    assert handle is not None and handle.asynchronous
    if sys.argv[2] == "raise":
        raise RuntimeError("the training loop failed")
    """
)


@pytest.mark.parametrize("ending", ["exit", "raise"])
def test_the_save_in_flight_is_committed_when_the_script_ends_without_close(
    tmp_path: Path, ending: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    root = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, str(script), str(root), ending],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == (1 if ending == "raise" else 0), proc.stderr
    assert "stepvault:" not in proc.stderr  # nothing failed at exit
    assert stepvault.open(root).steps("r") == [5]
    events = [e["event"] for e in read_events(Store.open(root), "r")]
    assert "save" in events and "save_failed" not in events, events
    # The lease was released: a new writer takes the run at once.
    with stepvault.CheckpointManager(root, "r", async_save=False) as mgr:
        assert mgr.restore({"model": torch.nn.Linear(512, 512), "step": 0})


def test_a_forked_dataloader_worker_never_closes_its_parents_manager(tmp_path: Path) -> None:
    """A forked child runs the interpreter's exit hooks when it ends: DataLoader workers
    closed the inherited manager and released the run's lease, so the next commit after an
    epoch raised LeaseLostError."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(
        TensorDataset(torch.arange(8.0)),
        batch_size=2,
        num_workers=2,
        multiprocessing_context="fork",
    )
    model = torch.nn.Linear(4, 4)
    with stepvault.CheckpointManager(tmp_path, "r", async_save=False) as mgr:
        step = 0
        for _ in range(2):  # the workers of each epoch exit at its end
            for _batch in loader:
                step += 1
            mgr.save(step, {"model": model})
    assert stepvault.open(tmp_path).steps("r") == [4, 8]
