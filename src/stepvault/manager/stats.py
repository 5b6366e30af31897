"""What the manager counts, and the handle of a save it started."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..core.info import SaveInfo


@dataclass
class SaveHandle:
    """A save the manager started. ``result()`` waits for it and returns its SaveInfo."""

    step: int
    planned_kind: str  # the kind known when the save started (see ``kind``)
    reason: str
    stall_seconds: float
    asynchronous: bool
    _future: Future | None = None
    _info: SaveInfo | None = None

    @property
    def kind(self) -> str:
        """The kind written: once the save committed, its ``SaveInfo.kind`` (a light save
        of an asynchronous manager learns on the writer thread whether its base exists);
        before that, the kind planned when it started."""
        future = self._future
        if self._info is None and future is not None and future.done() and not future.exception():
            self._info = future.result()
        return self._info.kind if self._info is not None else self.planned_kind

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self, timeout: float | None = None) -> SaveInfo:
        """The committed save's :class:`SaveInfo` (raises the save's error, if it failed)."""
        if self._info is None and self._future is not None:
            self._info = self._future.result(timeout)
        assert self._info is not None
        return self._info


@dataclass
class ManagerStats:
    """Counters of one manager (``mgr.stats()``); updated from the writer thread too."""

    saves: int = 0
    failures: int = 0
    skipped_busy: int = 0
    stalls: list[float] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)
    new_bytes: int = 0
    logical_bytes: int = 0
    restores: int = 0
    restore_failures: int = 0
    fallbacks: int = 0
    deleted: int = 0
    freed_bytes: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def saved(self, info: SaveInfo, stall: float) -> None:
        with self.lock:
            self.saves += 1
            self.stalls.append(stall)
            self.writes.append(info.seconds)
            self.new_bytes += info.new_bytes
            self.logical_bytes += info.logical_bytes

    def restored(self, ok: bool, fallbacks: int) -> None:
        with self.lock:
            self.restores += 1
            self.restore_failures += 0 if ok else 1
            self.fallbacks += fallbacks

    def summary(
        self,
        staging_bytes: int,
        *,
        ready: bool = False,
        budget: int | None = None,
        peak: int = 0,
    ) -> dict[str, Any]:
        restores_ok = self.restores - self.restore_failures
        return {
            "saves": self.saves,
            "failures": self.failures,
            "skipped_busy": self.skipped_busy,
            "mean_stall_seconds": sum(self.stalls) / len(self.stalls) if self.stalls else 0.0,
            "max_stall_seconds": max(self.stalls, default=0.0),
            "mean_write_seconds": sum(self.writes) / len(self.writes) if self.writes else 0.0,
            "new_bytes": self.new_bytes,
            "logical_bytes": self.logical_bytes,
            "restores": self.restores,
            "restore_failures": self.restore_failures,
            "restore_success_rate": restores_ok / self.restores if self.restores else None,
            "fallbacks": self.fallbacks,
            "deleted_checkpoints": self.deleted,
            "freed_bytes": self.freed_bytes,
            "staging_bytes": staging_bytes,  # host memory held for staging now
            "staging_ready": ready,  # buffers allocated and pre-faulted for the next save
            "staging_peak_bytes": peak,
            "staging_budget_bytes": budget,  # StagingOptions.memory (None: one copy of the state)
        }
