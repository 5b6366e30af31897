"""Repair: take damaged checkpoints out of circulation after a deep verify.

A damaged checkpoint's manifest is moved to ``quarantine/manifests/<run>/<step>.json`` (so
``restore``, listings and keep policies stop offering it, while the evidence is kept) and
its damaged objects to ``quarantine/<hash>`` (so no later save deduplicates against
them). Healthy checkpoints sharing undamaged objects are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..catalog.events import log_event
from ..store import Store
from .verify import VerifyReport, verify_store


@dataclass
class RepairReport:
    dry_run: bool
    verify: VerifyReport
    removed: list[tuple[str, int]] = field(default_factory=list)
    quarantined_objects: list[str] = field(default_factory=list)
    #: ``"run@step" -> what protected it``, for each removed checkpoint that was pinned or
    #: held (by the model registry: its versions now name a quarantined checkpoint)
    protected: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "damaged": [c.to_json() for c in self.verify.damaged],
            "removed": [f"{r}@{s}" for r, s in self.removed],
            "quarantined_objects": self.quarantined_objects,
            "protected": self.protected,
        }


def repair_store(store: Store, *, run: str | None = None, dry_run: bool = False) -> RepairReport:
    """Deep-verify ``run`` (or every run) and quarantine what is damaged."""
    report = RepairReport(dry_run, verify_store(store, run=run, deep=True))
    for digest, problem in report.verify.bad_objects.items():
        if problem != "missing":
            report.quarantined_objects.append(digest)
            if not dry_run:
                store.quarantine_object(digest)
    for damaged in report.verify.damaged:
        report.removed.append((damaged.run, damaged.step))
        why = []
        if damaged.step in store.pinned_steps(damaged.run):
            why.append("pinned")
        why += [f"held by {h}" for h in store.held_steps(damaged.run).get(damaged.step, [])]
        if why:
            report.protected[f"{damaged.run}@{damaged.step}"] = why
        if dry_run:
            continue
        key = store.manifest_key(damaged.run, damaged.step)
        try:
            data = store.backend.read_bytes(key)
            store.backend.put_atomic(
                f"quarantine/manifests/{damaged.run}/{damaged.step}.json", [data]
            )
        except OSError:
            pass  # unreadable (e.g. a planted symlink): nothing worth keeping
        store.delete_manifest(damaged.run, damaged.step)
        log_event(store, damaged.run, "quarantine", step=damaged.step, problems=damaged.problems)
    return report
