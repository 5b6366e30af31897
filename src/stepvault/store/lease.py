"""Single-writer leases: one writer per run at a time, stale leases taken over, commits fenced.

A lease is ``refs/leases/<run>.json`` (FORMAT.md §8) created with create-if-absent. Its
holder renews a heartbeat; another writer gets :class:`LeaseHeldError` unless the lease is
stale: its heartbeat is older than ``stale_after`` seconds, or it names a process on this
host that no longer exists (a crashed writer on the same machine is taken over at once).

**The token fences the commit.** Each lease carries a random token. Every change to the
lease file is a compare-and-set (:meth:`Backend.replace_if <.backend.Backend.replace_if>`):
a renewal succeeds only if the file is still the version this holder last wrote, a
takeover only if it is still the stale version it looked at. A manager puts its lease on
its store (``store.fences[run]``); every manifest commit or delete of that run then runs
inside :meth:`Lease.guard`, which refuses with :class:`LeaseLostError` (naming the new
owner) once another writer holds the run. How atomic the check is depends on the backend:

* local disks (and ``memory://``): an ``flock`` on ``refs/leases/<run>.json.lock`` taken
  by acquire, renew, release and by the commit across "read the token, rename the
  manifest": a takeover cannot fall between the check and the rename. A holder stopped
  inside (a frozen process) does not block the run: a takeover that finds the lock held
  for seconds and the lease stale breaks it, and the woken holder's rename checks the lock
  first and is refused (:meth:`LocalBackend.exclusive <.local.LocalBackend.exclusive>`);
* S3: the guard renews the lease with a conditional PUT (``If-Match`` on the ETag this
  holder last wrote) right before the manifest's PUT. A takeover needs the lease to go
  stale, ``stale_after`` seconds after that renewal, so the commit is refused unless this
  process stops for ``stale_after`` between two consecutive requests (S3 has no
  transaction over two keys; RELIABILITY.md says so);
* other fsspec filesystems: the same steps as a check-then-act (no conditional writes).

A lease found lost stays lost (:attr:`Lease.lost`): every later commit is refused at once.

**Epochs close the window the S3 fence leaves** (a PUT that passed the guard but reaches the
server after a takeover: a partition, a frozen VM). Every acquire or takeover starts a new
lease *epoch* (one more than any before); every manifest committed under the lease carries
``{"epoch", "token"}`` in its envelope (:func:`~.fencing.stamp_manifest`). Before taking
the lease the new holder lists the run's checkpoints, and right after, before it commits
anything, it writes the fence record ``refs/fences/<run>/<epoch>.json`` naming them. Readers
(:meth:`Store.list_steps <.repository.Store.list_steps>`, ``read_manifest``) drop a manifest
stamped with an older epoch that the next epoch's record does not list: it landed after the
takeover (FORMAT.md §8, "the fence rule").
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import LeaseHeldError, LeaseLostError, LockBrokenError
from .backend import PreconditionFailed
from .fencing import fence_key, fence_record, visible_versions
from .lease_file import (
    DEFAULT_STALE_AFTER,
    holder_stopped,
    is_stale,
    lease_key,
    pid_alive,
    read_lease,
)
from .repository import Store


@dataclass(eq=False)
class Lease:
    """The writer lease of ``run`` held by this process (see the module docstring)."""

    store: Store
    run: str
    token: str
    stale_after: float
    #: the lease epoch: one more than any earlier holder's (stamped into every commit)
    epoch: int = 0
    #: the version (content hash, or S3 ETag) of the lease file this holder last wrote
    version: str | None = field(default=None, repr=False)
    #: set once another writer is found holding the run; every later commit raises it
    lost: LeaseLostError | None = field(default=None, repr=False)
    # Serialises the heartbeat thread and the commit guard of this process (both CAS on
    # ``version``).
    _mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def key(self) -> str:
        return lease_key(self.run)

    def _record(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "token": self.token,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "heartbeat": time.time(),
            "stale_after": self.stale_after,
            "epoch": self.epoch,
        }

    def stamp(self) -> dict[str, Any] | None:
        """What every manifest committed under this lease records (FORMAT.md §8)."""
        return {"epoch": self.epoch, "token": self.token}

    def memory_fence(self) -> MemoryFence:
        """The fence of this writer's commits into node memory (:class:`MemoryFence`)."""
        return MemoryFence(self.stamp() or {}, self)

    def renew(self) -> None:
        """Refresh the heartbeat by compare-and-set on the version this holder last wrote.

        Raises :class:`LeaseLostError` (and marks the lease lost) when another writer took
        the run over; an ``OSError`` is a failure to reach the store (try again later).
        """
        with self._mutex, self.store.backend.exclusive(self.key):
            self._renew_locked("renewing the lease")

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Hold the lease across the block (a commit): raise :class:`LeaseLostError`,
        before anything is visible, when another writer holds the run."""
        backend = self.store.backend
        with self._mutex, backend.exclusive(self.key):
            if self.lost is not None:
                raise self._refusal(what, self.lost.owner, None)
            if backend.exclusive_is_atomic:
                # Every change to the lease takes this lock: reading the token suffices.
                current, _ = self._read()
                if not self._ours(current):
                    raise self._lose(current, what)
            else:
                # No lock: a conditional renewal proves ownership and restarts the stale
                # clock, so no takeover is possible for ``stale_after`` from now.
                self._renew_locked(what)
            try:
                yield
            except LockBrokenError:
                # Stopped inside this block past stale_after, and the lock broken by the
                # writer that took the run over (local disks): nothing was written.
                self._confirm(what, late=False)
                raise
            except FileExistsError:
                # A create-only commit found the step taken: by the new owner, when this
                # write reached the store after a takeover; then the lost lease is the error.
                self._confirm(what)
                raise
            # The write may have reached the store after a takeover (held up in a partition,
            # or stopped between the lock's last check and the rename): then readers ignore
            # it (the fence rule) and this writer must learn now, as a refused commit, not
            # at its next save. On local disks this is one read of a small file.
            self._confirm(what)

    def release(self) -> None:
        """Give the run up: remove the lease file if it is still ours, stop fencing."""
        if self.store.fences.get(self.run) is self:
            del self.store.fences[self.run]
        if self.lost is not None:
            return  # the file is the new owner's
        backend = self.store.backend
        with self._mutex, backend.exclusive(self.key):
            current, version = self._read()
            if version is None or not self._ours(current):
                return
            try:
                backend.delete_if(self.key, version)
            except PreconditionFailed:
                pass  # changed since: not ours to remove

    # -- helpers -----------------------------------------------------------------------
    def _confirm(self, what: str, *, late: bool = True) -> None:
        try:  # one GET (no version needed: nothing is written on what it says)
            current = read_lease(self.store, self.run)
        except OSError:
            return  # out of reach: the fence rule decides whether the write counts
        if not self._ours(current):
            self._lose(current, what)
            assert self.lost is not None
            raise self._refusal(what, self.lost.owner, current, late=late)

    def _renew_locked(self, what: str) -> None:
        if self.lost is not None:
            raise self._refusal(what, self.lost.owner, None)
        backend = self.store.backend
        for _ in range(5):
            data = json.dumps(self._record()).encode()
            try:
                # Not fsynced: a lease lost to a crash only makes the run free sooner.
                self.version = backend.replace_if(self.key, [data], self.version, durable=False)
                return
            except PreconditionFailed:
                pass
            current, version = self._read()
            if not self._ours(current):
                raise self._lose(current, what)
            # Still ours (a retried request that had gone through): CAS on what is there.
            self.version = version
        raise OSError(f"could not renew the lease of run {self.run!r}: the file keeps changing")

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            data, version = self.store.backend.read_versioned(self.key)
        except FileNotFoundError:
            return None, None
        try:
            record = json.loads(data)
        except ValueError:
            return {"corrupt": True, "heartbeat": 0}, version
        return (record if isinstance(record, dict) else {"corrupt": True}), version

    def _ours(self, record: dict[str, Any] | None) -> bool:
        return record is not None and record.get("token") == self.token

    def _lose(self, current: dict[str, Any] | None, what: str) -> LeaseLostError:
        owner = None
        if current is not None and isinstance(current.get("pid"), int):
            owner = (str(current.get("host")), int(current["pid"]))
        self.lost = self._refusal(what, owner, current)
        return self.lost

    def _refusal(
        self,
        what: str,
        owner: tuple[str, int] | None,
        current: dict[str, Any] | None,
        *,
        late: bool = False,
    ) -> LeaseLostError:
        if owner is not None:
            since = ""
            if current is not None and "heartbeat" in current:
                since = f", heartbeat {time.time() - float(current['heartbeat']):.1f}s ago"
            who = (
                f"another writer, {owner[0]} pid {owner[1]}{since}, took run {self.run!r} "
                f"over after this writer's heartbeat had stopped for more than "
                f"{self.stale_after:g}s (a stopped process or VM, a long pause, a lost "
                "network) and its lease went stale"
            )
        else:
            who = (
                f"its lease file {self.key} is gone or unreadable (removed by hand, or a "
                "takeover in progress)"
            )
        outcome = (
            "It reached the store after that takeover, so it is not a checkpoint: readers "
            "ignore it and the new owner removes it."
            if late
            else "Nothing was committed or deleted."
        )
        return LeaseLostError(
            f"{what} was refused: this process (pid {os.getpid()}) no longer holds the "
            f"writer lease of run {self.run!r}: {who}. {outcome} Stop "
            "this writer (exit without saving): the new owner continues the run (resume from its "
            "checkpoints), or write under another run name",
            run=self.run,
            owner=owner,
        )


@dataclass(frozen=True)
class MemoryFence:
    """The fence of a commit into node memory (a mem tier, a rank's own memory).

    It stamps the memory manifest with the lease epoch; a restore then ignores a memory
    checkpoint that the fence rule refuses (one committed under an epoch that was taken
    over while its writer may still have been running, and not on disk at the takeover).
    It refuses nothing itself and asks the store nothing: a memory commit never waits on
    the network, and under a process group only rank 0 knows the lease, so a refusal there
    would stop one rank alone; the lost lease is raised on every rank by the next disk
    commit (``lease``: the holder's lease, None on the other ranks).
    """

    epoch_stamp: dict[str, Any]
    lease: Lease | None = None

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        yield

    def stamp(self) -> dict[str, Any] | None:
        return dict(self.epoch_stamp) if self.epoch_stamp else None


def acquire_lease(store: Store, run: str, *, stale_after: float = DEFAULT_STALE_AFTER) -> Lease:
    """Take the writer lease of ``run`` or raise :class:`LeaseHeldError`.

    A stale lease is taken over by compare-and-set on the stale version read, so of two
    processes taking it over at once exactly one wins (the other sees a fresh lease). The
    winner starts a new epoch and writes its fence record before returning (module
    docstring): from then on a late commit of an earlier holder is no checkpoint.
    """
    lease = Lease(store, run, uuid.uuid4().hex, stale_after)
    backend = store.backend
    with backend.exclusive(lease.key, abandoned=lambda: holder_stopped(store, run)):
        expected: str | None = None  # first try create-if-absent
        current: dict[str, Any] | None = None
        for _ in range(5):
            # Listed *before* the lease is taken: a commit of the old holder that lands
            # after this listing is not in the record, so it does not count (that holder's
            # last renewal was more than stale_after ago: it was late by the fence's terms).
            visible = store.list_steps(run)
            # ...with the version of each: a late overwrite=True commit of one of them is
            # no checkpoint either (the fence rule, FORMAT.md 1.3).
            versions = visible_versions(store, run, visible)
            earlier = store.fence_records(run).current
            if current is not None and type(current.get("epoch")) is int:
                earlier = max(earlier, current["epoch"])
            lease.epoch = earlier + 1
            data = json.dumps(lease._record()).encode()
            try:
                lease.version = backend.replace_if(lease.key, [data], expected)
            except PreconditionFailed:
                pass
            else:
                _write_fence_record(lease, current, visible, versions)
                return lease
            current, expected = lease._read()
            if current is None:
                continue  # released meanwhile: create it
            if not is_stale(current):
                age = time.time() - float(current.get("heartbeat", 0))
                raise LeaseHeldError(
                    f"run {run!r} is being written by {current.get('host')} pid "
                    f"{current.get('pid')} (heartbeat {age:.0f}s ago). Two writers on one run "
                    f"would corrupt its history: stop the other writer, use another run name, "
                    f"or wait {stale_after:.0f}s for its lease to go stale"
                )
            # stale: replace exactly the version read (CAS), next round
    raise LeaseHeldError(f"could not acquire the lease of run {run!r} (contention); retry")


def _write_fence_record(
    lease: Lease,
    previous: dict[str, Any] | None,
    visible: list[int],
    versions: dict[str, str] | None = None,
) -> None:
    """``refs/fences/<run>/<epoch>.json`` (create-only), right after the lease was taken and
    before anything is committed under it. If it cannot be written the lease is given back:
    without it an earlier holder's late commit would count."""
    if previous is None:
        ended = "released"  # no lease file: the last holder gave the run up (or none was)
    elif previous.get("host") == socket.gethostname() and not pid_alive(
        int(previous.get("pid", -1)) if isinstance(previous.get("pid"), int) else -1
    ):
        ended = "exited"  # its process is gone: it commits nothing more into node memory
    else:
        ended = "stale"  # heartbeat too old: it may still be running somewhere
    data = fence_record(
        lease.run, lease.epoch, lease.token, previous, ended, visible, versions or {}
    )
    try:
        lease.store.backend.put_atomic(
            fence_key(lease.run, lease.epoch), [data], overwrite=False, durable=True
        )
        lease.store.backend.sync()
    except BaseException:
        with contextlib.suppress(Exception):
            lease.release()
        raise


__all__ = [
    "DEFAULT_STALE_AFTER",
    "Lease",
    "LeaseHeldError",
    "LeaseLostError",
    "MemoryFence",
    "acquire_lease",
    "is_stale",
    "lease_key",
    "read_lease",
]
