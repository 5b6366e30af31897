"""Moving one committed checkpoint between two ranks' stores over a gloo process group.

The wire protocol of memory replication (``replication.py``) and of a restore that fetches
from a peer. Every rank of the group runs the same phases for the same ``run@step``; in
each phase a rank may send to one rank and receive from another at the same time (a ring
of sends), so both directions are posted before anything waits:

1. **offer** — the sender's header: the manifest, the objects it names with their stored
   sizes, and (for replication) the steps the owner still holds;
2. **reply** — the receiver's answer: the objects it lacks, or a reason to skip;
3. **objects** — the lacking objects in frames of whole objects (at most ``FRAME_BYTES``
   each, the last one flagged). The receiver decodes and hash-verifies every object before
   it stages it, publishes the batch durably, and only then commits the manifest (create
   or replace): a transfer killed at any instant leaves no manifest, so nothing uses it.

Messages are JSON (headers) or raw object bytes; nothing received is unpickled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import StepvaultError
from ..format import parse_manifest
from ..format.objects import decode_object
from ..store import Store

#: Upper bound of one frame of objects (an object larger than this travels alone).
FRAME_BYTES = 64 << 20


@dataclass
class Offer:
    """What a sender has of ``run@step``: manifest bytes and object sizes."""

    run: str
    step: int
    manifest: bytes = b""
    sizes: dict[str, int] = field(default_factory=dict)
    held: list[int] | None = None
    missing: str | None = None  # why there is nothing to send

    def header(self) -> bytes:
        return json.dumps(
            {
                "run": self.run,
                "step": self.step,
                "manifest": self.manifest.decode() if self.manifest else "",
                "sizes": self.sizes,
                "held": self.held,
                "missing": self.missing,
            }
        ).encode()

    @classmethod
    def parse(cls, data: bytes) -> Offer:
        doc = json.loads(data)
        return cls(
            run=str(doc["run"]),
            step=int(doc["step"]),
            manifest=str(doc["manifest"]).encode(),
            sizes={str(k): int(v) for k, v in doc["sizes"].items()},
            held=None if doc.get("held") is None else [int(s) for s in doc["held"]],
            missing=doc.get("missing"),
        )


def make_offer(store: Store, run: str, step: int, *, held: bool = False) -> Offer:
    """The offer of ``run@step`` from ``store`` (``missing`` set when it cannot be sent)."""
    offer = Offer(run, step)
    try:
        offer.manifest = store.read_manifest(run, step)
        manifest = parse_manifest(offer.manifest, f"{run}@{step}")
        offer.sizes = {d: store.object_size(d) for d in sorted(manifest.objects)}
    except (StepvaultError, OSError) as exc:
        offer.manifest, offer.sizes = b"", {}
        offer.missing = f"{run}@{step} cannot be offered from {store.backend.url}: {exc}"
    if held:
        offer.held = store.list_steps(run)
    return offer


@dataclass
class Received:
    """What the receiving side of one transfer did."""

    run: str
    step: int
    committed: bool = False
    skipped: str | None = None  # budget, missing at the sender, damage...
    objects: int = 0
    bytes: int = 0
    seconds: float = 0.0


#: ``prepare(offer) -> (objects to send, reason to skip or None)``, run by the receiver.
Prepare = Callable[[Offer], tuple[list[str], str | None]]


class Link:
    """Point-to-point messages on one process group (global ranks, as torch wants)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._pending: list[tuple[Any, Any]] = []

    def post(self, dst: int, data: bytes | bytearray | memoryview, last: bool = True) -> None:
        """Queue ``data`` for ``dst`` without waiting (buffers are kept until :meth:`drain`)."""
        head = torch.tensor([len(data), int(last)], dtype=torch.int64)
        self._pending.append((dist.isend(head, dst, group=self.group), head))
        if len(data):
            body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._pending.append((dist.isend(body, dst, group=self.group), body))

    def recv(self, src: int) -> tuple[memoryview, bool]:
        """The next message from ``src`` and whether it was flagged last."""
        head = torch.empty(2, dtype=torch.int64)
        _wait(dist.irecv(head, src, group=self.group))
        n, last = int(head[0]), bool(head[1])
        body = torch.empty(n, dtype=torch.uint8)
        if n:
            _wait(dist.irecv(body, src, group=self.group))
        return memoryview(body.numpy().data).cast("B"), last

    def drain(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` sends are still in flight."""
        while len(self._pending) > keep:
            work, _ = self._pending.pop(0)
            work.wait()


def _wait(work: Any) -> None:
    if work is not None:  # None only for ranks outside the group, which never call this
        work.wait()


def transfer(
    link: Link,
    *,
    send_to: int | None,
    offer: Offer | None,
    source: Store | None,
    recv_from: int | None,
    target: Store | None,
    prepare: Prepare | None = None,
) -> Received | None:
    """One transfer phase on this rank: send ``offer`` (objects read from ``source``) to
    ``send_to`` and/or receive a checkpoint from ``recv_from`` into ``target``.

    Returns what was received (None when this rank received nothing). Damage in what was
    received skips the commit (``Received.skipped`` says why); the stream is drained either
    way, so both sides stay in step for the next transfer.
    """
    t0 = time.perf_counter()
    sending = send_to is not None and offer is not None
    receiving = recv_from is not None and target is not None
    # 1. offers
    if sending:
        link.post(send_to, offer.header())  # type: ignore[arg-type,union-attr]
    incoming = Offer.parse(bytes(link.recv(recv_from)[0])) if receiving else None  # type: ignore[arg-type]
    # 2. replies
    need: list[str] = []
    skip: str | None = None
    if incoming is not None:
        if incoming.missing:
            skip = incoming.missing
        else:
            need, skip = (prepare or _lacking(target))(incoming)  # type: ignore[arg-type]
            if skip:
                need = []
        link.post(recv_from, json.dumps({"need": need, "skip": skip}).encode())  # type: ignore[arg-type]
    wanted: list[str] = []
    if sending:  # a reply comes back even to an offer of nothing
        wanted = [str(d) for d in json.loads(bytes(link.recv(send_to)[0]))["need"]]  # type: ignore[arg-type]
    # 3. objects: both directions interleaved, at most two frames of ours in flight
    frames = _frames(wanted, offer.sizes) if sending and not offer.missing else iter(())  # type: ignore[union-attr]
    to_send = sending and not offer.missing  # type: ignore[union-attr]
    result = Received(incoming.run, incoming.step) if incoming is not None else None
    expecting = incoming is not None and not incoming.missing
    writer = _Intake(target, need, incoming) if expecting else None  # type: ignore[arg-type]
    while to_send or expecting:
        if to_send:
            batch = next(frames, None)
            if batch is None:
                to_send = False
            else:
                digests, is_last = batch
                data = bytearray()
                for d in digests:
                    data += source.read_object(d)  # type: ignore[union-attr]
                link.post(send_to, data, last=is_last)  # type: ignore[arg-type]
                link.drain(keep=4)
                if is_last:
                    to_send = False
        if expecting:
            chunk, last = link.recv(recv_from)  # type: ignore[arg-type]
            writer.take(chunk)  # type: ignore[union-attr]
            if last:
                expecting = False
    link.drain()
    if result is not None:
        if skip:
            result.skipped = skip
        elif writer is not None:
            writer.finish(result)
        result.seconds = time.perf_counter() - t0
    return result


def _frames(wanted: list[str], sizes: dict[str, int]):
    """Frames of whole objects; always at least one (possibly empty) flagged last."""
    batch: list[str] = []
    total = 0
    for d in wanted:
        if batch and total + sizes[d] > FRAME_BYTES:
            yield batch, False
            batch, total = [], 0
        batch.append(d)
        total += sizes[d]
    yield batch, True


def _lacking(target: Store) -> Prepare:
    def prepare(offer: Offer) -> tuple[list[str], str | None]:
        return [d for d in offer.sizes if not target.has_object(d)], None

    return prepare


class _Intake:
    """The receiving end: verify each object, stage it, commit the manifest last."""

    def __init__(self, target: Store, need: list[str], offer: Offer) -> None:
        self.target = target
        self.offer = offer
        self.queue = list(need)
        self.tokens: list[object] = []
        self.damage: str | None = None
        self.bytes = 0

    def take(self, chunk: memoryview) -> None:
        pos = 0
        while pos < len(chunk) and self.queue:
            digest = self.queue.pop(0)
            size = self.offer.sizes[digest]
            data = chunk[pos : pos + size]
            pos += size
            self.bytes += size
            if self.damage:
                continue
            try:
                decode_object(data, digest, verify=True)  # every byte received is verified
            except StepvaultError as exc:
                self.damage = f"object {digest[:16]}… from the peer failed verification: {exc}"
                continue
            self.tokens.append(self.target.stage_object(digest, [bytes(data)]))

    def finish(self, result: Received) -> None:
        result.objects, result.bytes = len(self.tokens), self.bytes
        if self.queue and not self.damage:
            self.damage = f"the peer sent {len(self.queue)} objects fewer than asked"
        if not self.damage:
            try:
                m = parse_manifest(self.offer.manifest, f"{self.offer.run}@{self.offer.step}")
                if (m.run, m.step) != (self.offer.run, self.offer.step):
                    raise StepvaultError(f"the peer sent the manifest of {m.run}@{m.step}")
            except StepvaultError as exc:
                self.damage = f"manifest from the peer rejected: {exc}"
        if self.damage:
            self.target.discard_objects(self.tokens)
            result.skipped = self.damage
            return
        self.target.publish_objects(self.tokens)
        self.target.sync()
        absent = [d for d in m.objects if not self.target.has_object(d)]
        if absent:  # reused objects that vanished meanwhile: no manifest without them
            result.skipped = f"{len(absent)} objects of the replica are gone from the target"
            return
        self.target.commit_manifest(m.run, m.step, self.offer.manifest, overwrite=True)
        result.committed = True


__all__ = ["FRAME_BYTES", "Link", "Offer", "Received", "make_offer", "transfer"]
