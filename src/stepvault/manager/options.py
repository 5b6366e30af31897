"""The manager's options: one frozen object, every value checked when the manager is made
(a typo in ``codec=`` fails at construction, on the training thread, not later in the
background writer)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..core.write import check_codec
from ..engine.gc import DEFAULT_GRACE_SECONDS
from ..store.lease import DEFAULT_STALE_AFTER

IfBusy = Literal["wait", "skip"]


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        allowed = " or ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _seconds(name: str, value: float, *, positive: bool) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        need = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {need} number of seconds, got {value!r}")


def _count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


@dataclass(frozen=True)
class ManagerOptions:
    """How a :class:`~stepvault.CheckpointManager` saves, keeps and reports (see its
    docstring for each option)."""

    async_save: bool = True
    if_busy: IfBusy = "wait"
    codec: str | None = None
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"
    total_steps: int | None = None
    gc_grace_seconds: float = DEFAULT_GRACE_SECONDS
    lease_stale_after: float = DEFAULT_STALE_AFTER
    workers: int | None = None
    on_save_error: Literal["raise", "warn"] = "raise"
    collective: bool | None = None

    def __post_init__(self) -> None:
        _choice("on_save_error", self.on_save_error, ("raise", "warn"))
        _choice("if_busy", self.if_busy, ("wait", "skip"))
        _choice("best_mode", self.best_mode, ("min", "max"))
        check_codec(self.codec)
        _seconds("gc_grace_seconds", self.gc_grace_seconds, positive=False)
        _seconds("lease_stale_after", self.lease_stale_after, positive=True)
        _count("workers", self.workers)
        _count("total_steps", self.total_steps)
        if self.best_metric is not None and not isinstance(self.best_metric, str):
            raise ValueError(f"best_metric must be a metric name, got {self.best_metric!r}")
