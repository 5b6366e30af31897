"""``DeepSpeedCheckpointer.resume`` when no checkpoint of the run can be loaded: it raises,
and the run's event log says so (``restore_failed``, with the checkpoints it passed over),
as the manager's own restore does. One real DeepSpeed process (ZeRO-2, CPU, torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from helpers import flip_byte, object_path

import stepvault
from stepvault.catalog.events import read_events
from stepvault.store import Store

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_train.py"


def _run(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    args = ["--root", str(root), "--stage", "2", "--steps", "8", "--save-every", "4"]
    return subprocess.run(
        [*cmd, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=420
    )


@pytest.mark.slow
@pytest.mark.extended  # a framework job: outside CI's time budget (run with -m extended)
def test_deepspeed_resume_with_every_checkpoint_damaged_writes_restore_failed(tmp_path):
    root = tmp_path / "store"
    first = _run(root)
    assert first.returncode == 0 and "FRESH" in first.stdout, first.stderr[-3000:]
    steps = stepvault.open(root).steps("ds")
    assert steps == [4, 8]
    store = Store.open(root)
    vault = stepvault.open(root)
    for step in steps:  # one bit of an object only this checkpoint holds (its partition)
        other = {o for s in steps if s != step for o in vault.manifest("ds", s).objects}
        only = sorted(set(vault.manifest("ds", step).objects) - other)
        flip_byte(object_path(root, only[0]))

    again = _run(root)
    assert again.returncode != 0
    assert "NoValidCheckpointError" in again.stdout + again.stderr
    events = read_events(store, "ds")
    assert [e["event"] for e in events if e["event"].startswith("restore")] == [
        "restore",  # the first run's fresh start
        "restore_failed",
    ]
    failed = next(e for e in events if e["event"] == "restore_failed")
    assert failed["requested"] == "latest"
    assert "NoValidCheckpointError" in failed["error"]
    assert [s["step"] for s in failed["skipped"]] == [8, 4]
    assert all(s["reason"] for s in failed["skipped"])
