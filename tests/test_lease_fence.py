"""The writer lease fences the commit: a writer that lost its run to another one (its lease
went stale while it was paused, then was taken over) commits nothing more.

The main test is a user's run: a writer process with an asynchronous save in flight is
stopped (SIGSTOP) past its lease's TTL, a second process takes the run over and saves, the
first is resumed (SIGCONT). Unit tests cover the lease (renewal is a compare-and-set) and
the store's fenced commit on local disks, ``memory://`` and S3 (moto).
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from stepvault import CheckpointManager
from stepvault.core.restore import restore
from stepvault.core.write import save
from stepvault.errors import LeaseHeldError, LeaseLostError
from stepvault.format import parse_manifest
from stepvault.manager.options import LeaseOptions, ManagerOptions
from stepvault.manager.scope import fenced
from stepvault.store import Store
from stepvault.store.fsspec_backend import open_fsspec
from stepvault.store.lease import acquire_lease, lease_key, read_lease

STALE = 2.0  # the writers' lease_stale_after: short, so the test pauses for seconds only


def state_of(step: int) -> dict:
    """The state of step ``step``: a Linear whose weights depend only on ``step`` (the
    parent and both writer processes agree on every step's bytes)."""
    gen = torch.Generator().manual_seed(step)
    model = torch.nn.Linear(256, 256)
    with torch.no_grad():
        model.weight.copy_(torch.randn(256, 256, generator=gen))
        model.bias.copy_(torch.randn(256, generator=gen))
    return {"model": model, "step": step}


STATE = "import torch\n\n" + inspect.getsource(state_of)

FIRST_WRITER = (
    STATE
    + """
import sys, time
from stepvault import CheckpointManager
from stepvault.errors import LeaseLostError
from stepvault.manager.options import LeaseOptions, ManagerOptions
from stepvault.store.local import LocalBackend

options = ManagerOptions(lease=LeaseOptions(stale_after=%(stale)r))
mgr = CheckpointManager(sys.argv[1], "r", async_save=True, options=options)
for step in (1, 2, 3):
    mgr.save(step, state_of(step), force=True, metadata={"writer": "first"})
mgr.wait()

# From here the background writer is slow to publish its objects: the next save is in
# flight (tensors staged, objects being written, manifest not committed) when the parent
# stops this process.
publish = LocalBackend.publish
def slow_publish(self, tokens):
    print("IN-FLIGHT", flush=True)
    time.sleep(10.0)  # wall clock: over by the time the process is resumed
    return publish(self, tokens)
LocalBackend.publish = slow_publish

handle = mgr.save(100, state_of(100), force=True, metadata={"writer": "first"})
print("RETURNED", handle.asynchronous, flush=True)
try:
    handle.result(timeout=120)
    print("COMMITTED", flush=True)
except LeaseLostError as exc:
    print("REFUSED", exc, flush=True)
try:
    mgr.save(101, state_of(101), force=True, metadata={"writer": "first"})
    print("SAVED-AFTER-LOSS", flush=True)
except LeaseLostError as exc:
    print("LATER", exc, flush=True)
try:
    mgr.close()
except LeaseLostError:
    pass  # the refused save's error, once more
print("DONE", flush=True)
"""
)

NEW_OWNER = (
    STATE
    + """
import os, sys
from stepvault import CheckpointManager
from stepvault.manager.options import LeaseOptions, ManagerOptions

options = ManagerOptions(lease=LeaseOptions(stale_after=%(stale)r))
with CheckpointManager(sys.argv[1], "r", async_save=True, options=options) as mgr:
    info = mgr.restore(state_of(0))
    print("RESUMED", info.step, flush=True)
    for step in range(4, 8):
        mgr.save(step, state_of(step), force=True, metadata={"writer": "new"})
    mgr.wait()
    print("SAVED", os.getpid(), flush=True)
    sys.stdin.readline()  # hold the run until the parent has seen the first writer refused
print("CLOSED", flush=True)
"""
)


def _start(script: str, root: Path, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", script % {"stale": STALE}, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kwargs,
    )


def _read_until(proc: subprocess.Popen, *prefixes: str, timeout: float = 120) -> list[str]:
    """Lines of ``proc``'s stdout up to the one that starts with each of ``prefixes``."""
    lines: list[str] = []
    wanted = set(prefixes)
    deadline = time.monotonic() + timeout
    while wanted:
        assert time.monotonic() < deadline, f"timed out waiting for {wanted}: {lines}"
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited early: {lines}\n{proc.stderr.read()}")
        lines.append(line.rstrip("\n"))
        wanted = {p for p in wanted if not line.startswith(p)}
    return lines


def _line(lines: list[str], prefix: str) -> str:
    found = [line for line in lines if line.startswith(prefix)]
    assert found, f"no {prefix!r} line in {lines}"
    return found[0]


@pytest.mark.slow
def test_a_writer_paused_past_its_lease_commits_nothing_over_the_new_owner(tmp_path):
    root = tmp_path / "store"
    first = _start(FIRST_WRITER, root)
    new = None
    try:
        before = _read_until(first, "IN-FLIGHT", "RETURNED")
        assert _line(before, "RETURNED") == "RETURNED True"  # an asynchronous save in flight
        os.kill(first.pid, signal.SIGSTOP)  # a stopped VM, a long GC pause
        time.sleep(STALE + 1.0)  # no heartbeat for longer than the lease's TTL
        new = _start(NEW_OWNER, root, stdin=subprocess.PIPE)
        owned = _read_until(new, "SAVED")
        assert _line(owned, "RESUMED") == "RESUMED 3"  # the first writer's last commit
        os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
        lines = before + out.splitlines()
        assert "COMMITTED" not in lines and "SAVED-AFTER-LOSS" not in lines, lines
        # The pending commit is refused, naming the new owner and the way out; later saves
        # raise the same error on the training thread.
        owner = f"{socket.gethostname()} pid {new.pid}"
        refused = _line(lines, "REFUSED")
        assert "the commit of r@100 was refused" in refused
        assert f"another writer, {owner}" in refused and "took run 'r' over" in refused
        assert "Stop this writer" in refused
        assert owner in _line(lines, "LATER")
        new_out, new_err = new.communicate(input="\n", timeout=120)
        assert new.returncode == 0, new_err
        assert "CLOSED" in new_out
    finally:
        for proc in (first, new):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()

    store = Store.open(root)
    assert store.list_steps("r") == [1, 2, 3, 4, 5, 6, 7]  # nothing of the first after 3
    writers = {
        s: parse_manifest(store.read_manifest("r", s), "").metadata["writer"]
        for s in store.list_steps("r")
    }
    assert writers == {1: "first", 2: "first", 3: "first", 4: "new", 5: "new", 6: "new", 7: "new"}
    for step in range(1, 8):  # every checkpoint restores bitwise
        live = state_of(-1)
        assert restore(store, live, run="r", step=step).step == step
        expected = state_of(step)["model"].state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in live["model"].state_dict().items())
    assert not list((root / "tmp").glob("*.part"))  # the refused manifest's temp file too
    assert read_lease(store, "r") is None  # the new owner released the run at close
    from stepvault.catalog import checkpoint_records

    assert [r.step for r in checkpoint_records(store, "r")] == [1, 2, 3, 4, 5, 6, 7]


# ---------------------------------------------------------------------------- unit tests
@pytest.fixture(params=["local", "memory", "s3"])
def open_store(request, tmp_path):
    """Opens a new :class:`Store` on one location at each call (another process's view),
    on each kind of backend: a directory (flock), memory:// (a process lock), S3 (moto:
    conditional writes)."""
    if request.param == "local":
        return lambda: Store.open(tmp_path / "store", create=True)
    if request.param == "memory":
        url = f"memory://fence-{uuid.uuid4().hex[:8]}"
        return lambda: Store.open(url, create=True)
    s3 = request.getfixturevalue("s3")
    url = f"s3://{s3.new_bucket()}/store"
    return lambda: Store.open(open_fsspec(url, endpoint_url=s3.endpoint), create=True)


TTL = 1.0  # the unit tests' lease_stale_after (S3 round trips on moto take ~10 ms)


def test_renewal_after_a_takeover_fails_and_names_the_new_owner(open_store):
    store, elsewhere = open_store(), open_store()  # this writer's, and another process's
    lease = acquire_lease(store, "r", stale_after=TTL)
    lease.renew()  # ours: the compare-and-set goes through
    with pytest.raises(LeaseHeldError, match="being written by"):
        acquire_lease(elsewhere, "r")  # not stale yet
    time.sleep(TTL + 0.2)  # this writer paused: no renewal
    other = acquire_lease(elsewhere, "r")
    assert read_lease(store, "r")["token"] == other.token
    with pytest.raises(LeaseLostError, match=r"another writer, .* pid \d+.* took run 'r' over"):
        lease.renew()
    assert lease.lost is not None and lease.lost.owner == (socket.gethostname(), os.getpid())
    lease.release()  # not ours any more: the new owner's lease stays
    assert read_lease(store, "r")["token"] == other.token
    other.renew()
    other.release()
    assert read_lease(store, "r") is None


def test_a_commit_after_the_lease_was_lost_is_refused_with_nothing_visible(open_store):
    store, elsewhere = open_store(), open_store()
    lease = fenced(acquire_lease(store, "r", stale_after=TTL))
    save(store, {"w": torch.arange(10.0)}, run="r", step=1)
    time.sleep(TTL + 0.2)  # paused past the TTL: no renewal
    other = fenced(acquire_lease(elsewhere, "r"))
    with pytest.raises(LeaseLostError, match="the commit of r@2 was refused") as caught:
        save(store, {"w": torch.arange(20.0)}, run="r", step=2, overwrite=True)
    assert caught.value.owner is not None and caught.value.run == "r"
    assert lease.lost is not None
    view = open_store()  # what everyone else sees: no manifest, no summary row
    assert view.list_steps("r") == [1]
    from stepvault.catalog import checkpoint_records

    assert [r.step for r in checkpoint_records(view, "r")] == [1]
    if not store.backend.url.startswith(("memory:", "s3:")):
        assert not list(Path(store.backend.url, "tmp").glob("*.part"))  # the temp manifest
    # Later commits are refused at once, deletes too; the new owner's writes go through.
    with pytest.raises(LeaseLostError):
        save(store, {"w": torch.arange(5.0)}, run="r", step=3)
    with pytest.raises(LeaseLostError):
        store.delete_manifest("r", 1)
    save(elsewhere, {"w": torch.ones(3)}, run="r", step=2)
    assert view.list_steps("r") == [1, 2]
    other.release()


def test_a_lost_heartbeat_refuses_the_queued_save_and_every_later_one(tmp_path):
    """In one process: the first manager's heartbeat stops (as if paused), a second one
    takes the run over; the first one's asynchronous save is refused, so are later ones."""
    a = CheckpointManager(
        tmp_path, "r", async_save=True, options=ManagerOptions(lease=LeaseOptions(stale_after=1.0))
    )
    a.save(1, state_of(1), force=True)
    a.wait()
    a._p.lease.stop()  # the heartbeat stops, as in a paused process
    time.sleep(1.2)
    b = CheckpointManager(tmp_path, "r", options=ManagerOptions(lease=LeaseOptions(stale_after=60)))
    b.save(2, state_of(2), force=True)
    handle = a.save(3, state_of(3), force=True)  # staged, then refused at commit
    with pytest.raises(LeaseLostError, match=f"pid {os.getpid()}"):
        handle.result(timeout=60)
    for _ in range(2):  # the training thread: the same error at every call
        with pytest.raises(LeaseLostError, match="took run 'r' over"):
            a.save(4, state_of(4), force=True)
    with pytest.raises(LeaseLostError):
        a.close()
    assert b.store.list_steps("r") == [1, 2]
    b.close()
    lease_file = tmp_path / lease_key("r")
    assert not lease_file.exists()  # released by its owner, not left by the loser


def test_one_writer_many_saves_close_and_reopen_is_unaffected(tmp_path):
    with CheckpointManager(
        tmp_path, "r", async_save=True, options=ManagerOptions(lease=LeaseOptions(stale_after=0.6))
    ) as mgr:
        for step in range(1, 9):
            mgr.save(step, state_of(step), force=True)
            time.sleep(0.1)  # heartbeats run between saves (every 0.2 s)
        mgr.wait()
        assert mgr._p.lease.lease is not None and mgr._p.lease.lease.lost is None
    assert not (tmp_path / lease_key("r")).exists()
    with CheckpointManager(
        tmp_path, "r", options=ManagerOptions(lease=LeaseOptions(stale_after=0.6))
    ) as mgr:
        live = state_of(0)
        assert mgr.restore(live).step == 8
        assert torch.equal(live["model"].weight, state_of(8)["model"].weight)
        mgr.save(9, state_of(9), force=True)
    assert Store.open(tmp_path).list_steps("r") == list(range(1, 10))


def test_two_takeovers_at_once_leave_one_owner(tmp_path):
    """Compare-and-set on the stale version: of two processes taking a stale lease over,
    one wins, the other sees a live lease."""
    store = Store.open(tmp_path, create=True)
    stale = acquire_lease(store, "r", stale_after=0.2)
    time.sleep(0.4)
    script = textwrap.dedent(
        """
        import sys, time
        from stepvault.errors import LeaseHeldError
        from stepvault.store import Store
        from stepvault.store.lease import acquire_lease
        store = Store.open(sys.argv[1])
        time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
        try:
            lease = acquire_lease(store, "r", stale_after=60)
            print("WON", lease.token, flush=True)
            time.sleep(2)
        except LeaseHeldError:
            print("HELD", flush=True)
        """
    )
    start = time.time() + 2.5  # both import first, then race
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path), str(start)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert sorted(o[0] for o in outs) == ["HELD", "WON"], outs
    winner = next(o[1] for o in outs if o[0] == "WON")
    assert json.loads((tmp_path / lease_key("r")).read_text())["token"] == winner
    with pytest.raises(LeaseLostError):
        stale.renew()


def test_a_store_out_of_reach_for_a_heartbeat_warns_and_the_heartbeat_goes_on(tmp_path):
    """A renewal that fails for a reason other than a takeover (the store briefly out of
    reach) is a warning, not a lost lease: the heartbeat keeps renewing and saves go on."""
    with CheckpointManager(
        tmp_path, "r", options=ManagerOptions(lease=LeaseOptions(stale_after=0.6))
    ) as mgr:
        backend = mgr.store.backend
        replace_if = backend.replace_if
        failures = []

        def flaky(*args, **kwargs):
            if len(failures) < 2:
                failures.append(1)
                raise OSError("connection reset by peer")
            return replace_if(*args, **kwargs)

        backend.replace_if = flaky
        deadline = time.monotonic() + 10
        while len(failures) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the next beat renews again
        with pytest.warns(RuntimeWarning, match="renewing the writer lease of run 'r' failed"):
            mgr.save(1, state_of(1), force=True)
        before = read_lease(mgr.store, "r")["heartbeat"]
        time.sleep(0.5)
        assert read_lease(mgr.store, "r")["heartbeat"] > before  # still renewing
        mgr.save(2, state_of(2), force=True)
    assert Store.open(tmp_path).list_steps("r") == [1, 2]
