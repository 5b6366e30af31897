"""Helpers for the multi-process (DDP, gloo on CPU) trainer-integration tests: launch a
2-process run, SIGKILL the whole job once it has a checkpoint, run it again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import wait_for_checkpoint

import stepvault

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: One intra-op thread per rank: two ranks share the machine's cores with other jobs.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(script: str | Path, *args: str, nproc: int = 2) -> list[str]:
    """The command line of ``script`` (a path, or a name in ``examples/``) under
    ``torch.distributed.run``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(EXAMPLES / script),
        *args,
    ]


def example(script: str, *args: str) -> list[str]:
    """The command line of ``examples/<script>`` (a script that starts its own ranks)."""
    return [sys.executable, str(EXAMPLES / script), *args]


def run_job(cmd: list[str], timeout: float = 240) -> str:
    """Run a multi-process job to completion; its stdout (fails on a non-zero exit)."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc.pid)  # no rank left waiting in a collective
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-6000:]
    return out


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc: torchrun starts each worker in a
    session of its own, so killing torchrun's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_job(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the job started as ``pid`` and to every process below it."""
    for victim in [pid, *_descendants(pid)]:  # all found first: orphans change parent
        try:
            os.kill(victim, sig)
        except ProcessLookupError:
            pass


def kill_job_when_saved(
    cmd: list[str],
    root,
    run: str,
    *,
    min_step: int,
    sig: int = signal.SIGKILL,
    main_only: bool = False,
    timeout: float = 240,
) -> tuple[list[int], int]:
    """Start the job, send ``sig`` to every process of it once ``run`` has a committed
    checkpoint at ``min_step`` or later (SIGKILL: a node lost mid-run; SIGTERM: a
    preemption notice, as schedulers send it to every process); ``main_only``: to the
    process started only. Returns the committed steps after it ended and its exit status."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        wait_for_checkpoint(proc, root, run, min_step=min_step, timeout=timeout, name="the job")
        victims = _descendants(proc.pid)
        if main_only:
            os.kill(proc.pid, sig)
        else:
            kill_job(proc.pid, sig)
        proc.wait(timeout=120)
        _wait_gone(victims)
        if proc.returncode == -signal.SIGABRT:  # rare, at exit: keep what it said
            err = proc.stderr.read()
            raise AssertionError(f"the job aborted (SIGABRT); its stderr ends:\n{err[-4000:]}")
    finally:
        if proc.poll() is None:
            kill_job(proc.pid)
            proc.wait()
        proc.stderr.close()
    return stepvault.open(root).steps(run), proc.returncode


def _wait_gone(pids: list[int], timeout: float = 30) -> None:
    """Until every process in ``pids`` has exited (a killed orphan is reaped by init)."""
    deadline = time.time() + timeout
    while any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in pids):
        assert time.time() < deadline, f"processes {pids} outlived SIGKILL"
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False
