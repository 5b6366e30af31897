"""Operations on a whole store: verification and usage (later: gc, tiering, import)."""

from .gc import GCResult, collect_garbage
from .usage import RunUsage, StoreUsage, store_usage, usage
from .verify import CheckpointReport, VerifyReport, verify, verify_store

__all__ = [
    "CheckpointReport",
    "GCResult",
    "RunUsage",
    "StoreUsage",
    "VerifyReport",
    "collect_garbage",
    "store_usage",
    "usage",
    "verify",
    "verify_store",
]
