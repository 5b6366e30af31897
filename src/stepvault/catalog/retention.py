"""Retention applied: the one function the manager, ``stepvault gc`` and the tier mover's
deferred deletions go through. Manifests are deleted first (each checkpoint vanishes
atomically), then a mark-and-sweep removes the objects no committed checkpoint names."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..engine.gc import DEFAULT_GRACE_SECONDS, SweepReport, sweep
from ..format.record import CheckpointRecord
from ..policy import KeepPolicy, RetentionPlan, plan_retention
from ..policy.keep import PINNED_REASON
from ..store import Store
from ..store.reader_holds import live_holds
from .events import log_event
from .reader_holds import keep_held
from .thinning import apply_thinning, plan_thinning

#: ``hold(steps) -> steps that must not be deleted yet`` (the tier mover: still owed to a
#: cold tier)
Hold = Callable[[list[int]], set[int]]


@dataclass
class RetentionResult:
    """What applying a keep policy did (or, for a dry run, would do)."""

    plan: RetentionPlan
    deleted: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    sweep: SweepReport | None = None
    #: kept (only) because a reader holds them (``stepvault.ops.hold``)
    reader_held: list[int] = field(default_factory=list)
    #: thinned to weights-only by a ``ThinAfter`` rule
    thinned: list[int] = field(default_factory=list)


def apply_retention(
    store: Store,
    run: str,
    keep: KeepPolicy | None,
    records: list[CheckpointRecord],
    *,
    best_metrics: Iterable[tuple[str, str]] | None = None,
    hold: Hold | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    sweep_objects: bool | None = None,
    log: Callable[..., Any] | None = None,
    by: str | None = None,
    now: float | None = None,
    before_delete: Callable[[], Any] | None = None,
) -> RetentionResult:
    """Delete the checkpoints of ``run`` that ``keep`` does not keep, then sweep objects.

    ``records`` are the run's records (:func:`~stepvault.catalog.checkpoint_records`).
    ``hold`` may veto deletions for now (the tier mover). ``sweep_objects``: True always
    sweeps, False never, None (default) when the plan deletes something. ``log(event,
    **fields)`` records each deletion and the sweep (default: the run's event log); ``by``
    names the caller in the deletion events. ``dry_run`` deletes nothing and the sweep
    only counts. The caller holds the run's lease (the manager), or takes it in
    ``before_delete``, which runs once before the first deletion (``stepvault gc``).
    """
    log = log or (lambda event, **fields: log_event(store, run, event, **fields))
    now = time.time() if now is None else now
    plan = plan_retention(records, keep, now=now, best_metrics=best_metrics)
    name_registry_holds(store, run, plan)  # who keeps each: a registry hold is not a pin
    # Holds expire by the wall clock, whatever ``now`` a caller plans for.
    holds = live_holds(store, run, clean=not dry_run)
    result = RetentionResult(plan, reader_held=keep_held(plan, holds))
    thin = plan_thinning(store, run, records, keep, plan, now=now, holds=holds)
    delete = plan.delete
    if hold is not None and delete and not dry_run:
        owed = hold(delete)
        result.held = [s for s in delete if s in owed]
        delete = [s for s in delete if s not in owed]
    if not dry_run:
        reasons = {e.step: e.reasons for e in plan.entries}
        extra = {"by": by} if by else {}
        if (delete or thin) and before_delete is not None:
            before_delete()
        for step in delete:
            if step in live_holds(store, run, clean=False):
                continue  # a reader took a hold since the plan was made
            store.delete_manifest(run, step)  # the checkpoint vanishes atomically
            result.deleted.append(step)
            log("delete", step=step, reasons=reasons.get(step, []), **extra)
        result.thinned = apply_thinning(store, run, thin, now=now, log=log, extra=extra)
    if sweep_objects or (sweep_objects is None and (plan.delete or thin)):
        result.sweep = report = sweep(store, grace_seconds=grace_seconds, dry_run=dry_run)
        if not dry_run:
            log(
                "gc",
                deleted_objects=len(report.deleted),
                freed_bytes=report.freed_bytes,
                kept_in_grace=report.kept_in_grace,
            )
    return result


def registry_hold_reason(holders: list[str]) -> str:
    """``"held by the registry (model m v2)"`` for the holders of a registry hold (each
    ``MODEL.vN``, as registering a model version writes them)."""
    names = []
    for holder in sorted(holders):
        model, sep, number = holder.rpartition(".v")
        names.append(f"model {model} v{number}" if sep and number.isdigit() else holder)
    return f"held by the registry ({', '.join(names)})"


def name_registry_holds(store: Store, run: str, plan: RetentionPlan) -> None:
    """Say who keeps each checkpoint the registry holds: the plan's records count a hold
    as a pin (both protect), so its reason reads "pinned"; a checkpoint nobody pinned
    gets "held by the registry (model M vN)" instead, a pinned one gets both."""
    held = store.held_steps(run)
    if not held:
        return
    pinned = set(store.pinned_steps(run))
    for entry in plan.entries:
        if entry.step not in held:
            continue
        reason = registry_hold_reason(held[entry.step])
        if entry.step not in pinned and PINNED_REASON in entry.reasons:
            entry.reasons[entry.reasons.index(PINNED_REASON)] = reason
        elif reason not in entry.reasons:
            entry.reasons.append(reason)


def not_pinned_reason(store: Store, run: str, step: int) -> str:
    """Why ``unpin RUN@STEP`` has nothing to remove: no such checkpoint, held by the
    registry (which no unpin releases), or simply not pinned."""
    store.read_manifest(run, step)  # no such checkpoint: CheckpointNotFoundError says so
    holders = store.held_steps(run).get(step)
    if holders:
        return (
            f"{run}@{step} is not pinned: it is {registry_hold_reason(holders)}, which "
            "keeps every registered version; there is nothing to unpin"
        )
    pinned = ", ".join(f"@{s}" for s in store.pinned_steps(run)) or "none"
    return f"{run}@{step} is not pinned (pinned in {run}: {pinned})"
