"""The append-only event log: one JSON object per line in ``events/<run>.jsonl``."""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from typing import Any

from .names import validate_run_name
from .repository import Store


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return str(os.getuid()) if hasattr(os, "getuid") else "?"


def log_event(store: Store, run: str, event: str, **fields: Any) -> dict[str, Any]:
    """Append one event (time, user, host, pid added) and return it."""
    record = {
        "time": time.time(),
        "event": event,
        "run": run,
        "user": _user(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **fields,
    }
    line = json.dumps(record, default=str, separators=(",", ":")) + "\n"
    store.backend.append(f"events/{validate_run_name(run)}.jsonl", line.encode())
    return record


def read_events(store: Store, run: str) -> list[dict[str, Any]]:
    """Every event of ``run`` in order; a torn last line (crash mid-append) is ignored."""
    try:
        data = store.backend.read_bytes(f"events/{validate_run_name(run)}.jsonl")
    except FileNotFoundError:
        return []
    events = []
    for line in data.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events
