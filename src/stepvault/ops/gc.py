"""Garbage collection as an operation: apply a keep policy to a run, then sweep objects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..catalog import apply_retention, checkpoint_records
from ..catalog.thinning import thinned_manifest
from ..engine.gc import DEFAULT_GRACE_SECONDS, AsIf, SweepReport, sweep
from ..format import parse_manifest
from ..policy import KeepPolicy, RetentionPlan, check_metrics_recorded
from ..store import Store
from ..store.lease import acquire_lease


@dataclass
class GCResult:
    """What ``stepvault gc`` did (or, for a dry run, would do).

    ``sweep`` counts objects: for a dry run with a keep policy, as if the checkpoints the
    plan deletes were gone and the ones it thins were thinned, so ``freed_bytes`` is what
    the real run would free now. ``sweep.kept_in_grace`` / ``kept_in_grace_bytes`` are the
    unreferenced objects younger than ``grace_seconds``: kept, since a save in flight may
    be about to reference them.
    """

    run: str | None
    plan: RetentionPlan | None
    sweep: SweepReport
    grace_seconds: float = DEFAULT_GRACE_SECONDS

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "dry_run": self.sweep.dry_run,
            "plan": self.plan.to_json() if self.plan else None,
            "deleted_checkpoints": self.plan.delete if self.plan else [],
            "thin": [t.to_json() for t in self.plan.thin] if self.plan else [],
            "deleted_objects": len(self.sweep.deleted),
            "freed_bytes": self.sweep.freed_bytes,
            "kept_in_grace": self.sweep.kept_in_grace,
            "kept_in_grace_bytes": self.sweep.kept_in_grace_bytes,
            "grace_seconds": self.grace_seconds,
            "tmp_files_removed": self.sweep.tmp_files_removed,
            "unreadable_manifests": self.sweep.unreadable_manifests,
        }


def _as_if_applied(store: Store, run: str, plan: RetentionPlan) -> AsIf:
    """What each manifest the plan changes would name afterwards: nothing for a deleted
    checkpoint, the weights' objects for a thinned one."""
    after: dict[tuple[str, int], set[str]] = {(run, step): set() for step in plan.delete}
    for entry in plan.thin:
        if not entry.thin:
            continue
        where = f"{run}@{entry.step}"
        manifest = parse_manifest(store.read_manifest(run, entry.step), where)
        thin, _ = thinned_manifest(manifest, rule=entry.reason, metrics={}, now=0.0)
        if thin is not None:
            after[(run, entry.step)] = set(thin.objects) | set(thin.attachment_objects)
    return after


def plan_gc(store: Store, run: str, keep: KeepPolicy, *, now: float | None = None) -> RetentionPlan:
    """The retention plan ``stepvault gc RUN --keep-... --dry-run`` prints: ``keep``
    applied (deleting nothing) to the checkpoints of ``run`` in ``store`` itself (the hot
    store: a checkpoint only in a cold tier is not gc's to delete), with reader and
    registry holds named. The dashboard's preview calls this very function."""
    records = checkpoint_records(store, run)
    check_metrics_recorded(keep, {m for r in records for m in r.metrics}, run)
    return apply_retention(
        store,
        run,
        keep,
        records,
        dry_run=True,
        sweep_objects=False,
        by="gc",
        now=now,
    ).plan


def collect_garbage(
    store: Store,
    *,
    run: str | None = None,
    keep: KeepPolicy | None = None,
    dry_run: bool = False,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    progress: Callable[[int, int | None], None] | None = None,
) -> GCResult:
    """Delete the checkpoints of ``run`` that ``keep`` does not keep, then sweep objects.

    Without ``keep`` only unreferenced objects (older than the grace period) are removed.
    Applying a keep policy takes the run's writer lease, so it never races a live writer.
    A dry run changes nothing and counts what the real one would delete and free: the
    objects only the checkpoints it would delete (or thin) reference, and their bytes.
    """
    plan = None
    as_if: AsIf | None = None
    if keep is not None:
        if run is None:
            raise ValueError("a keep policy applies to one run: name the run")
        leases = []
        records = checkpoint_records(store, run)
        # A typo in a best-by metric keeps nothing by that rule: refused before anything
        # is deleted (the newest would be all that stays).
        check_metrics_recorded(keep, {m for r in records for m in r.metrics}, run)
        try:
            plan = (
                plan_gc(store, run, keep)
                if dry_run
                else apply_retention(
                    store,
                    run,
                    keep,
                    records,
                    dry_run=dry_run,
                    sweep_objects=False,
                    by="gc",
                    before_delete=lambda: leases.append(acquire_lease(store, run)),
                ).plan
            )
        finally:
            for lease in leases:
                lease.release()
        if dry_run:
            as_if = _as_if_applied(store, run, plan)
    report = sweep(
        store, grace_seconds=grace_seconds, dry_run=dry_run, progress=progress, as_if=as_if
    )
    return GCResult(run, plan, report, grace_seconds)
