"""Engine layer: the write path and the read path."""

from .reader import CheckpointReader, PendingArray, fetch_object
from .staging import HostArray, from_bytes, to_host
from .writer import WriteStats, default_workers, write_checkpoint, write_objects

__all__ = [
    "CheckpointReader",
    "HostArray",
    "PendingArray",
    "WriteStats",
    "default_workers",
    "fetch_object",
    "from_bytes",
    "to_host",
    "write_checkpoint",
    "write_objects",
]
