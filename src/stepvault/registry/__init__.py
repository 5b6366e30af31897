"""Model registry: versions and aliases over checkpoints, promote/rollback, lineage."""

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
    "ModelVersion",
    "Registry",
    "RegistryError",
    "lineage_report",
    "validate_alias",
    "validate_model_name",
]
