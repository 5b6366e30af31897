"""What every part of a manager shares: the store, the run, its options and scope, the
counters, the event log and the lineage record of this session."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..catalog import CheckpointRecord, checkpoint_records
from ..catalog.events import log_event, read_events
from ..catalog.lineage import Lineage, write_lineage
from ..errors import StepvaultError
from ..store import Store
from .options import RunSettings
from .scope import Scope
from .stats import ManagerStats


@dataclass
class RunSession:
    """One manager's view of its run (shared by its saver, restorer and hooks)."""

    store: Store  # the hot store: saves, retention, the event log
    view: Store  # every tier, hot first: restores and listings
    run: str
    options: RunSettings
    scope: Scope
    stats: ManagerStats = field(default_factory=ManagerStats)
    metrics: Any = None  # PrometheusMetrics, when exported
    lineage: Lineage | None = None
    _lineage_digest: str | None = None
    #: records read from manifests (immutable), by step: hot store and tier view
    hot_records: dict[int, CheckpointRecord] = field(default_factory=dict)
    view_records: dict[int, CheckpointRecord] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def event(self, event: str, **fields: Any) -> None:
        """Append to the run's event log (the coordinator's; never breaks training)."""
        if not self.scope.coordinator:
            return
        try:
            log_event(self.store, self.run, event, **fields)
        except OSError:
            pass

    def lineage_ref(self) -> str | None:
        """Digest of this session's lineage record, stored on first use."""
        if self.lineage is None:
            return None
        if self._lineage_digest is None:
            self._lineage_digest = write_lineage(self.store, self.run, self.lineage)
        return self._lineage_digest

    def failed(self, step: int, exc: BaseException) -> None:
        """Count and log a failed save."""
        with self.stats.lock:
            self.stats.failures += 1
        if self.metrics:
            self.metrics.failed()
        self.event("save_failed", step=step, error=f"{type(exc).__name__}: {exc}")

    def peer_stopped(self, step: int, exc: BaseException) -> StepvaultError:
        """The error of a rank whose collective failed because another rank stopped: it
        names the other ranks' failures that this session's event log recorded (a failed
        save, e.g. a full disk), so every rank says why, not only the one that failed."""
        causes: list[str] = []
        try:
            for e in read_events(self.store, self.run):
                if (
                    e.get("event") in ("save_failed", "mem_save_failed")
                    and e.get("rank", 0) != self.scope.rank
                    and float(e.get("time", 0)) >= self.started
                ):
                    causes.append(
                        f"rank {e.get('rank', 0)} on {e.get('host')}: {e['event']} at step "
                        f"{e.get('step')}: {str(e.get('error')).rstrip('.')}"
                    )
        except (OSError, ValueError, TypeError):
            pass  # the log out of reach: the generic message stands
        why = "; ".join(causes[-3:]) if causes else "no failure of theirs is in the event log"
        return StepvaultError(
            f"the ranks could not agree on the save at step {step}: another rank of the job "
            f"stopped ({why}). Earlier checkpoints are intact: fix the cause and relaunch the "
            f"job to resume from the newest one. ({type(exc).__name__}: {exc})"
        )

    def raise_or_warn(self, exc: BaseException) -> None:
        """A failed save: raise it, or with ``on_save_error="warn"`` warn and go on."""
        if self.options.on_save_error == "warn" and isinstance(exc, Exception):
            warnings.warn(
                f"stepvault: a save of run {self.run!r} failed and training continues "
                f"(on_save_error='warn'); earlier checkpoints are intact: {exc}",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        raise exc

    def records(self) -> list[CheckpointRecord]:
        """Records of the hot store's checkpoints (pins, holds and annotations applied)."""
        return checkpoint_records(self.store, self.run, self.hot_records)

    def all_tier_records(self) -> list[CheckpointRecord]:
        """Records of every tier's checkpoints (what a restore chooses from)."""
        if self.view is self.store:
            return self.records()
        return checkpoint_records(self.view, self.run, self.view_records, protected=False)

    def forget(self, step: int) -> None:
        """Drop cached records of ``step`` (re-committed, deleted or found damaged)."""
        self.hot_records.pop(step, None)
        self.view_records.pop(step, None)
