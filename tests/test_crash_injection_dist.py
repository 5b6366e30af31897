"""Crash injection for multi-rank jobs: SIGKILL a 2-rank FSDP2 job at random instants.

Each trial launches a real ``torchrun`` job (gloo on CPU, sharded asynchronous saves through
a collective ``CheckpointManager``, a keep policy with immediate GC, slowed object writes)
and kills it at a random moment: even seeds kill the whole job at once (a node lost), odd
seeds kill rank 1 only and let the launcher tear the rest down (one process lost). Then the
store must deep-verify, the next job must resume from the newest committed checkpoint, and
its final parameters and optimizer state must be bitwise those of an uninterrupted job.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import final_digest

import stepvault

SCRIPT = Path(__file__).parent / "scripts" / "train_loop_dist.py"
ARGS = ["--steps", "72", "--save-every", "3", "--slow-writes", "0.05"]  # ~4 s of training: the
# kill comes within 1.5 s of the first step, well before the end (36 steps, ~2 s, once
# finished first on a quiet machine: saves got cheaper)

pytestmark = pytest.mark.slow


def _launch(root: Path, pid_dir: Path | None = None, **kw) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(SCRIPT), "--store", str(root), *ARGS]
    return cmd + (["--pid-dir", str(pid_dir)] if pid_dir else [])


def _run(root: Path) -> str:
    out = subprocess.run(_launch(root), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return final_digest(_run(tmp_path_factory.mktemp("ref") / "store"))


# One seed in CI's slow run, three more with -m extended (CI's 30 minutes on 2 cores).
@pytest.mark.parametrize(
    "seed",
    [2000, *(pytest.param(s, marks=pytest.mark.extended) for s in (2001, 2002, 2003))],
)
def test_multi_rank_job_killed_at_random_instants(tmp_path, reference, seed):
    rng = random.Random(seed)
    root, pids = tmp_path / "store", tmp_path / "pids"
    pids.mkdir()
    proc = subprocess.Popen(
        _launch(root, pids),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group: killpg takes the whole job
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # training runs (imports and rendezvous are done)
            line = proc.stdout.readline()
            if line.startswith(("FRESH", "RESUMED")) or not line:
                break
        time.sleep(rng.uniform(0.0, 1.5))
        if seed % 2 == 0:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(int((pids / "rank1.pid").read_text()), signal.SIGKILL)
        rest = proc.communicate(timeout=120)[0]
        assert "FINAL" not in rest, "the job finished before the kill: the trial tested nothing"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(0.5)  # odd seeds: the launcher's SIGTERM to rank 0 has landed
    committed = stepvault.open(root).steps("job") if (root / "stepvault.json").exists() else []
    if committed:
        report = stepvault.ops.verify(root, deep=True)
        assert report.ok, report.to_json()
    out = _run(root)
    assert (f"RESUMED {committed[-1]}" if committed else "FRESH") in out
    assert final_digest(out) == reference
    assert stepvault.ops.verify(root, deep=True).ok
