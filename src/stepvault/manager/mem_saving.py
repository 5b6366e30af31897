"""Saving through the mem tier: commit into node memory first, then to disk as the policy
asks.

A save with a mem tier is written from the staged host buffers twice, on the writer
thread: first into the mem tier (tmpfs: the fastest commit, so the best recovery point
after a process crash), then, unless the policy says this step stays in memory only, into
the hot store on disk exactly as without a mem tier. Both writes share one set of chunk
digests (:class:`~stepvault.engine.writer.ChunkDigests`): each chunk is hashed once per
save, and nothing just committed is read back. Which saves go to disk:

* every save, by default (turning the mem tier on loses nothing);
* with ``CopyEvery("hot", steps=n)`` in the tier policy, every ``n``-th step (with
  ``CopyEvery("hot", minutes=m)`` one save per ``m`` minutes), plus every urgent save (a
  preemption signal: the machine may go away) and every save that does not fit the
  memory budget.

``MemLast(k)`` (``HotLast(k, tier="mem")``) keeps the ``k`` newest mem copies; the budget
evicts older ones first (those already on disk before those only in memory, each eviction
logged). On ``close()`` the newest mem checkpoint is copied to disk if it is not there,
then (``MemOptions(cleanup=True)``, the default) the mem tier is removed.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.info import SaveInfo
from ..core.write import write_manifest
from ..engine.writer import ChunkDigests
from ..errors import StepvaultError
from ..format import Manifest
from ..format.record import CheckpointRecord
from ..policy import CopyEvery, HotLast, TierAny, TierPolicy
from ..store import Store
from ..store.lease import Lease, MemoryFence
from ..tiers.mem import MemTier
from .options import MemOptions
from .session import RunSession


@dataclass(frozen=True)
class MemRun:
    """What a :class:`MemSaver` needs of the run it saves for: the hot store and run whose
    steps count as "on disk", their records, and where its events go. The manager's
    session gives one (:meth:`of`); a rank's own memory gives one whose events say the
    rank (``rank_memory.py``)."""

    store: Store
    run: str
    records: Callable[[], list[CheckpointRecord]]
    event: Callable[..., None]

    @staticmethod
    def of(session: RunSession) -> MemRun:
        return MemRun(session.store, session.run, session.records, session.event)


@dataclass(frozen=True)
class MemRules:
    """What the tier policy says about the mem tier: ``keep`` (k of ``MemLast(k)``), and
    which saves also go to disk: every ``disk_every``-th step, or one per
    ``disk_interval`` seconds (``CopyEvery("hot", steps=n | minutes=m)``); neither: all."""

    keep: int | None = None
    disk_every: int | None = None
    disk_interval: float | None = None


def mem_rules(policy: TierPolicy | None) -> MemRules:
    """The :class:`MemRules` found in ``policy``."""
    keep: int | None = None
    disk_every: int | None = None
    interval: float | None = None
    members = policy.policies if isinstance(policy, TierAny) else (policy,)
    for p in members:
        if isinstance(p, HotLast) and p.tier == "mem":
            keep = p.k if keep is None else max(keep, p.k)
        elif isinstance(p, CopyEvery) and p.tier == "hot":
            if (p.steps is not None and interval is not None) or (
                p.interval is not None and disk_every is not None
            ):
                raise ValueError(
                    "CopyEvery('hot', ...) appears with steps= and with a time interval; "
                    "give one of them (which saves also go to disk, with a mem tier)"
                )
            if p.steps is not None:
                disk_every = p.steps
            else:
                interval = p.interval
    return MemRules(keep, disk_every, interval)


def _estimate(host: dict[str, Any], chunk_size: int) -> int:
    """An upper bound of the bytes a raw save of ``host`` adds: data, object headers,
    manifest (dedup can only make it smaller)."""
    total = sum(int(a.nbytes) for a in host.values())
    chunks = len(host) + total // max(1, chunk_size) + 1
    return total + 4096 * chunks + 512 * len(host) + (64 << 10)


def fence_memory(
    mem: Store, mem_run: str, hot: Store, run: str, stamp: dict[str, Any] | None = None
) -> None:
    """Put node memory under the run's lease: every memory commit of ``mem_run`` carries
    the lease epoch (the lease held here, else ``stamp``: rank 0's, on the other ranks),
    and listings and restores of ``mem`` apply the fence rule with ``hot``'s fence records
    of ``run`` (FORMAT.md §8): a stale writer's save that lands in its node's memory after
    a takeover is never restored from there."""
    lease = hot.fences.get(run)
    if isinstance(lease, Lease):
        mem.fences[mem_run] = lease.memory_fence()
    elif stamp is not None:
        mem.fences[mem_run] = MemoryFence(stamp)
    mem.fence_source = (hot, run)


class MemSaver:
    """Writes a save into the mem tier, applies ``MemLast`` and the budget, and says
    whether the save must also go to disk."""

    def __init__(
        self,
        session: MemRun,
        mem: MemTier,
        policy: TierPolicy | None,
        *,
        cleanup: bool = True,
    ) -> None:
        self.session = session
        self.mem = mem
        fence_memory(mem.store, mem.run, session.store, session.run)
        rules = mem_rules(policy)
        self.keep, self.disk_every, self.disk_interval = (
            rules.keep,
            rules.disk_every,
            rules.disk_interval,
        )
        self.cleanup = cleanup
        #: the newest mem commit: its object table spares reading its manifest back
        self._parent: Manifest | None = None
        #: wall time of the newest save sent to disk (None: read from the hot store)
        self._last_disk: float | None = None
        self.clock: Callable[[], float] = time.time  # wall clock of the time interval

    def wants_disk(self, step: int, urgent: bool, now: float | None = None) -> bool:
        """Whether the save of ``step`` also goes to disk (see :class:`MemRules`). With a
        time interval, the first save at least that long after the newest checkpoint on
        disk does (a resumed run counts from its newest one); deciding so starts the next
        interval."""
        if urgent or (self.disk_every is None and self.disk_interval is None):
            return True
        if self.disk_every is not None:
            return step % self.disk_every == 0
        assert self.disk_interval is not None
        now = self.clock() if now is None else now
        if self._last_disk is None:
            records = self.session.records()
            self._last_disk = max((r.created for r in records), default=-math.inf)
        if now - self._last_disk < self.disk_interval:
            return False
        self._last_disk = now
        return True

    def save(
        self,
        manifest: Manifest,
        host: dict[str, Any],
        *,
        urgent: bool,
        digests: ChunkDigests | None = None,
        disk: bool = True,
    ) -> tuple[SaveInfo | None, dict[str, Any]]:
        """Commit ``manifest`` with ``host`` into the mem tier (a copy: the caller still
        writes ``manifest`` to disk); ``(info or None when it did not fit, event fields)``.

        ``digests`` are the chunk digests of ``host`` shared with the save's disk write, so
        that each chunk is hashed once per save. ``disk``: whether the save goes to disk
        when it does not reach memory (one process: always; a collective save decided it
        before, and a step due in memory only then fails), so the events say which.
        Nothing is read back from the mem store: the previous mem commit's object table is
        kept (the parent's chunks are reused without reading its manifest)."""
        s, mem = self.session, self.mem
        need = _estimate(host, int(mem.store.settings.get("chunk_size", 32 << 20)))
        with mem.lock:
            on_disk = set(s.store.list_steps(s.run))
            # What happens to a save that does not reach memory (the events say it).
            result = (
                "saved to disk only"
                if disk
                else "not saved: the step was due in node memory only, so its save fails "
                "on this rank; earlier checkpoints are intact"
            )
            if not mem.make_room(need, on_disk, log=s.event):
                s.event(
                    "mem_over_budget",
                    step=manifest.step,
                    needed_bytes=need,
                    budget=mem.budget,
                    used_bytes=mem.used_bytes(),
                    result=result,
                )
                return None, {"tier": "hot", "mem": "over budget"}
            m = copy.deepcopy(manifest)
            t0 = time.perf_counter()
            try:
                self._copy_attachments(m)
                info = write_manifest(
                    mem.store,
                    m,
                    host,
                    codec="raw",
                    overwrite=True,
                    parent=self._parent,
                    digests=digests,
                )
            except (StepvaultError, OSError) as exc:
                # A full or failing tmpfs must not cost a save due on disk: it still goes
                # there; a collective step due in memory only fails (collective_saving).
                s.event(
                    "mem_save_failed",
                    step=manifest.step,
                    error=f"{type(exc).__name__}: {exc}",
                    result=result,
                )
                error = f"{type(exc).__name__}: {exc}"
                return None, {"tier": "hot", "mem": "failed", "mem_error": error}
            seconds = time.perf_counter() - t0
            self._parent = m  # the next mem save reuses its object table
            self._keep_last(on_disk)
        return info, {"mem_seconds": seconds, "mem_bytes": mem.used_bytes()}

    def _copy_attachments(self, m: Manifest) -> None:
        """Attachment objects were written to the hot store at stage time; the mem copy of
        the checkpoint needs them too."""
        for digest in m.attachment_objects:
            if not self.mem.store.has_object(digest):
                self.mem.store.put_object(digest, [self.session.store.read_object(digest)])

    def _keep_last(self, on_disk: set[int]) -> None:
        if self.keep is None:
            return
        steps = self.mem.steps()
        for step in steps[: max(0, len(steps) - self.keep)]:
            freed = self.mem.evict(step)
            self.session.event(
                "mem_evicted",
                step=step,
                reason=f"MemLast({self.keep})",
                on_disk=step in on_disk,
                freed_bytes=freed,
            )

    def close(self) -> None:
        """The run ended normally: make sure the newest mem checkpoint is on disk, then
        (``cleanup``) remove the mem tier."""
        from ..tiers.copy import copy_checkpoint

        s, mem = self.session, self.mem
        steps = mem.steps()
        if steps and steps[-1] not in set(s.store.list_steps(s.run)):
            try:
                copy_checkpoint(mem.store, s.store, s.run, steps[-1])
                s.event("mem_flushed", step=steps[-1], reason="close: newest only in memory")
            except (StepvaultError, OSError) as exc:
                s.event("mem_flush_failed", step=steps[-1], error=f"{type(exc).__name__}: {exc}")
                return  # keep the mem tier: it holds the only copy
        if self.cleanup:
            mem.remove()
            s.event("mem_removed", path=mem.path)


def open_for_manager(store: Store, run: str, options: MemOptions) -> MemTier:
    """The mem tier of a manager writing ``run`` to ``store``, as ``options`` say."""
    from ..tiers.mem import open_mem_tier

    root = None if options.path is None else os.fsdecode(os.fspath(options.path))
    return open_mem_tier(store, run, root=root, budget=options.budget)  # type: ignore[arg-type]


def start_mem_tier(
    session: RunSession, mem: MemTier, *, owner: bool, replicated: bool, writes: bool
) -> None:
    """Claim the mem tier for this process (the lease holder, ``owner``) and reclaim stale
    mem tiers of dead jobs under the same root. Under a process group with replication the
    first rank of every node has reclaimed its node's already (``rank_memory.RankMemory``);
    a collective manager without it only reads the tier (``writes=False``), and says so."""
    from ..tiers.mem import reclaim_stale

    if owner:
        mem.claim()
    if owner and not replicated:
        try:
            for gone in reclaim_stale(mem.root):
                session.event("mem_reclaimed", path=gone.path, reason=gone.reason)
        except OSError:
            pass  # another job's directory we cannot read: left alone
    if not writes:
        session.event(
            "mem_tier_unused",
            reason="multi-rank (DCP) saves are written to the hot store; the mem tier is "
            "read by restores only (MemOptions(replicate=True) saves every rank's state)",
        )
