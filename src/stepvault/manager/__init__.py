"""Manager layer: the CheckpointManager a training loop talks to."""

from .checkpoint_manager import CheckpointManager, SaveHandle

__all__ = ["CheckpointManager", "SaveHandle"]
