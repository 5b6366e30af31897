"""stepvault — the checkpoint store and manager for deep-learning training.

Content-addressed, verified, pickle-free checkpoints::

    import stepvault
    state = {"model": model, "optimizer": opt, "rng": stepvault.RNGState()}
    stepvault.save("ckpts", state, run="exp1", step=100)
    info = stepvault.restore("ckpts", state, run="exp1")      # newest checkpoint that verifies
"""

__version__ = "0.1.0"

from . import ops
from .api import (
    RestoreInfo,
    SaveInfo,
    SkippedCheckpoint,
    annotate,
    open,
    restore,
    save,
)
from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all
from .format.encoding import register_type, unregister_type
from .lineage import Lineage, fingerprint_files
from .manager import CheckpointManager, SaveHandle
from .ops import usage, verify
from .policy import (
    AtSteps,
    Every,
    FirstStep,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPeriodic,
    KeepPinned,
    KeepWithin,
    LastStep,
    OnSignal,
    YoungDaly,
)
from .registry import ModelVersion, Registry, RegistryError
from .state import RNGState
from .store.lease import LeaseHeldError
from .store.signing import Signer, Verifier
from .vault import Checkpoint, CheckpointSummary, Vault, parse_ref

__all__ = [
    "AtSteps",
    "CheckpointManager",
    "Every",
    "FirstStep",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepPeriodic",
    "KeepPinned",
    "KeepWithin",
    "LastStep",
    "LeaseHeldError",
    "Lineage",
    "ModelVersion",
    "Registry",
    "RegistryError",
    "Signer",
    "Verifier",
    "OnSignal",
    "SaveHandle",
    "YoungDaly",
    "Checkpoint",
    "CheckpointSummary",
    "RNGState",
    "RestoreInfo",
    "SaveInfo",
    "SkippedCheckpoint",
    "Vault",
    "__version__",
    "annotate",
    "fingerprint_files",
    "open",
    "ops",
    "parse_ref",
    "register_type",
    "restore",
    "save",
    "unregister_type",
    "usage",
    "verify",
    *_errors_all,
]
