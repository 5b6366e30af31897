"""Engine layer: the write path and the read path.

Its names are imported on first use (PEP 562), so that reading manifests and summaries
(``stepvault ls``) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr

_LAZY = {
    "CheckpointReader": ".reader",
    "PendingArray": ".reader",
    "fetch_object": ".fetch",
    "HostArray": ".staging",
    "from_bytes": ".staging",
    "to_host": ".staging",
    "WriteStats": ".writer",
    "default_workers": ".writer",
    "write_checkpoint": ".writer",
    "write_objects": ".writer",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


if TYPE_CHECKING:
    from .fetch import fetch_object
    from .reader import CheckpointReader, PendingArray
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
