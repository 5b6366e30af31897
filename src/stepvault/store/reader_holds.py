"""Reader holds: an evaluator or exporter that reads a checkpoint keeps it alive meanwhile.

A hold is one small file ``refs/readers/<run>/<step>@<token>.json`` created with
create-if-absent (like the writer lease, :mod:`.lease`), so that a trainer in another
process sees it: keep policies, thinning, tier eviction and GC skip a held checkpoint
until the hold is released or expires. The file says who holds it and until when::

    {"run", "step", "token", "owner", "host", "pid", "created", "expires"}

``pid`` is set for a hold tied to a live process (an evaluator's ``with stepvault.ops.hold``):
once that process is gone from this host, its hold counts as expired at once, so a
crashed reader never pins a checkpoint for the whole TTL. A hold taken from the command
line (``stepvault hold``) has ``pid: null`` and lasts until it is released or expires.
Expired holds are ignored by every reader of the list and deleted by the next one that
lists them (:func:`live_holds`), so nothing has to clean up after a crash.

This lives apart from the registry's holds (``refs/holds/``, which never expire) because
a reader hold is a lease on time, not a reference from a model.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import CheckpointNotFoundError
from .lease_file import pid_alive
from .names import validate_run_name, validate_step
from .repository import Store

PREFIX = "refs/readers"
#: A reader that names no TTL holds for this long (seconds); it renews or releases it.
DEFAULT_TTL = 3600.0
_FILE = re.compile(r"^(0|[1-9][0-9]{0,17})@([0-9a-f]{32})\.json$")


@dataclass(frozen=True)
class HoldRecord:
    """One reader hold as stored."""

    run: str
    step: int
    token: str
    owner: str
    host: str
    pid: int | None
    created: float
    expires: float

    def expired(self, now: float | None = None) -> bool:
        """Past its expiry, or tied to a process of this host that no longer exists."""
        now = time.time() if now is None else now
        if now >= self.expires:
            return True
        dead = self.pid is not None and self.host == socket.gethostname()
        return bool(dead and not pid_alive(self.pid))  # type: ignore[arg-type]

    def describe(self, now: float | None = None) -> str:
        """``held by reader eval (pid 12@host, 59 min left)``: the reason a plan shows."""
        now = time.time() if now is None else now
        where = f"pid {self.pid}@{self.host}" if self.pid is not None else f"from {self.host}"
        left = max(0.0, self.expires - now)
        span = f"{left / 60:.0f} min" if left < 7200 else f"{left / 3600:.1f} h"
        return f"held by reader {self.owner} ({where}, {span} left)"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def hold_key(run: str, step: int, token: str) -> str:
    return f"{PREFIX}/{validate_run_name(run)}/{validate_step(step)}@{token}.json"


def _parse(data: bytes) -> HoldRecord | None:
    try:
        d = json.loads(data)
        return HoldRecord(
            run=str(d["run"]),
            step=int(d["step"]),
            token=str(d["token"]),
            owner=str(d["owner"]),
            host=str(d["host"]),
            pid=None if d.get("pid") is None else int(d["pid"]),
            created=float(d["created"]),
            expires=float(d["expires"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


def _check_ttl(ttl: float) -> float:
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
        raise ValueError(f"a hold's ttl must be a positive number of seconds, got {ttl!r}")
    return float(ttl)


class ReaderHold:
    """A hold taken by :func:`acquire_hold`; a context manager that releases it on exit."""

    def __init__(self, store: Store, record: HoldRecord) -> None:
        self.store = store
        self.record = record

    @property
    def key(self) -> str:
        return hold_key(self.record.run, self.record.step, self.record.token)

    def renew(self, ttl: float) -> None:
        """Move the expiry to ``ttl`` seconds from now (a long evaluation keeps its hold)."""
        record = HoldRecord(**{**asdict(self.record), "expires": time.time() + _check_ttl(ttl)})
        data = json.dumps(record.to_json()).encode()
        self.store.backend.put_atomic(self.key, [data], overwrite=True)
        self.record = record

    def release(self) -> None:
        """Drop the hold (idempotent): the checkpoint is subject to retention again."""
        self.store.backend.delete(self.key)

    def __enter__(self) -> ReaderHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        r = self.record
        return f"<ReaderHold {r.run}@{r.step} by {r.owner} until {r.expires:.0f}>"


def acquire_hold(
    store: Store,
    run: str,
    step: int,
    *,
    ttl: float = DEFAULT_TTL,
    owner: str = "reader",
    tie_to_process: bool = True,
) -> ReaderHold:
    """Hold ``run@step`` for ``ttl`` seconds on behalf of ``owner``.

    The hold file is created first and the manifest checked after, so a checkpoint that a
    keep policy deleted in between is reported (:class:`CheckpointNotFoundError`) rather
    than held in vain. ``tie_to_process=False`` (the CLI): the hold outlives this process.
    """
    validate_step(step)
    if not isinstance(owner, str) or not owner or len(owner) > 200:
        raise ValueError(f"a hold's owner must be a non-empty string, got {owner!r}")
    now = time.time()
    record = HoldRecord(
        run=validate_run_name(run),
        step=step,
        token=uuid.uuid4().hex,
        owner=owner,
        host=socket.gethostname(),
        pid=os.getpid() if tie_to_process else None,
        created=now,
        expires=now + _check_ttl(ttl),
    )
    hold = ReaderHold(store, record)
    store.backend.put_atomic(hold.key, [json.dumps(record.to_json()).encode()], overwrite=False)
    try:
        store.read_manifest(run, step)
    except CheckpointNotFoundError:
        hold.release()
        raise
    return hold


def held_runs(store: Store) -> list[str]:
    return [n for n in store.backend.list(PREFIX) if not n.startswith(".")]


def iter_holds(store: Store, run: str | None = None) -> Iterator[tuple[str, HoldRecord | None]]:
    """``(key, record)`` of every hold file (of ``run``, or of every run); None: damaged."""
    for name in [run] if run is not None else held_runs(store):
        folder = f"{PREFIX}/{validate_run_name(name)}"
        for file in store.backend.list(folder):
            if not _FILE.match(file):
                continue
            key = f"{folder}/{file}"
            try:
                data = store.backend.read_bytes(key)
            except FileNotFoundError:
                continue  # released meanwhile
            yield key, _parse(data)


def live_holds(
    store: Store, run: str, *, now: float | None = None, clean: bool = True
) -> dict[int, list[HoldRecord]]:
    """The unexpired holds of ``run`` by step; expired (and damaged) files are deleted
    when ``clean`` (a damaged one is older than a minute: not a hold being written)."""
    now = time.time() if now is None else now
    out: dict[int, list[HoldRecord]] = {}
    for key, record in iter_holds(store, run):
        if record is not None and not record.expired(now):
            out.setdefault(record.step, []).append(record)
            continue
        if clean:
            try:
                if record is None and store.backend.mtime(key) > now - 60:
                    continue
                store.backend.delete(key)
            except (FileNotFoundError, NotImplementedError):
                continue
    return out


def release_holds(
    store: Store, run: str, step: int, *, token: str | None = None, owner: str | None = None
) -> list[HoldRecord]:
    """Release the holds on ``run@step`` (those with ``token``, or of ``owner``, or all);
    return the records released."""
    released = []
    for key, record in iter_holds(store, run):
        if record is None or record.step != step:
            continue
        if token is not None and not record.token.startswith(token):
            continue
        if owner is not None and record.owner != owner:
            continue
        store.backend.delete(key)
        released.append(record)
    return released


def try_hold(
    store: Store, run: str, step: int, *, ttl: float = DEFAULT_TTL, owner: str
) -> ReaderHold | None:
    """A hold where the store lets this process write one; None on a read-only store (a
    reader that may only read still reads: the hold protects, it never gates)."""
    try:
        return acquire_hold(store, run, step, ttl=ttl, owner=owner)
    except (OSError, NotImplementedError):
        return None
