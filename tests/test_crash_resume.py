"""Real processes: SIGTERM (preemption notice) and SIGKILL (crash) during training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stepvault
from stepvault.catalog.events import read_events

SCRIPT = Path(__file__).parent / "scripts" / "train_loop.py"


def _run(store, *args, timeout=120):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--store", str(store), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _final(stdout: str) -> str:
    return next(line.split()[1] for line in stdout.splitlines() if line.startswith("FINAL"))


def _start(store, *args):
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--store", str(store), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(proc, prefix: str, timeout: float = 60) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    raise AssertionError(f"no {prefix!r} from the child; stderr: {proc.stderr.read()}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Digest of an uninterrupted run."""
    return _final(_run(tmp_path_factory.mktemp("ref"), "--steps", "40"))


def test_sigterm_saves_then_exits_and_resumes(tmp_path, reference):
    proc = _start(tmp_path, "--steps", "40", "--step-sleep", "0.05")
    _wait_for(proc, "STEP 12")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err  # 128 + SIGTERM: the documented exit code
    steps = stepvault.open(tmp_path).steps("job")
    preempted_at = steps[-1]
    assert preempted_at % 5 != 0 or preempted_at > 12  # an extra checkpoint at the signal
    events = [e["event"] for e in read_events(stepvault.open(tmp_path).store, "job")]
    assert "exit_after_save" in events
    stdout = _run(tmp_path, "--steps", "40")
    assert f"RESUMED {preempted_at}" in stdout
    assert _final(stdout) == reference


def test_sigkill_during_async_save_resumes_from_previous_and_matches(tmp_path, reference):
    # Object writes are slowed so that the kill lands while a save is in flight.
    proc = _start(tmp_path, "--steps", "40", "--slow-writes", "0.3")
    line = _wait_for(proc, "SAVE_START 15")
    assert line == "SAVE_START 15"
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    steps = stepvault.open(tmp_path).steps("job")
    # A save was in flight (objects written, manifest not): it never became visible.
    assert steps and steps[-1] in (5, 10)
    stdout = _run(tmp_path, "--steps", "40")
    assert f"RESUMED {steps[-1]}" in stdout
    assert _final(stdout) == reference
    assert stepvault.verify(tmp_path, deep=True).ok
