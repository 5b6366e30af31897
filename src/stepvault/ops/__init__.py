"""Operations on a whole store: verification and usage (later: gc, tiering, import)."""

from .gc import GCResult, collect_garbage
from .importing import UntrustedInputError, import_dcp
from .repair import RepairReport, repair_store
from .usage import RunUsage, StoreUsage, store_usage, usage
from .verify import CheckpointReport, VerifyReport, verify, verify_store

__all__ = [
    "CheckpointReport",
    "GCResult",
    "RepairReport",
    "RunUsage",
    "StoreUsage",
    "UntrustedInputError",
    "VerifyReport",
    "collect_garbage",
    "import_dcp",
    "repair_store",
    "store_usage",
    "usage",
    "verify",
    "verify_store",
]
