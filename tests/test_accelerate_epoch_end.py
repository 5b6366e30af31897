"""Accelerate's stateful loader, checkpointed right after the last batch of an epoch.

The documented setup (``use_stateful_dataloader=True``, ``use_seedable_sampler=True``,
``loader.set_epoch(epoch)`` in a ``for batch in loader`` loop) saved, at the epoch's last
optimizer step, a loader state Accelerate had already marked finished: the resumed run
trained that epoch again from its first batch and its epoch counter stayed one behind.
Each run is a process of its own (tests/scripts/accelerate_epoch_end.py: 3 optimizer steps
an epoch, 3 epochs), SIGKILLed once the checkpoint is committed and resumed by a new one;
batches and final state are compared with an uninterrupted run, bitwise.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("torchdata.stateful_dataloader")

from integration_util import ENV

SCRIPT = Path(__file__).parent / "scripts" / "accelerate_epoch_end.py"
STEPS = "9"  # 3 epochs of 3 optimizer steps
#: the checkpoints resumed: step 3, the last optimizer step of epoch 0
CASES = {
    # saved inside the loop, right after the epoch's last optimizer step
    "at-step": ["--save", "at-step"],
    # saved once the loop has left the epoch and counted it (must stay a finished epoch)
    "epoch-end": ["--save", "epoch-end"],
}


def _start(d: Path, name: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--root", str(d / name), "--steps", STEPS, *args],
        cwd=d,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(proc: subprocess.Popen, *, killed: bool = False) -> dict[str, dict]:
    out, err = proc.communicate(timeout=240)
    if killed:
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
    else:
        assert proc.returncode == 0, err[-3000:]
    words = (line.split(" ", 1) for line in out.splitlines())
    return {w[0]: json.loads(w[1]) for w in words if w[0] in ("RESTORED", "FINAL")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{name: (RESTORED and FINAL of the resumed process, batches seen)}``, ``straight``
    for the uninterrupted run: the first processes run side by side, then the resumes."""
    d = tmp_path_factory.mktemp("acc-epoch-end")
    first = {"straight": _start(d, "straight", "--log", "straight.jsonl")}
    for name, args in CASES.items():
        first[name] = _start(d, name, "--log", f"{name}.jsonl", "--kill-at", "3", *args)
    done = {name: _lines(p, killed=name != "straight") for name, p in first.items()}
    resumed = {
        name: _start(d, name, "--log", f"{name}.jsonl", *args) for name, args in CASES.items()
    }
    done.update({name: _lines(p) for name, p in resumed.items()})
    return {name: (lines, (d / f"{name}.jsonl").read_text()) for name, lines in done.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_after_the_epochs_last_step_is_bitwise(runs, case):
    straight, straight_batches = runs["straight"]
    resumed, batches = runs[case]
    assert resumed["RESTORED"] == {"epoch": 0 if case == "at-step" else 1, "step": 3}
    # the batches of the killed process, then the resumed one's: the next epoch's first
    # batch comes next (not epoch 0's again), and the epoch counter follows
    assert batches.splitlines() == straight_batches.splitlines()
    assert len(batches.splitlines()) == 18
    assert resumed["FINAL"] == straight["FINAL"]  # epoch 3, weights, AdamW moments, RNG
