"""Tiered storage: a hot store plus cold tiers, tier policies, the mover and the catalog.

::

    from stepvault import CheckpointManager
    from stepvault.tiers import HotLast, CopyEvery, MoveAfter, ArchiveProtected

    mgr = CheckpointManager(
        "/ssd/ckpts", run="exp1",
        tiers={"archive": "s3://bucket/ckpts"},
        tier_policy=HotLast(3) | CopyEvery("archive", steps=5) | ArchiveProtected("archive"),
    )

Each tier is a complete stepvault store; a checkpoint lives in a tier iff its manifest is
committed there. See STORAGE.md.
"""

from ..policy import (
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
from .config import HOT, TierError, Tiers, TierSpec, add_tier, read_tier_specs, remove_tier
from .copy import CopyStats, copy_checkpoint
from .mem import MEM, MemTier
from .mover import MoveReport, TierMover, apply_tier_policy
from .view import CatalogEntry, TieredView, catalog, read_view

__all__ = [
    "HOT",
    "MEM",
    "ArchiveProtected",
    "CatalogEntry",
    "CopyEvery",
    "CopyStats",
    "HotLast",
    "MemLast",
    "MemTier",
    "MoveAfter",
    "MoveReport",
    "TierAny",
    "TierError",
    "TierMover",
    "TierPlan",
    "TierPolicy",
    "TierSpec",
    "TieredView",
    "Tiers",
    "add_tier",
    "apply_tier_policy",
    "catalog",
    "copy_checkpoint",
    "plan_tiers",
    "read_tier_specs",
    "read_view",
    "remove_tier",
]
