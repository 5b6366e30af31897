"""State layer: framework objects ↔ plain trees of tensors and safe values.

For users: :class:`RNGState` and :class:`~stepvault.state.dataloader.ResumableLoader`
(also at the top level), and ``register_type`` / ``unregister_type`` to save values of
your own types (encoded as safe JSON, never pickled)."""

from ..format.encoding import register_type, unregister_type
from .apply import apply, validate
from .capture import capture, is_stateful, kind_of
from .rng import RNGState

__all__ = [
    "RNGState",
    "apply",
    "capture",
    "is_stateful",
    "kind_of",
    "register_type",
    "unregister_type",
    "validate",
]
