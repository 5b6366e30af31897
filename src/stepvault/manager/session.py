"""What every part of a manager shares: the store, the run, its options and scope, the
counters, the event log and the lineage record of this session."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from ..catalog import CheckpointRecord, checkpoint_records
from ..catalog.events import log_event
from ..catalog.lineage import Lineage, write_lineage
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
