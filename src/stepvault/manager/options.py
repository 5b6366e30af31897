"""The manager's options as typed, nested, validated objects.

:class:`~stepvault.CheckpointManager` takes the decisions most runs make as keywords
(when to save, what to keep, where, asynchronously or not, the codec) and everything else
as one :class:`ManagerOptions`, nested by concern the way Orbax nests its options:

::

    CheckpointManager("ckpts", run="exp1", keep=KeepLast(3),
                      tiers={"mem": MemOptions(budget="16GB", replicate=True)},
                      options=ManagerOptions(staging=StagingOptions(memory="8GB"),
                                             gc=GCOptions(grace_seconds=600)))

Every value is checked when its object is made, so a typo fails at construction, on the
training thread, not later in the background writer. The mem tier's options travel with
the tier (``tiers={"mem": MemOptions(...)}``), like a cold tier's URL.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .._units import parse_size
from ..core.light import LightOptions
from ..core.write import check_codec
from ..engine.gc import DEFAULT_GRACE_SECONDS
from ..policy.validate import non_negative_real, positive_int, positive_real
from ..store.lease import DEFAULT_STALE_AFTER

IfBusy = Literal["wait", "skip"]

#: A sweep starts once this many checkpoints were deleted since the last one ...
SWEEP_AFTER_DELETIONS = 8
#: ... or once the oldest deletion not swept yet is this many seconds old.
SWEEP_AFTER_SECONDS = 60.0


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        allowed = " or ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _of_type(name: str, value: object, kind: type) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a stepvault {kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class StagingOptions:
    """How an asynchronous save hands its state to the writer thread."""

    #: host memory for staging copies, bytes or a size (``"8GB"``, ``"512MiB"``); each save
    #: in flight holds one copy, so up to ``memory // state size`` (at most 4) may be in
    #: flight. None: one copy. A state larger than the budget is saved synchronously.
    memory: int | str | None = None
    #: a save due while that many are in flight: ``"wait"`` for the oldest, or ``"skip"``
    if_busy: IfBusy = "wait"

    def __post_init__(self) -> None:
        if self.memory is not None:  # stored as bytes
            object.__setattr__(self, "memory", parse_size("staging memory", self.memory))
        _choice("if_busy", self.if_busy, ("wait", "skip"))


@dataclass(frozen=True)
class GCOptions:
    """When the objects of deleted checkpoints are swept (``manager/sweeping.py``)."""

    #: unreferenced objects younger than this are never swept (a save in flight in another
    #: process may own them)
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    #: sweep once this many checkpoints were deleted since the last sweep ...
    sweep_after_deletions: int = SWEEP_AFTER_DELETIONS
    #: ... or once the oldest deletion not swept yet is this old (seconds)
    sweep_after_seconds: float = SWEEP_AFTER_SECONDS

    def __post_init__(self) -> None:
        non_negative_real("gc grace_seconds", self.grace_seconds)
        positive_int("gc sweep_after_deletions", self.sweep_after_deletions)
        positive_real("gc sweep_after_seconds", self.sweep_after_seconds)


@dataclass(frozen=True)
class LeaseOptions:
    """The run's writer lease (one writer per run, ARCHITECTURE.md invariant 6)."""

    #: seconds without a heartbeat after which another process may take the run over (a
    #: crashed writer on this host is taken over at once)
    stale_after: float = DEFAULT_STALE_AFTER

    def __post_init__(self) -> None:
        positive_real("lease stale_after", self.stale_after)


@dataclass(frozen=True)
class MemOptions:
    """The mem tier (node shared memory, read first on restore): the value of
    ``tiers={"mem": ...}``. ``tiers={"mem": True}`` is ``MemOptions()``."""

    #: a tmpfs directory (default: ``$STEPVAULT_MEM_ROOT`` or ``/dev/shm/stepvault``)
    path: str | os.PathLike[str] | None = None
    #: bytes (or a size such as ``"8GB"``) the tier may hold; None: half its tmpfs
    budget: int | str | None = None
    #: remove the tier when the manager closes normally
    cleanup: bool = True
    #: under a process group: every rank saves its own state into its node's memory,
    #: replicated to a buddy node (STORAGE.md, "The mem tier")
    replicate: bool = False

    def __post_init__(self) -> None:
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_size("mem budget", self.budget))
        if self.path is not None and not isinstance(self.path, str | os.PathLike):
            raise TypeError(f"MemOptions.path must be a directory path, got {self.path!r}")

    @staticmethod
    def of(value: object) -> MemOptions | None:
        """The options a ``tiers["mem"]`` value means (None: no mem tier)."""
        if value is None or value is False:
            return None
        if value is True:
            return MemOptions()
        if isinstance(value, MemOptions):
            return value
        if isinstance(value, str | os.PathLike):
            return MemOptions(path=value)
        raise ValueError(
            f"tiers['mem'] must be True (the default root, $STEPVAULT_MEM_ROOT or "
            f"/dev/shm/stepvault), a tmpfs directory or a MemOptions, got {value!r}"
        )


@dataclass(frozen=True)
class ManagerOptions:
    """Everything about a :class:`~stepvault.CheckpointManager` beyond its policies."""

    #: threads that hash, encode and write chunks (default: the engine's choice)
    workers: int | None = None
    #: a failed background save: ``"raise"`` it at the next call, or ``"warn"`` and go on
    on_save_error: Literal["raise", "warn"] = "raise"
    staging: StagingOptions = field(default_factory=StagingOptions)
    gc: GCOptions = field(default_factory=GCOptions)
    lease: LeaseOptions = field(default_factory=LeaseOptions)
    #: how light saves encode the state (None: the defaults of LightOptions)
    light: LightOptions | None = None
    #: ``restore("latest")`` may take a light checkpoint newer than every full one
    resume_from_light: bool = False
    #: your after-commit hooks, run after the built-in ones on the writer thread:
    #: ``hook(info: SaveInfo)``; one with ``attach(context)`` gets the run's
    #: :class:`~stepvault.manager.hooks.HookContext` at construction, one with ``close()``
    #: is closed by ``mgr.close()`` (the trackers of INTEGRATIONS.md are such hooks)
    hooks: tuple[Callable[..., Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "hooks", tuple(self.hooks))
        for hook in self.hooks:
            if not callable(hook):
                raise TypeError(f"options.hooks takes callables hook(info: SaveInfo), got {hook!r}")
        _of_type("options.staging", self.staging, StagingOptions)
        _of_type("options.gc", self.gc, GCOptions)
        _of_type("options.lease", self.lease, LeaseOptions)
        if self.light is not None:
            _of_type("options.light", self.light, LightOptions)
        _choice("on_save_error", self.on_save_error, ("raise", "warn"))
        if self.workers is not None:
            positive_int("workers", self.workers)


@dataclass(frozen=True)
class RunSettings:
    """What the manager's parts read: its keyword decisions and its options, checked."""

    options: ManagerOptions
    async_save: bool = True
    codec: str | None = None
    total_steps: int | None = None
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        _of_type("options", self.options, ManagerOptions)
        check_codec(self.codec)
        _choice("best_mode", self.best_mode, ("min", "max"))
        if self.total_steps is not None:
            positive_int("total_steps", self.total_steps)
        if self.best_metric is not None and not isinstance(self.best_metric, str):
            raise ValueError(f"best_metric must be a metric name, got {self.best_metric!r}")

    # The reads of the manager's parts, one name each.
    @property
    def workers(self) -> int | None:
        return self.options.workers

    @property
    def light(self) -> LightOptions | None:
        return self.options.light

    @property
    def gc_grace_seconds(self) -> float:
        return self.options.gc.grace_seconds

    @property
    def on_save_error(self) -> str:
        return self.options.on_save_error

    @property
    def if_busy(self) -> IfBusy:
        return self.options.staging.if_busy

    @property
    def resume_from_light(self) -> bool:
        return self.options.resume_from_light
