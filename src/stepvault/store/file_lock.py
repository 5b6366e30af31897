"""A lock between processes on a local file (``flock``) that a stopped holder cannot keep.

The writer lease's lock on local disks (:meth:`LocalBackend.exclusive
<.local.LocalBackend.exclusive>`, FORMAT.md §8). A live holder keeps it for microseconds;
one held for :data:`BREAK_AFTER` seconds while the caller's ``abandoned()`` rule says its
holder stopped (the lease it guards went stale: a frozen process or VM) is broken: its file
is removed and a new one locked. Every locker checks, once it has the lock, that the path
still names the file it locked; every rename or delete made under a lock checks it again
(:meth:`FileLocks.check`), so the stopped holder, woken, writes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator

from ..errors import LockBrokenError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

#: Seconds a lock file must be seen held, its lease stale, before it is broken. Live
#: holders keep it for microseconds (a takeover's listing: milliseconds).
BREAK_AFTER = 5.0


class FileLocks:
    """The ``flock`` locks of one store: taken by :meth:`hold`, checked by :meth:`check`."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        # One lock per path within this process too: over NFS, flock is emulated with POSIX
        # locks, which do not exclude threads of one process from each other.
        self._in_process: dict[str, threading.Lock] = {}
        self._thread = threading.local()  # the locks this thread holds: path -> fd

    @contextlib.contextmanager
    def hold(
        self, path: str, name: str, timeout: float, abandoned: Callable[[], bool] | None
    ) -> Iterator[None]:
        """Hold the lock file ``path`` (``name``: what errors call it) while the block runs."""
        with self._mutex:
            local = self._in_process.setdefault(path, threading.Lock())
        if not local.acquire(timeout=timeout):
            raise TimeoutError(f"{name}: lock held by another thread of this process")
        try:
            fd = _lock(path, name, timeout, abandoned)
            held = self.held()
            held[path] = fd
            try:
                yield
            finally:
                del held[path]
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        finally:
            local.release()

    def held(self) -> dict[str, int]:
        """The locks the calling thread holds (path -> fd)."""
        held: dict[str, int] | None = getattr(self._thread, "locks", None)
        if held is None:
            held = self._thread.locks = {}
        return held

    def check(self) -> None:
        """Raise :class:`LockBrokenError` if a lock this thread holds was broken."""
        for path, fd in self.held().items():
            if not _names(path, fd):
                raise LockBrokenError(
                    f"{path}: this process's lock was broken by another process while it "
                    "held it (it found this process stopped past the lease's stale_after "
                    "and took the run over); nothing was written. If this writer still holds "
                    "the run's lease (the takeover failed), save again: the next commit "
                    "takes a new lock; otherwise stop this writer"
                )


def _lock(path: str, name: str, timeout: float, abandoned: Callable[[], bool] | None) -> int:
    """An fd of ``path`` holding its ``flock``, ``path`` still naming that file."""
    start = time.monotonic()
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
        try:
            if _wait(fd, path, name, start, timeout, abandoned):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # replaced or broken: drop it (and its lock) and open the new file


def _wait(
    fd: int,
    path: str,
    name: str,
    start: float,
    timeout: float,
    abandoned: Callable[[], bool] | None,
) -> bool:
    """Lock ``fd``: True once locked while ``path`` still names it; False when ``path``
    names another file now (a breaker replaced it, or this call broke it)."""
    # Counted per lock file: a new one (just made by a breaker) is not broken at once
    # because the one before it was held long.
    seen = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            return _names(path, fd)
        if not _names(path, fd):
            return False
        now = time.monotonic()
        if now - seen > BREAK_AFTER and abandoned is not None and abandoned():
            break_lock(path, fd)
            return False
        if now - start > timeout:
            raise TimeoutError(
                errno.ETIMEDOUT,
                f"{name}: locked by another process for more than {timeout:.0f}s (a stopped "
                "process holds it?); retry later",
            )
        # Held for microseconds by a live holder; held longer only by a process stopped
        # inside its critical section (SIGSTOP, a frozen VM).
        time.sleep(0.005)


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev)


def break_lock(path: str, fd: int) -> None:
    """Remove the lock file ``fd`` waits on, unless another breaker did already.

    Breakers exclude each other with ``<path>.break`` (held for one stat and one unlink),
    so none removes a lock file that another breaker has just made and locked. A breaker
    stopped while it holds that (for microseconds) only delays the others: they go on
    waiting for the lock, up to their timeout.
    """
    guard = os.open(path + ".break", os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        try:
            if _names(path, fd):
                os.unlink(path)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
    finally:
        os.close(guard)
