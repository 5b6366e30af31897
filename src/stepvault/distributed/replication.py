"""Replication of memory-tier checkpoints to a buddy node, in the background.

Every rank keeps its rank-local memory checkpoints in its node's memory store (``own``).
After a commit there, every rank calls :meth:`Replicator.replicate` with the same
``run_of_rank``/step (the save was collective, so they all do): a background thread sends
this rank's checkpoint to its buddy (the same local rank on the next node, see
``nodes.py``) and receives the checkpoint of the rank it is buddy of, on a dedicated gloo
process group created at set-up, so training collectives never interleave with
replication traffic and the training thread never waits for it.

A node keeps the replicas it holds apart from its own checkpoints, one store per source
rank: ``<mem root>/peers/<node>/rank<local rank>``, written in the store format and
committed objects-then-manifest (``peer_transfer.py``), every object hash-verified as it
arrives. A replica that would push the node's memory root over ``budget_bytes`` is
skipped (a ``replica_skipped`` event); replicas of steps the owner no longer holds are
deleted (with their objects) before the next one is written.

(Its length is the Replicator's: the send and receive sides, the queue and thread, the
events and the status gathered for ``wait(replicated=True)`` share one state per rank.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..catalog.events import log_event
from ..engine.gc import sweep
from ..errors import StepvaultError
from ..format.settings import DEFAULT_STORE_SETTINGS
from ..store import Store
from .nodes import NodeLayout, discover_layout
from .peer_transfer import Link, Offer, Received, make_offer, transfer


def rank_run(run: str, rank: int) -> str:
    """The name of ``rank``'s own (rank-local) memory checkpoints of ``run``."""
    return f"{run}+rank{rank}"


def tree_bytes(root: Path) -> int:
    """Bytes of every file under ``root`` (what a tmpfs charges for it)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


class Replicator:
    """Background replication of one rank's memory checkpoints to its buddy's memory.

    Create it on every rank at set-up (collective: it gathers the node layout and creates
    the replication group). ``own`` is this node's memory store, ``mem_root`` the
    directory that holds it (peers go under ``mem_root/peers``), ``buddy_nodes`` an
    optional node id -> node id map instead of the ring, ``budget_bytes`` the node's
    memory budget for everything under ``mem_root``; ``events`` the store whose event log
    records what replication did (default: ``own``), or ``on_event(event, **fields)`` to
    record them elsewhere (the manager: the run's event log, tagged with the rank).

    A rank that finds no buddy (one node only, or a buddy node with fewer ranks) warns
    once with the reason (:attr:`no_buddy`) and logs a ``replica_no_buddy`` event: its
    memory checkpoints are then in its own node's memory only.
    """

    def __init__(
        self,
        own: Store | str | os.PathLike[str],
        mem_root: str | os.PathLike[str],
        *,
        buddy_nodes: Mapping[str, str] | None = None,
        budget_bytes: int | None = None,
        events: Store | None = None,
        on_event: Callable[..., None] | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise StepvaultError(
                "replication needs a torch.distributed process group: call "
                "dist.init_process_group first (one node has no peer to replicate to)"
            )
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.own = Store.open(own, create=True, defaults=DEFAULT_STORE_SETTINGS)
        #: where the run's fence records are (``(hot store, run)``): the replicas held
        #: here obey the fence rule as the own copies do (FORMAT.md §8); set by the manager
        self.fence_source: tuple[Store, str] | None = None
        self.mem_root = Path(mem_root)
        self.budget_bytes = budget_bytes
        self.events = events or self.own
        self._on_event = on_event
        self.rank = dist.get_rank()
        self.layout: NodeLayout = discover_layout()
        buddies = self.layout.buddies(buddy_nodes)
        self.buddy: int | None = buddies.get(self.rank)
        self.source: int | None = next((s for s, b in buddies.items() if b == self.rank), None)
        self._buddies = buddies
        #: why this rank has no buddy (None: it has one)
        self.no_buddy: str | None = (
            None if self.buddy is not None else self.layout.no_buddy_reason(self.rank, buddy_nodes)
        )
        #: the newest replica this rank received for its source rank (see :meth:`status`)
        self.last_received: dict[str, Any] | None = None
        self._queued_at: dict[int, float] = {}  # step -> when this rank queued it
        with contextlib.suppress(OSError):  # a reservation a killed predecessor left behind
            self._reservation().unlink()
        # Created on every rank in the same order (new_group is collective).
        self.group = dist.new_group(backend="gloo")
        self.link = Link(self.group)
        self.reports: list[Received] = []
        self.last_error: BaseException | None = None
        self._lock = threading.Lock()  # one transfer at a time; a restore takes it too
        self._queue: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._loop, name="stepvault-replication", daemon=True
        )
        self._thread.start()
        self._closed = False

    def _event(self, run: str, event: str, **fields: Any) -> None:
        """Record what replication did (never breaks training)."""
        with contextlib.suppress(Exception):
            if self._on_event is not None:
                self._on_event(event, **fields)
            else:
                log_event(self.events, run, event, **fields)

    def announce(self, run: str) -> None:
        """Warn and log once when this rank has no buddy: its memory checkpoints then live
        only in its own node's memory (a lost node loses them)."""
        if self.no_buddy is None:
            return
        warnings.warn(
            f"stepvault: MemOptions(replicate=True) found no buddy for rank {self.rank} of "
            f"run {run!r}, so its memory checkpoints are not replicated: {self.no_buddy}",
            RuntimeWarning,
            stacklevel=3,
        )
        self._event(rank_run(run, self.rank), "replica_no_buddy", reason=self.no_buddy)

    # -- layout ---------------------------------------------------------------------------
    def buddy_of(self, rank: int) -> int | None:
        """The rank that keeps ``rank``'s replicas."""
        return self._buddies.get(rank)

    def peer_store(self, rank: int, *, create: bool = True) -> Store | None:
        """The store under ``peers/`` that holds the replicas of ``rank``."""
        node, local = self.layout.nodes[rank], self.layout.local_ranks[rank]
        root = self.mem_root / "peers" / _safe(node) / f"rank{local}"
        if not create and not root.exists():
            return None
        store = Store.open(root, create=True, defaults=DEFAULT_STORE_SETTINGS)
        store.fence_source = self.fence_source
        return store

    # -- saving side ------------------------------------------------------------------------
    def replicate(self, run: str, step: int) -> None:
        """Queue this rank's ``rank_run(run, rank)@step`` of the own store for the buddy.

        Every rank calls it for the same ``run``/``step``, in the same order (after the
        collective save that committed them)."""
        self._queued_at[step] = time.time()
        self._queue.put((run, step))

    @property
    def pending(self) -> int:
        """Replications queued or running on this rank."""
        return self._queue.unfinished_tasks

    def wait(self) -> None:
        """Block until every queued replication has finished (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued replications and stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def release(self) -> None:
        """Destroy the replication group (after :meth:`close` and any last collective on
        it): a gloo group left to the interpreter's exit can abort the process there."""
        self.close()
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            with contextlib.suppress(ValueError, RuntimeError):  # already destroyed
                dist.destroy_process_group(group)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._replicate_one(*job)
            except BaseException as exc:  # kept, reported; training is never interrupted
                self.last_error = exc
                if job is not None:
                    self.last_received = {
                        "step": job[1],
                        "state": "failed",
                        "reason": f"{type(exc).__name__}: {exc}",
                        "at": time.time(),
                    }
                    self._event(
                        rank_run(job[0], self.rank),
                        "replica_failed",
                        step=job[1],
                        error=f"{type(exc).__name__}: {exc}",
                    )
            finally:
                self._queue.task_done()

    def _replicate_one(self, run: str, step: int) -> None:
        with self._lock:
            mine = rank_run(run, self.rank)
            offer = make_offer(self.own, mine, step, held=True) if self.buddy is not None else None
            target = self.peer_store(self.source) if self.source is not None else None
            try:
                got = transfer(
                    self.link,
                    send_to=self.buddy,
                    offer=offer,
                    source=self.own,
                    recv_from=self.source,
                    target=target,
                    prepare=self._prepare(target) if target is not None else None,
                )
            finally:
                with contextlib.suppress(OSError):
                    self._reservation().unlink()
        if got is None:
            return
        self.reports.append(got)
        now = time.time()
        queued = self._queued_at.pop(step, None)
        fields: dict[str, Any] = {
            "step": got.step,
            "source_rank": self.source,
            "objects": got.objects,
            "bytes": got.bytes,
            "seconds": round(got.seconds, 6),
        }
        if queued is not None:  # behind the commit into memory (queued right after it)
            fields["lag_seconds"] = round(now - queued, 6)
        self.last_received = {
            "step": got.step,
            "state": "replicated" if got.committed else "skipped",
            "reason": got.skipped,
            "lag_seconds": fields.get("lag_seconds"),
            "at": now,
        }
        if got.committed:
            self._event(got.run, "replica", **fields)
        else:
            self._event(got.run, "replica_skipped", reason=got.skipped, **fields)

    def status(self) -> list[dict[str, Any]]:
        """Collective (after :meth:`wait`): every rank's replica state, by rank: its buddy
        and the newest replica of it that the buddy received (``state``: "replicated",
        "skipped" or "failed", with the ``reason``; "none" before any; "no buddy" with
        the reason)."""
        gathered: list[Any] = [None] * dist.get_world_size()
        mine = {"received": self.last_received, "no_buddy": self.no_buddy}
        dist.all_gather_object(gathered, mine, group=self.group)
        out: list[dict[str, Any]] = []
        for rank, doc in enumerate(gathered):
            buddy = self.buddy_of(rank)
            if buddy is None:
                out.append(
                    {"rank": rank, "buddy": None, "state": "no buddy", "reason": doc["no_buddy"]}
                )
                continue
            got = gathered[buddy]["received"] or {"state": "none"}
            out.append({"rank": rank, "buddy": buddy, **got})
        return out

    def _prepare(self, target: Store):
        def prepare(offer: Offer) -> tuple[list[str], str | None]:
            if offer.held is not None:
                self._evict(target, offer.run, keep=set(offer.held) | {offer.step})
            need = [d for d in offer.sizes if not target.has_object(d)]
            if self.budget_bytes is not None:
                adding = sum(offer.sizes[d] for d in need) + len(offer.manifest)
                # The check and the reservation happen under a node-wide lock; the lock is
                # not held during the transfer (the node's other ranks transfer meanwhile,
                # and waiting for them would deadlock the ring).
                with self._budget_lock():
                    used = tree_bytes(self.mem_root) + self._reserved_by_others()
                    if used + adding > self.budget_bytes:
                        return [], (
                            f"replica of {offer.run}@{offer.step} needs {adding} bytes; "
                            f"{used} of the node's memory budget of {self.budget_bytes} "
                            "are used"
                        )
                    self._reservation().write_text(str(adding))
            return need, None

        return prepare

    def _evict(self, target: Store, run: str, keep: set[int]) -> None:
        gone = [s for s in target.list_steps(run) if s not in keep]
        for s in gone:  # manifests first, then their objects (the order of any deletion)
            target.delete_manifest(run, s)
        if gone:
            # This thread is the only writer of this peer store, and no transfer into it is
            # in flight: no grace period is needed.
            sweep(target, grace_seconds=0)
            self._event(run, "replica_evicted", steps=gone, source_rank=self.source)

    def _reservation(self) -> Path:
        return self.mem_root / "peers" / ".reserved" / f"rank{self.rank}"

    def _reserved_by_others(self) -> int:
        """Bytes other ranks of this node reserved for replicas they are receiving."""
        total = 0
        folder = self._reservation().parent
        folder.mkdir(parents=True, exist_ok=True)
        for path in folder.iterdir():
            if path != self._reservation():
                with contextlib.suppress(OSError, ValueError):
                    total += int(path.read_text())
        return total

    @contextlib.contextmanager
    def _budget_lock(self) -> Iterator[None]:
        """Serialise the budget check and the write among the node's receiving ranks."""
        path = self.mem_root / "peers" / ".budget.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- restoring side -----------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold off background transfers (a restore uses the group meanwhile)."""
        with self._lock:
            yield

    def holdings(self, run: str) -> list[dict[str, Any]]:
        """Collective: for every rank, its own steps of ``rank_run(run, rank)`` and the
        steps of that name its buddy holds replicas of."""
        mine_name = rank_run(run, self.rank)
        own = self.own.list_steps(mine_name)
        held: list[int] = []
        if self.source is not None:
            peer = self.peer_store(self.source, create=False)
            if peer is not None:
                held = peer.list_steps(rank_run(run, self.source))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"own": own, "held": held}, group=self.group)
        out = []
        for rank, doc in enumerate(gathered):
            buddy = self.buddy_of(rank)
            peer_steps = gathered[buddy]["held"] if buddy is not None else []
            out.append({"own": list(doc["own"]), "peer": list(peer_steps)})
        return out

    def fetch(self, run: str, step: int, needs: list[bool]) -> Received | None:
        """Collective: every rank with ``needs[rank]`` receives ``rank_run(run, rank)@step``
        from its buddy's memory into its own store (verified, committed last)."""
        offer = None
        source_store = None
        send_to = None
        if self.source is not None and needs[self.source]:
            send_to = self.source
            source_store = self.peer_store(self.source, create=False)
            name = rank_run(run, self.source)
            if source_store is None:
                offer = Offer(name, step, missing=f"no replicas of rank {self.source} here")
            else:
                offer = make_offer(source_store, name, step)
        receiving = needs[self.rank]
        if receiving and self.buddy is None:
            raise StepvaultError(f"rank {self.rank} has no buddy to fetch {run}@{step} from")
        return transfer(
            self.link,
            send_to=send_to,
            offer=offer,
            source=source_store,
            recv_from=self.buddy if receiving else None,
            target=self.own if receiving else None,
        )

    def all_ok(self, ok: bool) -> bool:
        """Collective: whether every rank reports ``ok``."""
        return all(self.gather(ok))

    def gather(self, flag: bool) -> list[bool]:
        """Collective: every rank's ``flag``, by rank (on the replication group)."""
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, bool(flag), group=self.group)
        return [bool(g) for g in gathered]


def _safe(node: str) -> str:
    """A node id as one path component."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in node) or "node"


__all__ = ["Replicator", "rank_run", "tree_bytes"]
