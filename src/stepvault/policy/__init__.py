"""Policies as data: when to save (:mod:`.save`), what to keep (:mod:`.keep`) and on which
storage tier (:mod:`.tier`, also exported by :mod:`stepvault.tiers`).

Small objects that print as the expression that built them, compose with ``|`` and can
be tested and dry-run on their own (design principle 7)::

    from stepvault.policy import Every, OnSignal, KeepLast, KeepBest, plan_retention

    save_policy = Every(steps=1000) | Every(minutes=30) | OnSignal()
    keep_policy = KeepLast(3) | KeepBest(2, "val_loss")
    tier_policy = HotLast(3) | CopyEvery("archive", steps=5)
"""

from .base import (
    CheckpointRecord,
    KeepPolicy,
    RetentionEntry,
    RetentionPlan,
    SaveContext,
    SaveDecision,
    SavePolicy,
    ThinEntry,
    check_metrics_recorded,
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
from .thin import ThinAfter
from .tier import (
    ArchiveProtected,
    CopyEvery,
    HotLast,
    MemLast,
    MoveAfter,
    TierAny,
    TierPlan,
    TierPolicy,
    plan_tiers,
)

__all__ = [
    "AnyOf",
    "ArchiveProtected",
    "AtSteps",
    "CheckpointRecord",
    "CopyEvery",
    "Every",
    "FirstStep",
    "HotLast",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepPeriodic",
    "KeepPinned",
    "KeepPolicy",
    "KeepWithin",
    "LastStep",
    "MemLast",
    "MoveAfter",
    "OnSignal",
    "RetentionEntry",
    "RetentionPlan",
    "SaveContext",
    "SaveDecision",
    "SavePolicy",
    "ThinAfter",
    "ThinEntry",
    "TierAny",
    "TierPlan",
    "TierPolicy",
    "YoungDaly",
    "check_metrics_recorded",
    "merge_decisions",
    "plan_retention",
    "plan_tiers",
    "tracked_metrics",
]
