"""examples/plain_loop.py: SIGKILLed mid-epoch and mid-accumulation-window, it resumes and
ends bitwise equal (weights, optimizer, scaler, data order, RNG) to an uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import stepvault

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plain_loop.py"
BATCHES_PER_EPOCH, ACCUM, TOTAL = 12, 3, 36  # the example's defaults: 48 samples, batch 4


def run_example(store, *extra, expect_kill=False):
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    res = subprocess.run(
        [sys.executable, str(EXAMPLE), "--store", str(store), *map(str, extra)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    if expect_kill:
        assert res.returncode == -9, (res.returncode, res.stdout, res.stderr)  # SIGKILL
    else:
        assert res.returncode == 0, (res.stdout, res.stderr)
    return res.stdout


def assert_same(a, b, path="state"):
    """Deep equality; tensors and arrays compared byte for byte."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def final_state(store):
    return stepvault.open(store).checkpoint("plain", TOTAL).load()


def resumed_step(out):
    m = re.search(r"RESUMED step=(\d+) epoch=(\d+) batch=(\d+)/12 window=(\d)/3", out)
    assert m, out
    step, epoch, batch, window = map(int, m.groups())
    assert (epoch, batch, window) == (step // 12, step % 12, step % 3)
    return step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    store = tmp_path_factory.mktemp("plain") / "ref"
    out = run_example(store)
    assert "FRESH" in out and f"FINAL step={TOTAL}" in out
    return store, out.strip().splitlines()[-1]


def test_killed_mid_epoch_and_mid_window_resumes_bitwise(uninterrupted, tmp_path):
    ref_store, ref_final = uninterrupted
    store = tmp_path / "killed"
    out = run_example(store, "--kill-at", 17, expect_kill=True)
    assert "KILLED step=17" in out and "FINAL" not in out
    # Saves land at 7 and 14: mid-epoch and mid-window. The one at 14 may still have been
    # in flight (asynchronous) when the process died; then 7 is the newest committed (the
    # save at 14 waited for it).
    committed = stepvault.open(store).steps("plain")
    assert committed and set(committed) <= {7, 14}
    # The checkpoint to resume from really carries a half-accumulated window and a
    # mid-epoch loader position.
    newest = stepvault.open(store).checkpoint("plain", committed[-1]).load()
    assert newest["grads"], "a mid-window checkpoint must hold the accumulated grads"
    assert newest["loader"]["_num_yielded"] == committed[-1] % BATCHES_PER_EPOCH

    out = run_example(store)
    step = resumed_step(out)
    assert step == committed[-1] and step % BATCHES_PER_EPOCH and step % ACCUM
    assert out.strip().splitlines()[-1] == ref_final

    ref, got = final_state(ref_store), final_state(store)
    assert list(got) == [
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "grads",
        "loader",
        "rng",
        "progress",
    ]
    assert got["progress"]["skipped_updates"] > 0, "the GradScaler never skipped a step"
    assert_same(ref, got)


@pytest.mark.slow
def test_killed_twice_then_synchronous_resume_bitwise(uninterrupted, tmp_path):
    ref_store, ref_final = uninterrupted
    store = tmp_path / "twice"
    run_example(store, "--kill-at", 10, "--sync", expect_kill=True)
    assert resumed_step(run_example(store, "--kill-at", 30, expect_kill=True)) == 7
    out = run_example(store, "--sync")
    assert resumed_step(out) in (21, 28)
    assert out.strip().splitlines()[-1] == ref_final
    assert_same(final_state(ref_store), final_state(store))
