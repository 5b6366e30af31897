"""Garbage collection as an operation: apply a keep policy to a run, then sweep objects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..catalog import apply_retention, checkpoint_records
from ..engine.gc import DEFAULT_GRACE_SECONDS, SweepReport, sweep
from ..policy import KeepPolicy, RetentionPlan
from ..store import Store
from ..store.lease import acquire_lease


@dataclass
class GCResult:
    run: str | None
    plan: RetentionPlan | None
    sweep: SweepReport

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
            "tmp_files_removed": self.sweep.tmp_files_removed,
            "unreadable_manifests": self.sweep.unreadable_manifests,
        }


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
    """
    plan = None
    if keep is not None:
        if run is None:
            raise ValueError("a keep policy applies to one run: name the run")
        leases = []
        try:
            plan = apply_retention(
                store,
                run,
                keep,
                checkpoint_records(store, run),
                dry_run=dry_run,
                sweep_objects=False,
                by="gc",
                before_delete=lambda: leases.append(acquire_lease(store, run)),
            ).plan
        finally:
            for lease in leases:
                lease.release()
    report = sweep(store, grace_seconds=grace_seconds, dry_run=dry_run, progress=progress)
    return GCResult(run, plan, report)
