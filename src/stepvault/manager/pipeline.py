"""The manager's pipeline, built once at construction and shut down in one order.

:func:`build_pipeline` turns a manager's settings into its parts, each given what it needs
when it is made (no part is wired into another afterwards):

=================  ====================================================================
part               what it does (module)
=================  ====================================================================
``session``        the store, the tier view, the run, the settings, events (.session)
``lease``          one writer per run, renewed in the background (.leasing)
``staging``        host buffers that async saves copy into (engine/staging_pool.py)
``mem`` / ``rank_mem``  the mem tier's destination: this process's state, or every
                   rank's own state with its replica (.mem_saving, .rank_memory)
``saves``          admit → stage → commit → hooks, on the writer thread (.saving)
``retention``      the keep policy after each commit; deletes manifests (.hooks)
``sweeper``        GC of deleted checkpoints' objects, off the commit path (.sweeping)
``mover``          the tier policy's copies and evictions (tiers/mover.py)
``restorer``       restores through the core's planner, memory first (.restoring)
=================  ====================================================================

:meth:`Pipeline.close` owns the shutdown order: the save in flight first, then the
mover's last pass and the retention it deferred, the mem tier (flushed, then removed),
the final sweep; whatever happens, then the lease's heartbeat, the signal handlers, the
writer's resources and the lease itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..catalog.lineage import Lineage
from ..core.write import open_store_for_writing
from ..engine.background import BackgroundWriter
from ..engine.staging_pool import StagingPool
from ..policy import KeepPolicy, SavePolicy
from ..store import Store
from ..store.signing import Signer
from ..tiers.mem import MemTier
from ..tiers.mover import TierMover
from .collective_saving import CollectiveWriter
from .hooks import NotifyMover, Retention, attach_user_hooks, close_user_hooks, tracked_best
from .leasing import LeaseKeeper
from .mem_saving import MemRun, MemSaver, open_for_manager, start_mem_tier
from .options import MemOptions, RunSettings
from .restoring import ManagerRestorer
from .saving import AfterCommit, LocalWriter, SavePipeline
from .scope import choose_scope
from .session import RunSession
from .sweeping import Sweeper


@dataclass
class Pipeline:
    """Every part a :class:`~stepvault.CheckpointManager` runs (see the module doc)."""

    session: RunSession
    policy: SavePolicy
    lease: LeaseKeeper
    staging: StagingPool
    saves: SavePipeline
    retention: Retention
    restorer: ManagerRestorer
    best: list[tuple[str, str]]
    mem_tier: MemTier | None = None
    mem: MemSaver | None = None
    rank_mem: Any = None  # a RankMemory (.rank_memory) under a group with replicate=True
    sweeper: Sweeper | None = None
    mover: TierMover | None = None
    #: ``ManagerOptions.hooks``: closed once the last save's hooks ran
    user_hooks: tuple[Any, ...] = ()

    def close(self) -> BaseException | None:
        """Shut every part down in order; returns the in-flight save's error (if any)."""
        coordinator = self.session.scope.coordinator
        error: BaseException | None = None
        try:
            error = self.saves.close()
            close_user_hooks(self.user_hooks)  # e.g. a tracker's last records, bounded
            if self.mover is not None:
                self.mover.close()  # a last pass, while this process holds the lease
                if self.retention.keep is not None and coordinator:
                    with contextlib.suppress(Exception):
                        # deletions deferred until the mover had copied those checkpoints;
                        # if it fails, the next session's first save applies it
                        self.retention.apply()
            if self.rank_mem is not None:  # collective: removed once the newest is on disk
                self.rank_mem.close()
            if self.mem is not None and coordinator:
                self.mem.close()  # newest mem copy to disk, then the tier removed
            if self.sweeper is not None:
                self.sweeper.close()  # every save is done: sweep what retention deleted
        finally:
            self.lease.stop()
            if self.sweeper is not None:
                self.sweeper.close(final=False)  # the thread stops also when close failed
            self.policy.uninstall()
            self.saves.writer.close()
            self.staging.close()
            self.lease.release()
        return error


def build_pipeline(
    root: str | os.PathLike[str] | Store,
    run: str,
    settings: RunSettings,
    *,
    policy: SavePolicy,
    keep: KeepPolicy | None,
    tiers: Mapping[str, Any] | None,
    tier_policy: Any,
    collective: bool | None,
    lineage: Lineage | None,
    signer: Signer | None,
    prometheus: Any,
) -> Pipeline:
    """Build a manager's pipeline; anything acquired is given back if a later part fails
    (a lease held by a manager that never existed would lock the run out)."""
    opts = settings.options
    scope = choose_scope(collective)
    rest = dict(tiers or {})
    mem_options = MemOptions.of(rest.pop("mem", None))
    if mem_options is not None and mem_options.replicate and not scope.collective:
        raise ValueError(
            "MemOptions(replicate=True) copies every rank's memory checkpoints to a buddy "
            "node: it needs a collective manager under an initialised process group"
        )
    store = open_store_for_writing(root)
    if signer is not None:
        store.signer = signer
    with contextlib.ExitStack() as undo:
        mem_tier = None
        if mem_options is not None:
            mem_tier = open_for_manager(store, run, mem_options)
        from ..tiers.hook import setup_tiers

        # Cold tiers (recorded in the store) and, with a tier policy, the background mover
        # (the coordinator only); restores read through the view: any tier, hot first.
        view, mover = setup_tiers(
            store,
            run,
            rest or None,
            tier_policy,
            coordinator=scope.coordinator,
            grace_seconds=opts.gc.grace_seconds,
            mem=mem_tier.store if mem_tier is not None else None,
        )
        if mover is not None:
            undo.callback(mover.close, wait=False)
        session = RunSession(store, view, run, settings, scope, lineage=lineage)
        lease = LeaseKeeper(
            scope.acquire_lease(store, run, opts.lease.stale_after),
            run,
            opts.lease.stale_after / 3,
            event=session.event,
        )
        undo.callback(lease.release)
        best = tracked_best(keep, settings.best_metric, settings.best_mode)
        staging = StagingPool(opts.staging.memory)  # type: ignore[arg-type]
        undo.callback(staging.close)
        mem, rank_mem = _mem_destinations(session, mem_tier, mem_options, tier_policy, scope)
        writer: LocalWriter | CollectiveWriter
        if scope.collective:
            writer = CollectiveWriter(session, settings.async_save, mem=rank_mem)
        else:
            writer = LocalWriter(session, staging, mem=mem)
        undo.callback(writer.close)
        if mem_tier is not None:
            start_mem_tier(
                session,
                mem_tier,
                owner=lease.lease is not None,
                replicated=rank_mem is not None,
                writes=rank_mem is not None or not scope.collective,
            )
        # Retention deletes manifests after each commit; their objects are swept off the
        # commit path, by the coordinator (the one that applies retention).
        sweeper = Sweeper(session, opts.gc) if scope.coordinator else None
        retention = Retention(session, keep, best, mover, sweeper)
        hooks: list[AfterCommit] = [retention]
        if mover is not None:
            hooks.append(NotifyMover(mover))
        attach_user_hooks(session, opts.hooks)
        hooks.extend(opts.hooks)
        background = BackgroundWriter() if settings.async_save else None
        saves = SavePipeline(session, writer, background, hooks)
        restorer = ManagerRestorer(session, best, memory=rank_mem)
        if prometheus:
            from .metrics import PrometheusMetrics

            session.metrics = PrometheusMetrics(run, None if prometheus is True else prometheus)
        policy.install()  # signal handlers: last, so that nothing after it can fail
        lease.start()
        undo.pop_all()
    return Pipeline(
        session=session,
        policy=policy,
        lease=lease,
        staging=staging,
        saves=saves,
        retention=retention,
        restorer=restorer,
        best=best,
        mem_tier=mem_tier,
        mem=mem,
        rank_mem=rank_mem,
        sweeper=sweeper,
        mover=mover,
        user_hooks=opts.hooks,
    )


def _mem_destinations(
    session: RunSession,
    mem_tier: MemTier | None,
    options: MemOptions | None,
    tier_policy: Any,
    scope: Any,
) -> tuple[MemSaver | None, Any]:
    """``(MemSaver, RankMemory)``: where saves go in node memory. One process writes its
    whole state into the tier (MemSaver); under a group with ``replicate`` every rank
    writes its own (RankMemory); a collective manager without it only reads the tier."""
    if mem_tier is None or options is None:
        return None, None
    saver = MemSaver(MemRun.of(session), mem_tier, tier_policy, cleanup=options.cleanup)
    if not scope.collective:
        return saver, None
    if not options.replicate:
        # The node's tier is read by restores; the coordinator still flushes/removes it.
        return saver, None
    from .rank_memory import RankMemory

    return saver, RankMemory(session, mem_tier, tier_policy, cleanup=options.cleanup)
