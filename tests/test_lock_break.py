"""A writer stopped while it holds the local disk's commit lock does not block the run.

On a local disk the lease's ``flock`` is held across "check the token, rename the
manifest". A writer frozen right there (SIGSTOP, a suspended VM) used to keep it, and the
writer taking the run over stopped after 30 s with a TimeoutError (found by the host
campaign, RELIABILITY.md). Now the taker breaks a lock held for seconds while the lease is
stale; the frozen writer, woken, checks its lock before the rename and writes nothing.

The main test is a user's run in real processes; the unit tests hold the lock from another
process and check who may break it, and that waiters and the woken holder see the break.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import test_lease_fence as lease_fence
import torch
from test_lease_fence import STALE, _line, _read_until, _start

from stepvault.core.restore import restore
from stepvault.core.write import save
from stepvault.errors import LockBrokenError
from stepvault.format import parse_manifest
from stepvault.manager.scope import fenced
from stepvault.store import Store, file_lock
from stepvault.store.lease import acquire_lease
from stepvault.store.local import LocalBackend

# The first writer of test_lease_fence, whose save of step 100 waits inside the commit
# lock instead of before it: the parent stops the process there, holding the flock.
_HELD_RENAME = """
make_visible = LocalBackend._make_visible
def held_rename(self, key, *args, **kwargs):
    if key.startswith("runs/r/checkpoints/"):
        print("IN-LOCK", flush=True)
        time.sleep(1.0)
    return make_visible(self, key, *args, **kwargs)
LocalBackend._make_visible = held_rename
"""
_first = lease_fence.FIRST_WRITER
_patch = _first[_first.index("# From here") : _first.index("handle = mgr.save(100")]
FROZEN_IN_THE_LOCK = _first.replace(_patch, _HELD_RENAME)
assert "held_rename" in FROZEN_IN_THE_LOCK and "slow_publish" not in FROZEN_IN_THE_LOCK


# The new owner of test_lease_fence, breaking a held lock after 0.5 s (the default waits 5 s).
NEW_OWNER = lease_fence.NEW_OWNER.replace(
    "options = ",
    "import stepvault.store.file_lock\nstepvault.store.file_lock.BREAK_AFTER = 0.5\noptions = ",
    1,
)
assert "BREAK_AFTER" in NEW_OWNER


@pytest.mark.slow
def test_a_writer_frozen_holding_the_commit_lock_is_taken_over_and_refused(tmp_path):
    root = tmp_path / "store"
    first = _start(FROZEN_IN_THE_LOCK, root)
    new = None
    try:
        before = _read_until(first, "IN-LOCK")
        os.kill(first.pid, signal.SIGSTOP)  # frozen inside the commit lock
        time.sleep(STALE + 0.5)  # its lease goes stale
        started = time.monotonic()
        new = _start(NEW_OWNER, root, stdin=subprocess.PIPE)
        owned = _read_until(new, "SAVED")
        # Took the run over without the 30 s lock timeout (interpreter start included).
        assert time.monotonic() - started < 25
        assert _line(owned, "RESUMED") == "RESUMED 3"
        os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
        lines = before + out.splitlines()
        assert "COMMITTED" not in lines and "SAVED-AFTER-LOSS" not in lines, lines
        refused = _line(lines, "REFUSED")
        assert "the commit of r@100 was refused" in refused
        assert f"pid {new.pid}" in refused and "Nothing was committed" in refused
        assert f"pid {new.pid}" in _line(lines, "LATER")
        new_out, new_err = new.communicate(input="\n", timeout=120)
        assert new.returncode == 0, new_err
        assert "CLOSED" in new_out
        assert "breaking the lock" in new_err  # the taker says what it did
    finally:
        for proc in (first, new):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()

    store = Store.open(root)
    assert store.list_steps("r") == [1, 2, 3, 4, 5, 6, 7]
    writers = {
        s: parse_manifest(store.read_manifest("r", s), "").metadata["writer"]
        for s in store.list_steps("r")
    }
    assert set(writers.values()) == {"first", "new"} and writers[4] == "new"
    live = {"model": torch.nn.Linear(256, 256), "step": -1}
    assert restore(store, live, run="r").step == 7
    assert not (root / "runs" / "r" / "checkpoints" / "100.json").exists()


# ---------------------------------------------------------------------------- unit tests
HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("HELD", flush=True)
time.sleep(120)
"""


@pytest.fixture
def held(tmp_path):
    """A local store whose lock of ``k`` another process holds (and never releases)."""
    backend = LocalBackend(tmp_path / "store")
    lock = backend._path("refs/leases/k") + ".lock"
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, lock], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "HELD"
        yield backend, lock
    finally:
        proc.kill()
        proc.wait()


def test_a_held_lock_is_broken_only_when_its_holder_is_known_stopped(held, monkeypatch):
    backend, lock = held
    monkeypatch.setattr(file_lock, "BREAK_AFTER", 0.2)
    asked = []

    def alive() -> bool:
        asked.append(time.monotonic())
        return False

    stuck = pytest.raises(TimeoutError, match="a stopped process holds it")
    with stuck, backend.exclusive("refs/leases/k", timeout=0.6, abandoned=alive):
        pass
    assert asked  # asked once the lock had been held for BREAK_AFTER
    # Without an `abandoned` rule (renewals, commits) a held lock is never broken.
    with pytest.raises(TimeoutError), backend.exclusive("refs/leases/k", timeout=0.4):
        pass
    before = os.stat(lock).st_ino
    with backend.exclusive("refs/leases/k", timeout=5, abandoned=lambda: True):
        assert os.stat(lock).st_ino != before  # a new lock file, locked by us
        backend.put_atomic("refs/leases/k", [b"new"])  # writes under it go through
    assert backend.read_bytes("refs/leases/k") == b"new"


def test_a_waiter_on_the_broken_lock_waits_for_the_breaker(held, monkeypatch):
    backend, _ = held
    monkeypatch.setattr(file_lock, "BREAK_AFTER", 0.2)
    other = LocalBackend(backend.root)  # its own fds: excluded by flock like a process
    inside: list[str] = []
    got = threading.Event()

    def wait_plainly() -> None:
        with other.exclusive("refs/leases/k", timeout=10):
            inside.append("waiter")
            got.set()

    waiter = threading.Thread(target=wait_plainly)
    waiter.start()
    time.sleep(0.1)  # the waiter is polling the old, held file
    with backend.exclusive("refs/leases/k", timeout=5, abandoned=lambda: True):
        inside.append("breaker")
        time.sleep(0.3)  # the waiter must notice the new file, and wait for it
        assert not got.is_set()
        inside.append("breaker done")
    waiter.join(timeout=10)
    assert inside == ["breaker", "breaker done", "waiter"]


def test_the_woken_holder_of_a_broken_lock_writes_nothing(tmp_path):
    """In one process, two backends stand for the frozen holder and the taker."""
    frozen = LocalBackend(tmp_path / "store")
    taker = LocalBackend(tmp_path / "store")
    frozen.put_atomic("runs/r/checkpoints/3.json", [b"old"])
    with frozen.exclusive("refs/leases/k"):
        lock = frozen._path("refs/leases/k") + ".lock"
        # What the taker does to a lock held by a stopped holder (its rule said so).
        fd = os.open(lock, os.O_RDWR)
        file_lock.break_lock(lock, fd)
        os.close(fd)
        with taker.exclusive("refs/leases/k", timeout=1):
            pass  # the taker holds the new lock at once
        with pytest.raises(LockBrokenError, match="nothing was written"):
            frozen.put_atomic("runs/r/checkpoints/3.json", [b"late"])
        with pytest.raises(LockBrokenError):
            frozen.delete("runs/r/checkpoints/3.json")
    assert frozen.read_bytes("runs/r/checkpoints/3.json") == b"old"
    assert not list((tmp_path / "store" / "tmp").glob("*"))  # no temporary file left


def test_a_commit_whose_lock_was_broken_by_a_failed_taker_says_so_and_can_retry(
    tmp_path, monkeypatch
):
    """The lock broken while the lease is still ours (the taker then failed): the commit
    is refused as a broken lock, not "exists", nothing is visible, and the next one works."""
    store = Store.open(tmp_path / "store", create=True)
    lease = fenced(acquire_lease(store, "r", stale_after=60))
    save(store, {"w": torch.arange(10.0)}, run="r", step=1)
    make_visible = LocalBackend._make_visible

    def broken_under(self, key, *args, **kwargs):
        if key.endswith("checkpoints/2.json"):
            for path, fd in self._locks.held().items():
                file_lock.break_lock(path, fd)  # what a taker does
        return make_visible(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, "_make_visible", broken_under)
    with pytest.raises(LockBrokenError, match="nothing was written"):
        save(store, {"w": torch.arange(20.0)}, run="r", step=2)
    assert Store.open(tmp_path / "store").list_steps("r") == [1]
    assert lease.lost is None  # still the run's writer: the next commit takes a new lock
    monkeypatch.setattr(LocalBackend, "_make_visible", make_visible)
    save(store, {"w": torch.arange(20.0)}, run="r", step=2)
    assert Store.open(tmp_path / "store").list_steps("r") == [1, 2]
    lease.release()
