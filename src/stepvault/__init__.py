"""stepvault — the checkpoint store and manager for deep-learning training.

Content-addressed, verified, pickle-free checkpoints::

    import stepvault
    state = {"model": model, "optimizer": opt, "rng": stepvault.RNGState()}
    stepvault.save("ckpts", state, run="exp1", step=100)
    info = stepvault.restore("ckpts", state, run="exp1")      # newest checkpoint that verifies
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all

# The public names are imported on first use (PEP 562): ``import stepvault`` stays cheap,
# so that commands which only read JSON (``stepvault ls``) start without torch (importing
# torch took ~2.5 s of the 3.7 s that ``stepvault ls`` took in a new process).
_LAZY: dict[str, str] = {
    # name -> module (relative to this package) that defines it
    "RestoreInfo": ".api",
    "SaveInfo": ".api",
    "SkippedCheckpoint": ".api",
    "annotate": ".api",
    "open": ".api",
    "restore": ".api",
    "save": ".api",
    "register_type": ".format.encoding",
    "unregister_type": ".format.encoding",
    "Lineage": ".catalog.lineage",
    "fingerprint_files": ".catalog.lineage",
    "CheckpointManager": ".manager",
    "LightOptions": ".core.light",
    "SaveHandle": ".manager",
    "usage": ".ops",
    "verify": ".ops",
    "plan": ".planning",
    "AtSteps": ".policy",
    "Every": ".policy",
    "FirstStep": ".policy",
    "KeepBest": ".policy",
    "KeepEvery": ".policy",
    "KeepLast": ".policy",
    "KeepPeriodic": ".policy",
    "KeepPinned": ".policy",
    "KeepWithin": ".policy",
    "ThinAfter": ".policy",
    "hold": ".catalog.reader_holds",
    "LastStep": ".policy",
    "OnSignal": ".policy",
    "YoungDaly": ".policy",
    "ModelVersion": ".registry",
    "Registry": ".registry",
    "RegistryError": ".registry",
    "RNGState": ".state",
    "ResumableLoader": ".state.dataloader",
    "LeaseHeldError": ".store.lease",
    "Signer": ".store.signing",
    "Verifier": ".store.signing",
    "Checkpoint": ".catalog.vault",
    "CheckpointSummary": ".catalog.vault",
    "Vault": ".catalog.vault",
    "parse_ref": ".catalog.vault",
}
_SUBMODULES = {"ops"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
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
    from .catalog.lineage import Lineage, fingerprint_files
    from .catalog.reader_holds import hold
    from .catalog.vault import Checkpoint, CheckpointSummary, Vault, parse_ref
    from .core.light import LightOptions
    from .format.encoding import register_type, unregister_type
    from .manager import CheckpointManager, SaveHandle
    from .ops import usage, verify
    from .planning import plan
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
        ThinAfter,
        YoungDaly,
    )
    from .registry import ModelVersion, Registry, RegistryError
    from .state import RNGState
    from .store.lease import LeaseHeldError
    from .store.signing import Signer, Verifier

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
    "LightOptions",
    "Lineage",
    "ModelVersion",
    "Registry",
    "RegistryError",
    "Signer",
    "Verifier",
    "OnSignal",
    "SaveHandle",
    "ThinAfter",
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
    "hold",
    "open",
    "ops",
    "parse_ref",
    "plan",
    "register_type",
    "restore",
    "save",
    "unregister_type",
    "usage",
    "verify",
    *_errors_all,
]
