"""The manager's options: one frozen object, every value checked when the manager is made
(a typo in ``codec=`` fails at construction, on the training thread, not later in the
background writer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .._units import parse_size
from ..core.light import LightOptions
from ..core.write import check_codec
from ..engine.gc import DEFAULT_GRACE_SECONDS
from ..policy.validate import non_negative_real, positive_int, positive_real
from ..store.lease import DEFAULT_STALE_AFTER

IfBusy = Literal["wait", "skip"]


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        allowed = " or ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


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
    #: host memory for staging copies, in bytes (given as an int or "8GB"); None: one copy
    staging_memory: int | str | None = None
    #: the mem tier's budget, in bytes (an int or "8GB"); None: half its tmpfs
    mem_budget: int | str | None = None
    #: remove the mem tier when the manager closes normally
    mem_cleanup: bool = True
    #: how light saves encode the state (None: the defaults of LightOptions)
    light: LightOptions | None = None
    #: restore("latest") may take a light checkpoint newer than every full one
    resume_from_light: bool = False

    def __post_init__(self) -> None:
        if self.mem_budget is not None:
            object.__setattr__(self, "mem_budget", parse_size("mem_budget", self.mem_budget))
        if self.light is not None and not isinstance(self.light, LightOptions):
            raise ValueError(f"light= must be a stepvault.LightOptions, got {self.light!r}")
        if self.staging_memory is not None:  # stored as bytes
            object.__setattr__(
                self, "staging_memory", parse_size("staging_memory", self.staging_memory)
            )
        _choice("on_save_error", self.on_save_error, ("raise", "warn"))
        _choice("if_busy", self.if_busy, ("wait", "skip"))
        _choice("best_mode", self.best_mode, ("min", "max"))
        check_codec(self.codec)
        non_negative_real("gc_grace_seconds", self.gc_grace_seconds)
        positive_real("lease_stale_after", self.lease_stale_after)
        for name in ("workers", "total_steps"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.best_metric is not None and not isinstance(self.best_metric, str):
            raise ValueError(f"best_metric must be a metric name, got {self.best_metric!r}")
