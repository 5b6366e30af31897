"""Manager layer: the CheckpointManager a training loop talks to."""

from .checkpoint_manager import CheckpointManager
from .options import ManagerOptions
from .stats import SaveHandle

__all__ = ["CheckpointManager", "ManagerOptions", "SaveHandle"]
