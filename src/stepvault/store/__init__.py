"""Storage layer: bytes on a backend (no knowledge of tensors)."""

from .backend import Backend
from .local import LocalBackend
from .names import validate_run_name, validate_step
from .repository import STORE_FORMAT_VERSION, Store, backend_for

__all__ = [
    "STORE_FORMAT_VERSION",
    "Backend",
    "LocalBackend",
    "Store",
    "backend_for",
    "validate_run_name",
    "validate_step",
]
