"""The catalog: what a store holds, as records, summaries, events, annotations and
lineage, and the choices made from them (restore candidates, retention).

- :mod:`.records`: one :class:`CheckpointRecord` per committed manifest
  (:func:`checkpoint_records`) and :func:`choose_candidates` for "latest", "best" or a step;
- :mod:`.summaries`: the per-run summary cache that makes listing 10k checkpoints fast;
- :mod:`.events`: the append-only event/audit log; :mod:`.annotations`: metrics attached
  after the fact; :mod:`.lineage`: config, code, data and environment records;
- :mod:`.vault`: the read-only face over a store (``stepvault.open``);
- :mod:`.retention`: a keep policy applied (manifests first, then the object sweep).

Everything here is rebuilt from the committed manifests; nothing here is a source of truth.
Importing it does not import torch.
"""

from __future__ import annotations

from ..format.record import CheckpointRecord
from .records import Candidates, checkpoint_records, choose_candidates
from .retention import RetentionResult, apply_retention

__all__ = [
    "Candidates",
    "CheckpointRecord",
    "RetentionResult",
    "apply_retention",
    "checkpoint_records",
    "choose_candidates",
]
