"""Policy interfaces: when to save, what to keep. Policies are data, not code paths: small
objects that print, compose with ``|``, and are tested and dry-run on their own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..format.record import CheckpointRecord


@dataclass(frozen=True)
class SaveContext:
    """What a save policy may look at for one step boundary."""

    step: int
    epoch: int | None
    now: float  # time.monotonic() seconds
    last_save_step: int | None = None
    last_save_time: float | None = None  # monotonic time of the last committed or started save
    #: measured cost of one save as the training loop sees it (stall for async saves), seconds
    save_cost: float | None = None
    #: total steps of the run when known (for "last step" rules)
    total_steps: int | None = None


@dataclass(frozen=True)
class SaveDecision:
    """A policy's answer: save now, which kind, why, and how."""

    kind: str = "full"  # "full" (whole state) or "weights" (modules only)
    reason: str = ""
    #: save synchronously (e.g. on a preemption signal) instead of in the background
    urgent: bool = False
    #: after the save, exit the process with this code (None: continue training)
    exit_code: int | None = None


class SavePolicy:
    """Decides at each step boundary whether to save. Compose with ``a | b``."""

    def decide(self, ctx: SaveContext) -> SaveDecision | None:
        raise NotImplementedError

    def saved(self, ctx: SaveContext, decision: SaveDecision) -> None:
        """Called after a save was started at ``ctx`` (lets stateful rules re-arm)."""

    def install(self) -> None:
        """Called once by the manager (main thread) before training (signal handlers)."""

    def uninstall(self) -> None:
        """Undo :meth:`install`."""

    def __or__(self, other: SavePolicy) -> SavePolicy:
        from .save import AnyOf

        return AnyOf(self, other)


@dataclass
class RetentionEntry:
    step: int
    keep: bool
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "keep": self.keep, "reasons": list(self.reasons)}


@dataclass
class RetentionPlan:
    """Which checkpoints survive and which rule keeps each survivor."""

    entries: list[RetentionEntry]

    @property
    def delete(self) -> list[int]:
        return [e.step for e in self.entries if not e.keep]

    @property
    def keep(self) -> list[int]:
        return [e.step for e in self.entries if e.keep]

    def to_json(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.entries]

    def __str__(self) -> str:
        lines = []
        for e in self.entries:
            verdict = "keep  " if e.keep else "delete"
            lines.append(f"{verdict} {e.step:>10}  {'; '.join(e.reasons)}")
        return "\n".join(lines)


class KeepPolicy:
    """Selects checkpoints to keep, with a reason each. Compose with ``a | b`` (union)."""

    def select(self, records: list[CheckpointRecord], now: float) -> dict[int, str]:
        """Map step -> reason for every record this rule keeps (records sorted by step)."""
        raise NotImplementedError

    def __or__(self, other: KeepPolicy) -> KeepPolicy:
        from .keep import KeepAny

        return KeepAny(self, other)
