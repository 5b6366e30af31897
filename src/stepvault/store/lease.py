"""Single-writer leases: one writer per run at a time, stale leases taken over.

A lease is ``refs/leases/<run>.json`` created with create-if-absent. Its holder renews a
heartbeat; another writer gets :class:`LeaseHeldError` unless the lease is stale: its
heartbeat is older than ``stale_after`` seconds, or it names a process on this host that
no longer exists (a crashed writer on the same machine is taken over at once).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import LeaseHeldError
from .names import validate_run_name
from .repository import Store

#: Default seconds without a heartbeat after which a lease counts as abandoned.
DEFAULT_STALE_AFTER = 300.0


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Lease:
    store: Store
    run: str
    token: str
    stale_after: float

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
        }

    def renew(self) -> None:
        """Refresh the heartbeat (fails if someone else took the lease over)."""
        current = read_lease(self.store, self.run)
        if current is not None and current.get("token") != self.token:
            raise LeaseHeldError(
                f"lost the lease on run {self.run!r} to {current.get('host')}:"
                f"{current.get('pid')} (it was considered stale); stop writing this run"
            )
        data = json.dumps(self._record()).encode()
        self.store.backend.put_atomic(self.key, [data], overwrite=True)

    def release(self) -> None:
        current = read_lease(self.store, self.run)
        if current is not None and current.get("token") == self.token:
            self.store.backend.delete(self.key)


def lease_key(run: str) -> str:
    return f"refs/leases/{validate_run_name(run)}.json"


def read_lease(store: Store, run: str) -> dict[str, Any] | None:
    try:
        return json.loads(store.backend.read_bytes(lease_key(run)))
    except FileNotFoundError:
        return None
    except ValueError:
        return {"corrupt": True, "heartbeat": 0}


def is_stale(record: dict[str, Any], now: float | None = None) -> bool:
    now = time.time() if now is None else now
    stale_after = float(record.get("stale_after", DEFAULT_STALE_AFTER))
    if now - float(record.get("heartbeat", 0)) > stale_after:
        return True
    same_host = record.get("host") == socket.gethostname()
    pid = record.get("pid")
    return bool(same_host and isinstance(pid, int) and not pid_alive(pid))


def acquire_lease(store: Store, run: str, *, stale_after: float = DEFAULT_STALE_AFTER) -> Lease:
    """Take the writer lease of ``run`` or raise :class:`LeaseHeldError`."""
    lease = Lease(store, run, uuid.uuid4().hex, stale_after)
    data = json.dumps(lease._record()).encode()
    for _ in range(2):
        try:
            store.backend.put_atomic(lease.key, [data], overwrite=False)
            return lease
        except FileExistsError:
            current = read_lease(store, run)
            if current is None:
                continue
            if not is_stale(current):
                age = time.time() - float(current.get("heartbeat", 0))
                raise LeaseHeldError(
                    f"run {run!r} is being written by {current.get('host')} pid "
                    f"{current.get('pid')} (heartbeat {age:.0f}s ago). Two writers on one run "
                    f"would corrupt its history: stop the other writer, use another run name, "
                    f"or wait {stale_after:.0f}s for its lease to go stale"
                ) from None
            store.backend.delete(lease.key)  # stale: take it over
    raise LeaseHeldError(f"could not acquire the lease of run {run!r} (contention)")
