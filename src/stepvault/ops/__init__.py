"""Operations on a whole store: verification and usage (later: gc, tiering, import)."""

from .usage import RunUsage, StoreUsage, store_usage
from .verify import CheckpointReport, VerifyReport, verify_store

__all__ = [
    "CheckpointReport",
    "RunUsage",
    "StoreUsage",
    "VerifyReport",
    "store_usage",
    "verify_store",
]
