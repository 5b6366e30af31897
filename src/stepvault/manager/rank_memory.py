"""The mem tier under a process group: every rank's own state in its node's memory,
replicated to a buddy node
(``CheckpointManager(..., tiers={"mem": MemOptions(replicate=True)})``).

At each save every rank copies its rank-local state into host memory on the training
thread (the only stall it adds; sharded DTensor state as its local shards, see
:mod:`stepvault.distributed.local_shards`), then, on the writer thread, commits it into its own mem
tier on the node (``<mem root>/<key>-<run>+rank<r>``, one :class:`~stepvault.tiers.mem.
MemTier` per rank, the part-A writer and budget) as the run ``rank_run(run, rank)``, and
queues it for the :class:`~stepvault.distributed.replication.Replicator`, whose own thread
sends it to the buddy node over its own gloo group (replicas under ``<mem root>/<key>-<run>
+peers``). The collective (DCP) save to disk runs as the tier policy asks: every save by
default, every ``n``-th with ``CopyEvery("hot", steps=n)``, plus urgent saves and any save
that some rank could not put into memory (all ranks agree, so DCP stays collective).

A restore of ``"latest"`` first asks :func:`~stepvault.core.peer_restore.
restore_from_memory` (own memory, else the buddy's; every rank the same step, verified),
never for a step older than the newest checkpoint on disk or object storage; when no such
step is in memory on every rank, the collective restore from disk runs as before. A
restore of an explicit step reads it from memory the same way when every rank can get it
there, else from disk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..catalog.events import log_event
from ..core.info import RestoreInfo, SaveInfo
from ..core.write import new_manifest
from ..distributed.host_copies import HostCopies
from ..distributed.local_shards import KINDS, SHARDS, apply_local, localize
from ..distributed.replication import Replicator, rank_run
from ..distributed.state import has_dtensor
from ..engine import to_host
from ..format import Manifest
from ..policy import SaveDecision
from ..state.snapshot import take_snapshot
from ..store.lease import Lease
from ..tiers.mem import (
    MemTier,
    mem_dir,
    open_mem_tier,
    reclaim_stale,
    remove_tier_dir,
    write_owner,
)
from .mem_saving import MemRun, MemSaver, _estimate, fence_memory
from .session import RunSession


def _copy(value: Any, buffers: dict[str, torch.Tensor], name: str, copies: HostCopies) -> Any:
    """A host copy the training thread may overwrite the source of at once, into the
    buffer of the previous save when it fits (allocating and faulting in fresh pages on
    every save costs several times the copy); recorded in ``copies`` (the DCP write of the
    same save reads these buffers too)."""
    if not isinstance(value, torch.Tensor):
        import numpy as np

        copies.arrays[name] = to_host(np.array(value, copy=True))
        return copies.arrays[name]
    src = value.detach()
    buf = buffers.get(name)
    if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
        buf = buffers[name] = torch.empty(src.shape, dtype=src.dtype, device="cpu")
    buf.copy_(src)
    return copies.add(name, src, buf)


@dataclass
class RankStaged:
    """A rank's save after its training-thread part: what the writer thread commits."""

    manifest: Manifest
    host: dict[str, Any]
    urgent: bool
    #: the host buffers of ``host`` by the live tensors they copy, and their chunk digests
    #: (shared with this save's DCP write: each chunk hashed once)
    copies: HostCopies


class RankMemory:
    """One rank's mem tier, its writer and its replicator (built on every rank: the
    replicator's set-up is collective)."""

    def __init__(
        self,
        session: RunSession,
        node_mem: MemTier,
        policy: Any,
        *,
        cleanup: bool = True,
    ) -> None:
        self.session = session
        self.rank = dist.get_rank()
        self.run = rank_run(session.run, self.rank)
        self.tier = open_mem_tier(
            session.store, self.run, root=node_mem.root, budget=node_mem.budget
        )
        # Steps on disk are the collective run's; every rank's events go to the run's log.
        self.saver = MemSaver(
            MemRun(session.store, session.run, session.records, self._event),
            self.tier,
            policy,
            cleanup=False,
        )
        # Rank 0 holds the lease: every rank stamps its memory commits with its epoch.
        lease = session.store.fences.get(session.run)
        stamp = session.scope.share(lease.stamp() if isinstance(lease, Lease) else None)
        fence_memory(self.tier.store, self.run, session.store, session.run, stamp)
        self.cleanup = cleanup
        self.node_mem = node_mem  # the node's mem tier of the run: unused under a group
        self.peers_root = mem_dir(node_mem.root, session.store, session.run) + "+peers"
        # Owned by this rank (listing and the stale rule see it; the steps on disk that
        # decide staleness are the collective run's); what a killed predecessor left
        # half-written is dropped.
        self.tier.claim(disk_run=session.run)
        # The node's memory budget: half for the replicas it holds, half for its ranks'
        # own copies (split among them), so the node's total never exceeds MemOptions.budget.
        self.replicator = Replicator(
            self.tier.store,
            self.peers_root,
            budget_bytes=max(1, node_mem.budget // 2),
            on_event=self._event,  # the run's event log, this rank's events tagged so
        )
        self.replicator.fence_source = (session.store, session.run)  # replicas: the same rule
        self.replicator.announce(session.run)  # no buddy: a warning and an event, with why
        layout = self.replicator.layout
        local = layout.nodes.count(layout.nodes[self.rank])
        self.tier.budget = node_mem.budget // (2 * local)
        #: ranks whose copy of each staged step went into memory (the save event's tier)
        self._in_memory: dict[int, list[int]] = {}
        #: by step: whether that save also goes to disk (what a failed memory write means)
        self._to_disk: dict[int, bool] = {}
        #: every rank's replica state after the last :meth:`wait_replicated`
        self.replica_status: list[dict[str, Any]] | None = None
        if layout.position(self.rank) == 0:  # the node's first rank, whatever LOCAL_RANK
            # The node's replica directory has one owner, its first rank. Every rank of
            # this job on the node has claimed its own tier before the layout was
            # gathered (collective), so the reclaim that follows never takes one of ours.
            write_owner(
                self.peers_root,
                session.store,
                session.run,
                node_mem.budget // 2,
                kind="peers",
            )
            node_mem.claim()  # the node's tier of the run (unused under a group) too
            self._reclaim_stale(node_mem.root)
        #: where each rank's last memory restore came from ("mem"/"peer"), by rank
        self.last_tiers: list[Any] = []
        self._buffers: dict[str, torch.Tensor] = {}  # host copies, reused between saves

    def _reclaim_stale(self, root: str) -> None:
        """Remove the stale mem directories of dead jobs under this node's mem root (the
        rule of :func:`~stepvault.tiers.mem.reclaim_stale`)."""
        try:
            for gone in reclaim_stale(root):
                self.saver.session.event("mem_reclaimed", path=gone.path, reason=gone.reason)
        except OSError:
            pass  # another job's directory we cannot read: left alone

    # -- saving ---------------------------------------------------------------------------
    def stage(
        self,
        step: int,
        state: Mapping[str, Any],
        decision: SaveDecision,
        *,
        epoch: int | None,
        metrics: Mapping[str, Any] | None,
        metadata: Any = None,
    ) -> tuple[RankStaged | None, bool]:
        """Training thread: copy this rank's state to host memory and make room for it;
        ``(staged or None, disk)`` where ``disk`` (the same on every rank) says whether the
        collective save to disk runs too."""
        staged: RankStaged | None = None
        try:
            kind = "weights" if decision.kind == "weights" else "full"
            source: Mapping[str, Any] = state
            copies = HostCopies()
            if has_dtensor(state):  # FSDP2 / tensor parallel: this rank's local shards
                source, dcp_state = localize(state, for_save=True)
                if kind == "full":  # the DCP write of this save writes the same dict
                    copies.dcp_state = {**dcp_state, "__stepvault_kinds__": source[KINDS]}
                if kind == "weights":
                    source[SHARDS] = {
                        k: v for k, v in source[SHARDS].items() if source[KINDS][k] == "module"
                    }
                kind = "full"  # (the localized state is plain values and tensors)
            snapshot = take_snapshot(source, kind=kind)
            # the user's metadata too: a restore from memory returns it as one from disk does
            manifest = new_manifest(
                self.run, step, snapshot, epoch=epoch, kind=kind, metrics=metrics,
                metadata=metadata,
            )  # fmt: skip
            # The previous save's commit is done (collective saves wait for it), so its
            # buffers are free; the replica is read from the mem store, not from them.
            host = {
                name: _copy(v, self._buffers, name, copies) for name, v in snapshot.arrays.items()
            }
            for gone in set(self._buffers) - set(host):
                del self._buffers[gone]
            need = _estimate(host, int(self.tier.store.settings.get("chunk_size", 32 << 20)))
            on_disk = set(self.session.store.list_steps(self.session.run))
            if self.tier.make_room(need, on_disk, log=self.saver.session.event):
                staged = RankStaged(manifest, host, decision.urgent, copies)
            else:
                self.saver.session.event(
                    "mem_over_budget",
                    step=step,
                    needed_bytes=need,
                    budget=self.tier.budget,
                    result="saved to disk by every rank",
                )
        except (TypeError, ValueError, RuntimeError, OSError) as exc:  # e.g. DTensor state
            self.saver.session.event(
                "mem_save_failed",
                step=step,
                error=f"{type(exc).__name__}: {exc}",
                result="saved to disk by every rank",  # a rank not staged: DCP writes all
            )
        # Every rank the same answer (DCP is collective): rank 0's clock decides a time
        # interval of CopyEvery("hot", minutes=m).
        everyone: list[Any] = [None] * dist.get_world_size()
        wants = self.saver.wants_disk(step, decision.urgent)
        dist.all_gather_object(everyone, (staged is not None, wants))
        disk = not all(ok for ok, _ in everyone) or bool(everyone[0][1])
        self._in_memory[step] = [r for r, (ok, _) in enumerate(everyone) if ok]
        self._to_disk[step] = disk
        return staged, disk

    def commit(
        self, step: int, staged: RankStaged | None
    ) -> tuple[SaveInfo | None, dict[str, Any]]:
        """Writer thread, every rank at every save: commit into the rank's mem tier (when
        it staged one), then queue the replica."""
        info: SaveInfo | None = None
        fields: dict[str, Any] = {}
        disk = self._to_disk.pop(step, True)
        if staged is not None:
            info, fields = self.saver.save(
                staged.manifest,
                staged.host,
                urgent=staged.urgent,
                digests=staged.copies.digests,
                disk=disk,
            )
        # The save event (rank 0's) says where every rank's copy went: "mem+hot" only when
        # every rank staged into memory; the ranks that did not are named.
        ranks = self._in_memory.pop(step, [])
        missing = [r for r in range(dist.get_world_size()) if r not in ranks]
        if info is None:
            fields.setdefault("tier", "hot")
        elif missing:
            fields["tier"] = "hot"
        if missing:
            fields["mem_missing_ranks"] = missing
        # Every rank queues every step (the replicator's transfers pair ranks in order); a
        # rank without this step in memory offers it as missing and its buddy logs the skip.
        self.replicator.replicate(self.session.run, step)
        return info, fields

    # -- restoring ------------------------------------------------------------------------
    def restore(
        self,
        state: MutableMapping[str, Any],
        newest_on_disk: int | None,
        *,
        step: int | None = None,
    ) -> RestoreInfo | None:
        """Collective: this rank's newest memory checkpoint that every rank can get (own or
        buddy memory), not older than ``newest_on_disk`` (or exactly ``step``); None:
        restore from disk."""
        from ..core.peer_restore import restore_from_memory

        self.replicator.wait()
        # Sharded state is restored into its local shards, then handed to the live objects;
        # that view is built only once a step is chosen (it initialises a fresh optimizer).
        views: list[tuple[dict[str, Any], dict[str, Any]]] = []

        def local_view() -> MutableMapping[str, Any]:
            views.append(localize(state))
            return views[-1][0]

        info = restore_from_memory(
            self.replicator,
            state,
            run=self.session.run,
            workers=self.session.options.workers,
            min_step=newest_on_disk,
            step=step,
            target=local_view if has_dtensor(state) else None,
        )
        if info is not None and views:
            apply_local(state, *views[-1])
        if info is not None:  # all ranks or none restored (they agreed on the step)
            tiers: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(tiers, info.tier, group=self.replicator.group)
            self.last_tiers = tiers
        return info

    # -- closing --------------------------------------------------------------------------
    def _event(self, event: str, **fields: Any) -> None:
        """A mem-tier or replication event of this rank, written by this rank into the run's
        event log and tagged with its rank (one O_APPEND line, or one object on an object
        store: ranks never overwrite each other's); never breaks training."""
        with contextlib.suppress(OSError):
            log_event(self.session.store, self.session.run, event, rank=self.rank, **fields)

    # -- replication state ------------------------------------------------------------------
    def wait_replicated(self) -> list[dict[str, Any]]:
        """Collective: wait until this rank's queued replications are done, then gather
        every rank's replica state (:meth:`Replicator.status`), kept for ``stats()``."""
        self.replicator.wait()
        self.replica_status = self.replicator.status()
        return self.replica_status

    def stats(self) -> dict[str, Any]:
        """This rank's replication state (no collective): its buddy, the replications
        still queued, the newest replica it holds for its source rank, and every rank's
        state as of the last ``wait(replicated=True)``."""
        rep = self.replicator
        return {
            "rank": self.rank,
            "buddy": rep.buddy,
            "no_buddy": rep.no_buddy,
            "source": rep.source,
            "pending": rep.pending,
            "received": rep.last_received,
            "ranks": self.replica_status,
        }

    def close(self) -> None:
        """Collective: finish replication; remove this rank's mem tier and its replicas
        only when every rank's newest mem checkpoint is on disk or older than the newest
        on disk (else they are kept: they hold the only copy, and a ``mem_kept`` event
        says so)."""
        try:
            self._close()
        finally:
            self.replicator.release()  # the replication group is destroyed, never left to exit

    def _close(self) -> None:
        self.replicator.wait()
        steps = self.tier.steps()
        disk = set(self.session.store.list_steps(self.session.run))
        # Memory older than the newest on disk is never restored (see restore): not needed.
        flushed = not steps or steps[-1] in disk or steps[-1] < max(disk, default=-1)
        if not self.replicator.all_ok(flushed):
            self.session.event(
                "mem_kept",
                reason="the newest memory checkpoint of some rank is not on disk: save it "
                "collectively (a forced save at the last step) before close to remove it",
            )
            self.replicator.close()
            return
        self.replicator.close()
        if self.cleanup:
            self.tier.remove()
            with contextlib.suppress(OSError):
                dist.barrier(group=self.replicator.group)  # peers' last reads are done
            remove_tier_dir(self.peers_root)  # the node's ranks share it; never half-listed
            self.node_mem.remove()  # empty: under a group only the ranks' own tiers are used
            self.session.event("mem_removed", path=self.peers_root, ranks=dist.get_world_size())


__all__ = ["RankMemory", "RankStaged"]
