"""Model registry: versions and aliases over checkpoints, promote/rollback, lineage
(``Lineage`` and ``fingerprint_files`` describe a run's config, code and data)."""

from ..catalog.lineage import Lineage, fingerprint_files
from .lineage import lineage_report
from .models import (
    SUGGESTED_ALIASES,
    AliasMove,
    ModelVersion,
    Registry,
    RegistryError,
    validate_alias,
    validate_model_name,
)

__all__ = [
    "SUGGESTED_ALIASES",
    "AliasMove",
    "Lineage",
    "ModelVersion",
    "Registry",
    "RegistryError",
    "fingerprint_files",
    "lineage_report",
    "validate_alias",
    "validate_model_name",
]
