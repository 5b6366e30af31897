"""Plain helpers shared by test modules (fixtures are in tests/conftest.py): tiny states,
comparing modules, and running ``tests/scripts/train_loop.py`` as a real training process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

#: A training process that checkpoints into ``--store`` and prints ``STEP n``, ``FRESH`` or
#: ``RESUMED n`` as it goes and ``FINAL <digest of the trained state>`` at the end.
TRAIN_LOOP = Path(__file__).parent / "scripts" / "train_loop.py"


# ------------------------------------------------------------------------ tiny states
def linear(seed: int = 0, in_features: int = 16, out_features: int = 4) -> torch.nn.Linear:
    """A ``Linear`` whose weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features)


def linear_state(seed: int = 0, width: int = 8, step: int | None = None) -> dict:
    """``{"model": a width x width Linear seeded by seed, "step": step}`` (``step``
    defaults to ``seed``, so states of different seeds differ in both)."""
    return {"model": linear(seed, width, width), "step": seed if step is None else step}


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two modules hold the same state-dict keys with bitwise-equal tensors."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------ the training-loop script
def run_train_loop(store, *args: str, timeout: float = 120) -> str:
    """Run the training script on ``store`` to completion; its stdout (fails on a non-zero
    exit, with its stderr)."""
    out = subprocess.run(
        [sys.executable, str(TRAIN_LOOP), "--store", str(store), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def start_train_loop(store, *args: str) -> subprocess.Popen:
    """Start the training script on ``store``; stdout and stderr are pipes."""
    return subprocess.Popen(
        [sys.executable, str(TRAIN_LOOP), "--store", str(store), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    """Read ``proc``'s stdout up to the first line starting with ``prefix``; that line.
    Kills ``proc`` and fails with its stderr when no such line comes in time."""
    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    raise AssertionError(f"no {prefix!r} from the child; stderr: {proc.stderr.read()}")


def final_digest(stdout: str) -> str:
    """The digest on a training script's ``FINAL <digest>`` line."""
    return next(line.split()[1] for line in stdout.splitlines() if line.startswith("FINAL"))
