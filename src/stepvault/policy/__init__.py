"""Policies as data: when to save (:mod:`.save`) and what to keep (:mod:`.keep`).

Small objects that print as the expression that built them, compose with ``|`` and can
be tested and dry-run on their own (design principle 7)::

    from stepvault.policy import Every, OnSignal, KeepLast, KeepBest, plan_retention

    save_policy = Every(steps=1000) | Every(minutes=30) | OnSignal()
    keep_policy = KeepLast(3) | KeepBest(2, "val_loss")
"""

from .base import (
    CheckpointRecord,
    KeepPolicy,
    RetentionEntry,
    RetentionPlan,
    SaveContext,
    SaveDecision,
    SavePolicy,
)
from .keep import (
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPeriodic,
    KeepPinned,
    KeepWithin,
    plan_retention,
    tracked_metrics,
)
from .save import (
    AnyOf,
    AtSteps,
    Every,
    FirstStep,
    LastStep,
    OnSignal,
    YoungDaly,
    merge_decisions,
)

__all__ = [
    "AnyOf",
    "AtSteps",
    "CheckpointRecord",
    "Every",
    "FirstStep",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepPeriodic",
    "KeepPinned",
    "KeepPolicy",
    "KeepWithin",
    "LastStep",
    "OnSignal",
    "RetentionEntry",
    "RetentionPlan",
    "SaveContext",
    "SaveDecision",
    "SavePolicy",
    "YoungDaly",
    "merge_decisions",
    "plan_retention",
    "tracked_metrics",
]
