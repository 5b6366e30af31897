"""The append-only event log of a run.

On a local disk it is one JSON object per line in ``events/<run>.jsonl`` (one O_APPEND
write per record). Object stores cannot append: rewriting the whole log for every event
would cost O(log size) per event and race other writers, so there each event is its own
small object ``events/<run>/<time ns>-<random>.json``, created with create-if-absent.
:func:`read_events` merges both forms in time order.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..store.names import validate_run_name
from ..store.repository import Store


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
    name = validate_run_name(run)
    if store.backend.append_is_cheap:
        store.backend.append(f"events/{name}.jsonl", line.encode())
    else:
        key = f"events/{name}/{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.json"
        store.backend.put_atomic(key, [line.encode()], overwrite=False)
    return record


def read_events(store: Store, run: str) -> list[dict[str, Any]]:
    """Every event of ``run`` in order; a torn last line (crash mid-append) is ignored."""
    name = validate_run_name(run)
    try:
        data = store.backend.read_bytes(f"events/{name}.jsonl")
    except FileNotFoundError:
        data = b""
    listed = store.backend.list(f"events/{name}")
    keys = [f"events/{name}/{k}" for k in listed if k.endswith(".json")]
    if keys:  # one object per event (object stores): fetch them in parallel
        with ThreadPoolExecutor(max_workers=min(16, len(keys))) as pool:
            data += b"".join(pool.map(_read_or_empty(store), keys))
    events = []
    for line in data.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    if keys:
        events.sort(key=lambda e: e.get("time", 0) if isinstance(e, dict) else 0)
    return events


def _read_or_empty(store: Store):
    def read(key: str) -> bytes:
        try:
            data = store.backend.read_bytes(key)
        except FileNotFoundError:
            return b""
        return data if data.endswith(b"\n") else data + b"\n"

    return read
