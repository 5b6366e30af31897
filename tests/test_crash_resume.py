"""Real processes: SIGTERM (preemption notice) and SIGKILL (crash) during training."""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import final_digest, run_train_loop, start_train_loop, wait_for_line

import stepvault
from stepvault.catalog.events import read_events


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Digest of an uninterrupted run."""
    return final_digest(run_train_loop(tmp_path_factory.mktemp("ref"), "--steps", "40"))


def test_sigterm_saves_then_exits_and_resumes(tmp_path, reference):
    proc = start_train_loop(tmp_path, "--steps", "40", "--step-sleep", "0.05")
    wait_for_line(proc, "STEP 12")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err  # 128 + SIGTERM: the documented exit code
    steps = stepvault.open(tmp_path).steps("job")
    preempted_at = steps[-1]
    assert preempted_at % 5 != 0 or preempted_at > 12  # an extra checkpoint at the signal
    events = [e["event"] for e in read_events(stepvault.open(tmp_path).store, "job")]
    assert "exit_after_save" in events
    stdout = run_train_loop(tmp_path, "--steps", "40")
    assert f"RESUMED {preempted_at}" in stdout
    assert final_digest(stdout) == reference


def test_sigkill_during_async_save_resumes_from_previous_and_matches(tmp_path, reference):
    # Object writes are slowed so that the kill lands while a save is in flight.
    proc = start_train_loop(tmp_path, "--steps", "40", "--slow-writes", "0.3")
    line = wait_for_line(proc, "SAVE_START 15")
    assert line == "SAVE_START 15"
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    steps = stepvault.open(tmp_path).steps("job")
    # A save was in flight (objects written, manifest not): it never became visible.
    assert steps and steps[-1] in (5, 10)
    stdout = run_train_loop(tmp_path, "--steps", "40")
    assert f"RESUMED {steps[-1]}" in stdout
    assert final_digest(stdout) == reference
    assert stepvault.ops.verify(tmp_path, deep=True).ok
