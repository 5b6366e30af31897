"""Helpers shared by the trainer-integration tests: damage a checkpoint, run an example,
kill it with SIGKILL in the middle of training and resume it."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

from helpers import flip_byte, object_path, wait_for_checkpoint

import stepvault

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: Tiny models run faster, and far steadier on a shared machine, on one intra-op thread.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def damage_newest(root, run: str) -> int:
    """Flip a byte in an object only the newest checkpoint of ``run`` uses; its step."""
    vault = stepvault.open(root)
    steps = vault.steps(run)
    newest = steps[-1]
    older = set()
    for step in steps[:-1]:
        older |= set(vault.manifest(run, step).objects)
    only = sorted(set(vault.manifest(run, newest).objects) - older)
    assert only, "the newest checkpoint shares every object with older ones"
    flip_byte(object_path(root, only[0]))
    return newest


def first_saves_asynchronous(root, run: str) -> dict[int, bool]:
    """``{step: whether its save only staged (asynchronous)}`` from the run's event log;
    a save due before the staging buffers were ready is written synchronously."""
    from stepvault.catalog.events import read_events
    from stepvault.store import Store

    events = read_events(Store.open(root), run)
    return {e["step"]: e["asynchronous"] for e in events if e["event"] == "save"}


def run_example(script: str, *args: str, timeout: float = 300) -> str:
    """Run ``examples/<script>`` to completion; its stdout (fails on a non-zero exit)."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def run_example_here(script: str, *args: str) -> str:
    """Run ``examples/<script>`` in this process (no second interpreter start-up, which
    costs seconds with these frameworks); its stdout."""
    argv = sys.argv
    out = io.StringIO()
    sys.argv = [str(EXAMPLES / script), *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


def kill_when_saved(
    script: str,
    root,
    run: str,
    *args: str,
    min_step: int,
    sig: int = signal.SIGKILL,
    exit_code: int | None = None,
    timeout: float = 240,
) -> list[int]:
    """Start the example, send it ``sig`` once ``run`` has a checkpoint at ``min_step`` or
    later, check its exit status (killed by ``sig``, or ``exit_code``); returns the
    committed steps after it ended."""
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        wait_for_checkpoint(proc, root, run, min_step=min_step, timeout=timeout, name=script)
        os.kill(proc.pid, sig)
        proc.wait(timeout=120)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == (-sig if exit_code is None else exit_code), err[-4000:]
    return stepvault.open(root).steps(run)
