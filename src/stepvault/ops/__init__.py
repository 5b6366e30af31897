"""Operations on a whole store: verification and usage (later: gc, tiering, import)."""

from .export import ExportReport, export_weights
from .gc import GCResult, collect_garbage
from .importing import UntrustedInputError, import_dcp
from .repair import RepairReport, repair_store
from .usage import RunUsage, StoreUsage, store_usage, usage
from .verify import CheckpointReport, VerifyReport, verify, verify_store

__all__ = [
    "CheckpointReport",
    "ExportReport",
    "GCResult",
    "RepairReport",
    "RunUsage",
    "StoreUsage",
    "UntrustedInputError",
    "VerifyReport",
    "collect_garbage",
    "export_weights",
    "import_dcp",
    "repair_store",
    "store_usage",
    "usage",
    "verify",
    "verify_store",
]
