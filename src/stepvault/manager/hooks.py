"""After-commit hooks: what runs on the writer thread once a save is committed.

Each hook is ``hook(info: SaveInfo)``; the manager passes its list to the save pipeline.
Retention (keep policy, then GC) and the tier mover are the two built in; a new feature
that reacts to commits (a memory-tier replica, a catalog index) plugs in here.
"""

from __future__ import annotations

import time
from typing import Any

from ..catalog import apply_retention
from ..catalog.retention import name_registry_holds
from ..core.info import SaveInfo
from ..policy import KeepAny, KeepBest, KeepPolicy, RetentionPlan, plan_retention
from .session import RunSession
from .sweeping import Sweeper


def tracked_best(keep: KeepPolicy | None, metric: str | None, mode: str) -> list[tuple[str, str]]:
    """What "best" means: ``metric`` when given, else the metrics of every KeepBest in
    ``keep`` (the first one is the manager's "best")."""
    if metric is not None:
        return [(metric, mode)]
    found: list[tuple[str, str]] = []

    def walk(p: Any) -> None:
        if isinstance(p, KeepBest):
            found.append((p.metric, p.mode))
        elif isinstance(p, KeepAny):
            for q in p.policies:
                walk(q)

    walk(keep)
    return found


class Retention:
    """The keep policy applied after each commit (coordinator only), deletions deferred
    while the tier mover still owes a checkpoint to a cold tier."""

    def __init__(
        self,
        session: RunSession,
        keep: KeepPolicy | None,
        best: list[tuple[str, str]],
        mover: Any = None,
        sweeper: Sweeper | None = None,
    ) -> None:
        self.session = session
        self.keep = keep
        self.best = best
        self.mover = mover
        #: sweeps the deleted checkpoints' objects off the commit path (.sweeping)
        self.sweeper = sweeper

    def plan(self) -> RetentionPlan:
        """What the keep policy would delete now, and which rule (or reader hold) keeps
        each survivor; with a ``ThinAfter`` rule, what it would thin."""
        s = self.session
        if self.keep is None:
            plan = plan_retention(s.records(), None, now=time.time(), best_metrics=self.best)
            name_registry_holds(s.store, s.run, plan)  # a registry hold is not a pin
            return plan
        return apply_retention(
            s.store,
            s.run,
            self.keep,
            s.records(),
            best_metrics=self.best,
            dry_run=True,
            sweep_objects=False,
        ).plan

    def apply(self) -> None:
        s = self.session
        if self.keep is None:
            return
        result = apply_retention(
            s.store,
            s.run,
            self.keep,
            s.records(),
            best_metrics=self.best,
            hold=self.mover.hold if self.mover is not None else None,
            grace_seconds=s.options.gc_grace_seconds,
            log=s.event,
            # Manifests only: the sweep, a pass over the whole store, runs off the commit
            # path (.sweeping), or at once where no sweeper runs.
            sweep_objects=False if self.sweeper is not None else None,
        )
        for step in result.deleted + result.thinned:  # a thinned manifest is a new record
            s.forget(step)
        with s.stats.lock:
            s.stats.deleted += len(result.deleted)
            if result.sweep is not None:
                s.stats.freed_bytes += result.sweep.freed_bytes
        if self.sweeper is not None:
            self.sweeper.deleted(len(result.deleted) + len(result.thinned))

    def __call__(self, info: SaveInfo) -> None:
        if self.session.scope.coordinator:
            self.apply()  # store-only work: no collective, safe on the writer thread


class NotifyMover:
    """Wakes the tier mover after each commit (copies and evictions run on its thread)."""

    def __init__(self, mover: Any) -> None:
        self.mover = mover

    def __call__(self, info: SaveInfo) -> None:
        self.mover.notify()
