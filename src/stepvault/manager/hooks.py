"""After-commit hooks: what runs on the writer thread once a save is committed.

Each hook is ``hook(info: SaveInfo)``; the manager passes its list to the save pipeline.
Retention (keep policy, then GC) and the tier mover are the two built in; a new feature
that reacts to commits (a memory-tier replica, a catalog index) plugs in here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..catalog import apply_retention
from ..catalog.retention import name_registry_holds
from ..core.info import SaveInfo
from ..policy import (
    KeepAny,
    KeepBest,
    KeepPolicy,
    RetentionPlan,
    plan_retention,
    tracked_metrics,
)
from ..store import Store
from .session import RunSession
from .sweeping import Sweeper


@dataclass(frozen=True)
class HookContext:
    """What a user hook (``ManagerOptions(hooks=...)``) is given by ``attach(context)``
    when the manager is built: the run it follows and the run's event log."""

    #: the hot store the manager writes
    store: Store
    run: str
    #: ``event(kind, **fields)`` appends to the run's event log (never raises)
    event: Callable[..., None]
    #: whether this process records for the run (rank 0 under a process group)
    coordinator: bool


def attach_user_hooks(session: RunSession, hooks: tuple[Callable[..., Any], ...]) -> None:
    """Give each user hook that has ``attach`` its context (at construction)."""
    context = HookContext(session.store, session.run, session.event, session.scope.coordinator)
    for hook in hooks:
        attach = getattr(hook, "attach", None)
        if callable(attach):
            attach(context)


def close_user_hooks(hooks: tuple[Callable[..., Any], ...]) -> None:
    """``close()`` each user hook that has one; a hook's failure never fails the close."""
    for hook in hooks:
        close = getattr(hook, "close", None)
        if callable(close):
            try:
                close()
            except Exception as exc:  # a user hook must not lose the manager's shutdown
                import warnings

                warnings.warn(f"closing hook {hook!r} failed: {exc}", RuntimeWarning, stacklevel=2)


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
        self._warned: set[str] = set()

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

    def _warn_misspelt(self, records: list[Any]) -> None:
        """Warn once per metric when a best-by rule names a metric no checkpoint records
        while one with a nearly equal name is recorded: a typo keeps nothing by that rule.
        (Only then: a run may record the metric at its first evaluation, saves later.)"""
        import difflib
        import warnings

        known = {m for r in records for m in r.metrics}
        for metric, _ in tracked_metrics(self.keep):
            if metric in known or metric in self._warned:
                continue
            near = difflib.get_close_matches(metric, sorted(known), n=1)
            if near:
                self._warned.add(metric)
                warnings.warn(
                    f"KeepBest({metric!r}): no checkpoint of run {self.session.run!r} "
                    f"records {metric!r}, but they record {near[0]!r}: a typo? The rule "
                    "keeps nothing until a checkpoint records its metric",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def apply(self) -> None:
        s = self.session
        if self.keep is None:
            return
        records = s.records()
        self._warn_misspelt(records)
        result = apply_retention(
            s.store,
            s.run,
            self.keep,
            records,
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
