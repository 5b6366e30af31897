"""Distributed layer: multi-rank save/load through torch.distributed.checkpoint (DCP),
with stepvault's content-addressed, verified, pickle-free storage underneath."""

from .api import save_sharded
from .planners import SafeLoadPlanner, SafeSavePlanner
from .restoring import load_sharded
from .storage import StepvaultReader, StepvaultWriter, sharded_metadata

__all__ = [
    "SafeLoadPlanner",
    "SafeSavePlanner",
    "StepvaultReader",
    "StepvaultWriter",
    "load_sharded",
    "save_sharded",
    "sharded_metadata",
]
