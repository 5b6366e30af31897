"""What an imported checkpoint lacks for a full resume, and the one warning about it.

An importer records the training state its source did not hold in the checkpoint's
``metadata["missing"]`` (entry -> why: a safetensors file holds weights only, a Trainer
folder without ``optimizer.pt``...). A resume that leaves such an entry with its fresh
state (``strict=False``, or a trainer integration that tolerates it) warns with
:class:`~stepvault.errors.ResumeGapWarning`, whichever path restored it — ``restore``,
``CheckpointManager.restore`` or a trainer integration — so one filter silences it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ResumeGapWarning


def recorded_gaps(metadata: Any) -> dict[str, str]:
    """``metadata["missing"]`` as entry -> why. Stores written before the key was unified
    may hold ``metadata["lacks"]`` (a list of entries, no reason): read both."""
    meta = metadata if isinstance(metadata, Mapping) else {}
    gaps: dict[str, str] = {}
    for entry in meta.get("lacks") or []:  # the older list form
        gaps[str(entry)] = "not in the source"
    recorded = meta.get("missing")
    if isinstance(recorded, Mapping):
        gaps.update({str(k): str(v) for k, v in recorded.items()})
    return gaps


def warn_resume_gaps(
    run: str, step: int, metadata: Any, absent: Iterable[str], *, stacklevel: int = 2
) -> None:
    """Warn that a resume from ``run@step`` leaves ``absent`` entries with their fresh
    state, naming why each is absent (what the import recorded) and where it came from."""
    absent = list(absent)
    if not absent:
        return
    meta = metadata if isinstance(metadata, Mapping) else {}
    why = recorded_gaps(meta)
    named = ", ".join(f"{k} ({why[k]})" if k in why else k for k in absent)
    source = meta.get("imported_from")
    warnings.warn(
        f"stepvault: {run}@{step}"
        + (f" (imported from {source})" if source else "")
        + f" holds no {named}: this resume starts "
        + ("it" if len(absent) == 1 else "them")
        + " fresh, so training does not continue exactly as the original run would",
        ResumeGapWarning,
        stacklevel=stacklevel + 1,
    )
