"""The checkpoint record: the one row that listings, keep and tier policies, the catalog
and the dashboard see of one committed checkpoint (built from its manifest, or from the
run's summary cache, FORMAT.md §1)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class CheckpointRecord:
    """One committed checkpoint, as its manifest (and the catalog around it) describes it.

    The first fields are what a keep policy looks at; the sizes are what a listing shows.
    A manifest that cannot be read gives ``valid=False`` with the reason in ``error``.
    """

    step: int
    created: float  # wall-clock Unix time
    metrics: dict[str, float] = field(default_factory=dict)
    kind: str = "full"
    epoch: int | None = None
    pinned: bool = False  # a user pin or a registry hold
    valid: bool = True  # False when known damaged
    #: BLAKE3 of the manifest file: ties after-the-fact annotations to this exact checkpoint
    manifest_id: str = ""
    run: str = ""
    logical_bytes: int = 0
    stored_bytes: int = 0
    new_bytes: int = 0
    tensors: int = 0
    error: str | None = None
    #: the full checkpoint a light one is a delta against (None for other kinds)
    base_step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
