"""A run's lease file, as read without holding it: its key, its record, whether it is stale.

Shared by the writer lease (:mod:`.lease`), the readers' holds and node memory, which
decide by the same rule whether the process named in a lease still runs.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from typing import Any

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


def holder_stopped(store: Store, run: str) -> bool:
    """Whether the lock of ``run``'s lease, held by another process, may be broken: the
    lease is stale, so whoever holds the lock has not run for ``stale_after`` (a live
    holder renews the lease and keeps the lock for microseconds). When it says yes it also
    warns (``RuntimeWarning``) that the lock is being broken, naming the stopped holder."""
    try:
        record = read_lease(store, run)
    except OSError:
        return False
    if record is None or not is_stale(record):
        return False
    warnings.warn(
        f"run {run!r}: the lock of its writer lease has been held for seconds by a process "
        f"that stopped (lease stale: {record.get('host')} pid {record.get('pid')}, a "
        "frozen process or VM); breaking the lock to take the run over. If that process "
        "wakes up, its commits are refused",
        RuntimeWarning,
        stacklevel=2,
    )
    return True
