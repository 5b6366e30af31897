"""What a save wrote and what a restore loaded, built from the committed manifest."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..format import Manifest


@dataclass(frozen=True)
class SaveInfo:
    """What one save wrote."""

    run: str
    step: int
    epoch: int | None
    #: tensor data (dtype size x elements), what the checkpoint holds before storage
    logical_bytes: int
    #: every object of the checkpoint as stored: tensors, other state, object headers,
    #: after compression (above ``logical_bytes`` for a tiny checkpoint)
    stored_bytes: int
    #: the part of ``stored_bytes`` this save wrote (objects not already in the store)
    new_bytes: int
    objects: int
    new_objects: int
    seconds: float
    kind: str = "full"

    @property
    def throughput(self) -> float:
        """Logical bytes per second of this save."""
        return self.logical_bytes / self.seconds if self.seconds > 0 else math.inf

    @classmethod
    def of_manifest(cls, m: Manifest, seconds: float, kind: str | None = None) -> SaveInfo:
        """The info of a save that committed ``m`` (a collective save: its manifest's counts)."""
        return cls(
            m.run,
            m.step,
            m.epoch,
            m.logical_bytes,
            m.stored_bytes,
            int(m.stats.get("new_bytes", 0)),
            len(m.objects),
            int(m.stats.get("new_objects", 0)),
            seconds,
            kind or m.kind,
        )


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint a restore passed over, and why (damage, never a mismatch)."""

    step: int
    reason: str


@dataclass
class RestoreInfo:
    """What a restore loaded, and which newer checkpoints it skipped and why."""

    run: str
    step: int
    epoch: int | None
    metrics: dict[str, float]
    metadata: Any
    created: float
    kind: str = "full"
    skipped: list[SkippedCheckpoint] = field(default_factory=list)
    seconds: float = 0.0
    bytes_read: int = 0
    #: the tier that served most of the bytes ("mem", "hot", a cold tier...; "peer" when a
    #: rank fetched its memory copy from its buddy node), when the
    #: restore read through a tiered view; ``tier_bytes``: bytes served per tier
    tier: str | None = None
    tier_bytes: dict[str, int] = field(default_factory=dict)
    #: a light checkpoint was restored: base + decoded deltas, not the exact values
    lossy: bool = False
    #: the full checkpoint a light one was restored on top of
    base_step: int | None = None

    @classmethod
    def of_manifest(
        cls, m: Manifest, metadata: Any, skipped: list[SkippedCheckpoint], seconds: float
    ) -> RestoreInfo:
        """The info of a restore that loaded ``m`` (``metadata`` decoded by the caller)."""
        return cls(
            run=m.run,
            step=m.step,
            epoch=m.epoch,
            metrics=dict(m.metrics),
            metadata=metadata,
            created=m.created,
            kind=m.kind,
            skipped=skipped,
            seconds=seconds,
            bytes_read=m.logical_bytes,
            lossy=m.light is not None,
            base_step=int(m.light["base_step"]) if m.light is not None else None,
        )
