"""The fence rule: which manifests count once a run's lease has changed hands.

Every acquire or takeover of a run's writer lease starts a new *epoch*
(:mod:`stepvault.store.lease`). A commit under the lease records ``{"epoch", "token"}``
in its manifest's envelope line (:func:`stamp_manifest`; the body and its checksum stay
the writer's). The holder of each epoch writes ``refs/fences/<run>/<epoch>.json`` right
after taking the lease, naming the checkpoints that were visible before it took it.
:class:`FenceRecords` decides from those records whether a stamped manifest counts: one
of an older epoch that the next epoch's record does not list landed after that takeover
(FORMAT.md §8). :class:`~.repository.Store` applies it to every listing and read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .names import validate_run_name


def fence_key(run: str, epoch: int) -> str:
    """``refs/fences/<run>/<epoch>.json``: the steps visible when lease epoch ``epoch``
    began (written by its holder right after the takeover, before it commits anything)."""
    return f"refs/fences/{validate_run_name(run)}/{int(epoch)}.json"


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
        self, step: int, stamp: dict[str, Any] | None, *, memory: bool = False
    ) -> str | None:
        """Why a manifest of ``step`` with ``stamp`` is not a checkpoint; None when it is.

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
        if step in set(record.get("visible") or []):
            return None
        if memory and all(
            (self.record(e).get("previous") or {}).get("ended") in ("released", "exited", None)
            for e in later
        ):
            return None
        owner = record.get("owner") or {}
        return (
            f"landed after takeover by {owner.get('host', '?')} pid {owner.get('pid', '?')} "
            f"(lease epoch {first}; this manifest was committed under epoch {epoch}, whose "
            "writer had lost the run)"
        )
