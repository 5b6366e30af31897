"""State layer: framework objects ↔ plain trees of tensors and safe values."""

from .apply import apply, validate
from .capture import capture, is_stateful, kind_of
from .rng import RNGState

__all__ = ["RNGState", "apply", "capture", "is_stateful", "kind_of", "validate"]
