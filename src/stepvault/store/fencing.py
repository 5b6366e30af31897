"""The fence rule: which manifests count once a run's lease has changed hands.

Every acquire or takeover of a run's writer lease starts a new *epoch*
(:mod:`stepvault.store.lease`). A commit under the lease records ``{"epoch", "token"}``
in its manifest's envelope line (:func:`stamp_manifest`; the body and its checksum stay
the writer's). The holder of each epoch writes ``refs/fences/<run>/<epoch>.json`` right
after taking the lease, naming the checkpoints that were visible before it took it and
the version of each (FORMAT 1.3: a late ``overwrite=True`` commit of one of them is caught).
:class:`FenceRecords` decides from those records whether a stamped manifest counts: one
of an older epoch that the next epoch's record does not list landed after that takeover
(FORMAT.md §8). :class:`~.repository.Store` applies it to every listing and read.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .names import validate_run_name

if TYPE_CHECKING:
    from .repository import Store


def fence_key(run: str, epoch: int) -> str:
    """``refs/fences/<run>/<epoch>.json``: the steps visible when lease epoch ``epoch``
    began (written by its holder right after the takeover, before it commits anything)."""
    return f"refs/fences/{validate_run_name(run)}/{int(epoch)}.json"


def fence_record(
    run: str,
    epoch: int,
    token: str,
    previous: dict[str, Any] | None,
    ended: str,
    visible: list[int],
    versions: dict[str, str],
) -> bytes:
    """The bytes of the fence record of ``run``'s lease ``epoch`` (FORMAT.md §8): its new
    holder, how the previous holder ``ended`` (released, exited, stale), and the steps
    ``visible`` at the takeover with each one's manifest version."""
    before = previous or {}
    record = {
        "format": "stepvault-fence",
        "version": 1,
        "run": run,
        "epoch": epoch,
        "token": token,
        "owner": {"host": socket.gethostname(), "pid": os.getpid()},
        "time": time.time(),
        "previous": {
            "epoch": before.get("epoch"),
            "ended": ended,
            "host": before.get("host"),
            "pid": before.get("pid"),
        },
        "visible": visible,
        "versions": versions,
    }
    return json.dumps(record, separators=(",", ":")).encode()


def manifest_stamp(data: bytes) -> dict[str, Any] | None:
    """The lease stamp in a manifest's envelope line (``{"epoch": int, "token": str}``), or
    None (a manifest committed without a lease, or by a stepvault older than stamps)."""
    head = data[: data.find(b"\n", 0, 4096)] if b"\n" in data[:4096] else b""
    if b'"lease"' not in head:
        return None
    try:
        lease = json.loads(head).get("lease")
    except (ValueError, AttributeError, RecursionError):
        return None
    if (
        isinstance(lease, dict)
        and type(lease.get("epoch")) is int
        and isinstance(lease.get("token"), str)
    ):
        return {"epoch": lease["epoch"], "token": lease["token"]}
    return None


def manifest_version(data: bytes) -> str | None:
    """The version of a manifest file the fence records name: its envelope's
    ``body_blake3`` (read from the envelope line alone: a 4 KB ranged read is enough; the
    stamp is outside the body, so a re-stamped copy is the same version). None when the
    envelope line is not there or not a manifest's."""
    end = data.find(b"\n", 0, 4096)
    if end < 0:
        return None
    try:
        envelope = json.loads(data[:end])
    except (ValueError, RecursionError):
        return None
    body = envelope.get("body_blake3") if isinstance(envelope, dict) else None
    return body if isinstance(body, str) else None


def visible_versions(store: Store, run: str, steps: Sequence[int]) -> dict[str, str]:
    """``{str(step): version}`` of each manifest in ``steps`` (what a new lease epoch's
    fence record lists beside ``visible``): one ranged read of each envelope line, a few
    at once. A manifest that cannot be read is left out (its step is judged as before
    versions: visible means it counts)."""

    def one(step: int) -> tuple[int, str | None]:
        try:
            head = store.backend.read_range(store.manifest_key(run, step), 0, 4096)
        except OSError:
            return step, None
        return step, manifest_version(head)

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(steps)))) as pool:
        found = list(pool.map(one, steps))
    return {str(step): version for step, version in found if version is not None}


def stamp_manifest(data: bytes, stamp: dict[str, Any]) -> bytes:
    """``data`` with ``stamp`` in its envelope line (replacing another one: a copy committed
    by the holder of a later epoch, e.g. a memory checkpoint of a crashed writer flushed to
    disk, is that holder's commit). The body and its checksum are unchanged (readers,
    summaries and object lists key on the body); the same stamp leaves ``data`` as it is."""
    head, sep, body = data.partition(b"\n")
    wanted = {"epoch": int(stamp["epoch"]), "token": str(stamp["token"])}
    if not sep or manifest_stamp(data) == wanted:
        return data
    try:
        envelope = json.loads(head)
    except ValueError:
        return data  # not a manifest envelope: the reader refuses it as it is
    if not isinstance(envelope, dict):
        return data
    envelope["lease"] = wanted
    return json.dumps(envelope, separators=(",", ":")).encode() + b"\n" + body


class FenceRecords:
    """The fence records of one run (``refs/fences/<run>/``): which lease epochs began, and
    what was visible when each began. Decides whether a stamped manifest counts (the fence
    rule, FORMAT.md §8): one stamped with epoch ``e`` is a checkpoint unless a later epoch
    began and the first such epoch's record does not list its step — it landed after that
    takeover (a stale writer's commit in flight through a partition, or a frozen process).

    ``epochs``: the epochs that have a record (from one listing); ``load(epoch)`` reads one
    record, only when a decision needs it (a run restarted a thousand times has a thousand
    records, and a listing needs one or two of them)."""

    def __init__(self, epochs: list[int], load: Callable[[int], dict[str, Any]]) -> None:
        self.epochs = sorted(epochs)
        self._load = load

    @property
    def current(self) -> int:
        return self.epochs[-1] if self.epochs else 0

    def record(self, epoch: int) -> dict[str, Any]:
        return self._load(epoch)

    def refusal(
        self,
        step: int,
        stamp: dict[str, Any] | None,
        *,
        memory: bool = False,
        version: str | None = None,
    ) -> str | None:
        """Why a manifest of ``step`` with ``stamp`` is not a checkpoint; None when it is.

        ``version``: the manifest's :func:`manifest_version`, when the caller read it. A
        record that lists the step's version (``versions``, FORMAT 1.3) counts only that
        version: another one of an older epoch is a late ``overwrite=True`` commit that
        replaced the checkpoint visible at the takeover. Records without ``versions``
        (written by 1.2), a caller that read no version, and node memory (whose copies are
        other files) judge by the step alone.

        ``memory``: a node-memory copy, checked by the same rule, except that an epoch
        whose holder had exited or released the run (no process of it left to commit late)
        keeps its memory checkpoints across the takeovers that followed that end."""
        if stamp is None:
            return None  # no lease, or written before stamps: valid as ever
        epoch = stamp["epoch"]
        later = [e for e in self.epochs if e > epoch]
        if not later:
            return None
        first = later[0]
        record = self.record(first)
        owner = record.get("owner") or {}
        if step in set(record.get("visible") or []):
            versions = record.get("versions")
            listed = versions.get(str(step)) if isinstance(versions, dict) else None
            if memory or version is None or listed is None or listed == version:
                return None
            return (
                f"replaced the checkpoint visible at the takeover by {owner.get('host', '?')} "
                f"pid {owner.get('pid', '?')} (lease epoch {first}; this manifest was "
                f"committed under epoch {epoch}, whose writer had lost the run, with "
                "overwrite=True: the version the takeover saw is gone)"
            )
        if memory and all(
            (self.record(e).get("previous") or {}).get("ended") in ("released", "exited", None)
            for e in later
        ):
            return None
        return (
            f"landed after takeover by {owner.get('host', '?')} pid {owner.get('pid', '?')} "
            f"(lease epoch {first}; this manifest was committed under epoch {epoch}, whose "
            "writer had lost the run)"
        )
