"""Helpers for the sharded framework jobs of tests/test_sharded_preemption.py,
test_sharded_faults.py and test_sharded_reshard.py: preempt a running job with SIGTERM and
read back the exit status of every rank process.

A rank under torchrun is torchrun's child, not the test's, so the test cannot ``wait`` for
it. It holds a pidfd of each rank instead, opened while the rank runs, and asks the kernel
for the rank's exit status once torchrun has reaped it (``PIDFD_GET_INFO`` with
``PIDFD_INFO_EXIT``, Linux 6.15 and later). On older kernels the statuses are None and
the tests say so (``exit_statuses_readable``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddp_util import ENV, _descendants, _wait_gone, kill_job

import stepvault
from stepvault.errors import StepvaultError

#: ``_IOWR(PIDFS_IOCTL_MAGIC=0xFF, 11, struct pidfd_info)`` with the 64-byte first version
_PIDFD_GET_INFO = 0xC040FF0B
_PIDFD_INFO_EXIT = 1 << 3
_EXIT_CODE_OFFSET = 60  # mask u64, cgroupid u64, 11 x u32 ids, then exit_code s32


def _exit_status(pidfd: int) -> int | None:
    """The exit code of the (reaped) process behind ``pidfd`` as ``Popen.returncode``
    gives it (negative: killed by that signal); None where the kernel cannot say."""
    buf = bytearray(64)
    struct.pack_into("Q", buf, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf)
    except OSError:
        return None
    if not struct.unpack_from("Q", buf, 0)[0] & _PIDFD_INFO_EXIT:
        return None
    return os.waitstatus_to_exitcode(struct.unpack_from("i", buf, _EXIT_CODE_OFFSET)[0])


def _reaped_status(pid: int, pidfd: int, timeout: float = 30) -> int | None:
    """:func:`_exit_status` once the process is reaped. A rank whose parent exited first
    (Lightning's rank 1 after rank 0) is re-parented to this process (a child subreaper
    while :func:`preempt_job` runs), which reaps it here."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(ChildProcessError):  # not (or no longer) this one's child
            got, status = os.waitpid(pid, os.WNOHANG)
            if got == pid:
                return os.waitstatus_to_exitcode(status)
        status = _exit_status(pidfd)
        if status is not None:
            return status
        time.sleep(0.1)
    return None


def _subreaper(on: bool) -> None:
    """Make this process the parent of orphans below it (``PR_SET_CHILD_SUBREAPER``)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)


def exit_statuses_readable() -> bool:
    """Whether this kernel reports a non-child's exit status through its pidfd."""
    proc = subprocess.Popen(["sleep", "0.01"])
    fd = os.pidfd_open(proc.pid)
    try:
        proc.wait()
        return _exit_status(fd) == 0
    finally:
        os.close(fd)


def _cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]
    return []


def rank_processes(pid: int, script: str | Path) -> list[int]:
    """The processes of the job started as ``pid`` that run ``script`` itself: torchrun's
    workers, or Lightning's launcher process and the ranks it started (not torchrun nor
    ``accelerate launch``, whose command lines name the script after the launcher's)."""
    script = str(script)
    found = []
    for p in [pid, *_descendants(pid)]:
        args = _cmdline(p)
        if script not in args:
            continue
        before = set(args[: args.index(script)])  # the interpreter's and a launcher's own
        if not before & {"torch.distributed.run", "launch"}:  # torchrun, `accelerate launch`
            found.append(p)
    return found


@dataclass
class Preempted:
    """What a preempted job left: the steps committed when the signal was sent and after
    the job ended, the launcher's exit status, and every rank's (None: unreadable)."""

    before: list[int]
    after: list[int]
    launcher: int
    ranks: list[int | None] = field(default_factory=list)
    stderr: str = ""

    @property
    def new(self) -> list[int]:
        """The checkpoints committed after the signal was sent."""
        return [s for s in self.after if s not in self.before]


def _steps(root: str | Path, run: str) -> list[int]:
    try:
        return stepvault.open(root).steps(run)
    except StepvaultError:  # no store yet: no save committed
        return []


def preempt_job(
    cmd: list[str],
    root: str | Path,
    run: str,
    script: str | Path,
    *,
    min_step: int,
    nranks: int = 2,
    launcher_only: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> Preempted:
    """Start the job, wait until ``run`` has a committed checkpoint at ``min_step`` or
    later, then send SIGTERM as a scheduler does: to every process of the job (SLURM), or
    with ``launcher_only`` to the launcher alone (a container's PID 1; torchrun forwards it
    to its workers). Returns once every process of the job has exited."""
    _subreaper(True)
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
            env=env or ENV,
            start_new_session=True,
        )
        fds: list[int] = []
        try:
            deadline = time.time() + timeout
            while not (_steps(root, run) and _steps(root, run)[-1] >= min_step):
                if proc.poll() is not None:
                    err.seek(0)
                    raise AssertionError(f"the job ended before it was preempted: {err.read()}")
                assert time.time() < deadline, "the job wrote no checkpoint in time"
                time.sleep(0.05)
            ranks = rank_processes(proc.pid, script)
            assert len(ranks) == nranks, (ranks, [_cmdline(p) for p in _descendants(proc.pid)])
            fds = [os.pidfd_open(p) for p in ranks]
            before = _steps(root, run)
            victims = _descendants(proc.pid)
            if launcher_only:
                os.kill(proc.pid, signal.SIGTERM)
            else:
                kill_job(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout)
            _wait_gone(victims, timeout=60)
            statuses = [_reaped_status(p, fd) for p, fd in zip(ranks, fds, strict=True)]
            err.seek(0)
            return Preempted(before, _steps(root, run), proc.returncode, statuses, err.read())
        finally:
            _subreaper(False)
            for fd in fds:
                os.close(fd)
            if proc.poll() is None:
                kill_job(proc.pid)
                proc.wait()


def assert_preempted_once(
    job: Preempted, root: str | Path, run: str, *, every: int, code: int = 143
) -> int:
    """The preemption contract: one new collective checkpoint, at a step the ``Every``
    policy would not have saved, that verifies; every rank exited with ``code`` (the
    policy's); the run's log records the exit after that save. Returns its step."""
    assert len(job.new) == 1, (job.before, job.after, job.stderr[-4000:])
    step = job.new[0]
    assert step % every != 0 and step > job.before[-1], (job.before, step)
    vault = stepvault.open(root)
    assert vault.manifest(run, step).sharded  # every rank wrote its own shards
    report = stepvault.ops.verify(root, run=run, deep=True)
    assert report.ok, report
    if exit_statuses_readable():
        assert job.ranks == [code] * len(job.ranks), (job.ranks, job.stderr[-4000:])
    from stepvault.catalog.events import read_events
    from stepvault.store import Store

    exits = [e for e in read_events(Store.open(root), run) if e["event"] == "exit_after_save"]
    assert [(e["step"], e["exit_code"]) for e in exits] == [(step, code)], exits
    return step


def damage_rank1_shard(root: str | Path, run: str, step: int) -> str:
    """Flip one bit of an object that only rank 1 wrote in ``run@step``: a DeepSpeed file
    of rank 1 (``zero_pp_rank_1``), or else a tensor shard at a nonzero offset (FSDP2
    shards dim 0 across the ranks), in an object no other checkpoint uses. Returns the
    entry it damaged."""
    from helpers import flip_byte, object_path

    from stepvault.format import parse_manifest
    from stepvault.store import Store

    m = parse_manifest(Store.open(root).read_manifest(run, step), f"{run}@{step}")
    vault = stepvault.open(root)
    older: set[str] = set()
    for s in vault.steps(run):
        if s != step:
            older |= set(vault.manifest(run, s).objects)
    entries = m.sharded["entries"]
    tensors = [(fqn, e) for fqn, e in entries.items() if e["type"] == "tensor"]
    deepspeed = [(fqn, e) for fqn, e in tensors if "zero_pp_rank_1" in fqn]
    for fqn, entry in deepspeed or tensors:
        for shard in entry["shards"]:
            if not shard["chunks"]:
                continue  # an empty tensor (ZeRO-3 keeps some): no object to damage
            only_here = shard["chunks"][0][0] not in older  # a fallback must find it whole
            if only_here and (deepspeed or any(shard["offsets"])):
                flip_byte(object_path(root, shard["chunks"][0][0]))
                return fqn
    raise AssertionError(f"no object of rank 1 in {run}@{step}")
