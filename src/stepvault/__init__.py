"""stepvault — the checkpoint store and manager for deep-learning training.

Content-addressed, verified, pickle-free checkpoints::

    import stepvault
    state = {"model": model, "optimizer": opt, "rng": stepvault.RNGState()}
    stepvault.save("ckpts", state, run="exp1", step=100)
    info = stepvault.restore("ckpts", state, run="exp1")      # newest checkpoint that verifies

The top level holds what a training script uses; the rest is in namespaces:

- :mod:`stepvault.errors`: every exception (all derive from ``StepvaultError``);
- :mod:`stepvault.policy`: every save, keep and tier policy (the common ones are also here);
- :mod:`stepvault.ops`: operations on a store (verify, usage, gc, export, import, annotate,
  hold, ``parse_ref``/``resolve_ref``);
- :mod:`stepvault.registry`: models, versions, aliases and lineage;
- :mod:`stepvault.signing`: signing keys and signature checks;
- :mod:`stepvault.planning`: the checkpoint interval and the storage bill (``plan``);
- :mod:`stepvault.state`: state helpers and ``register_type`` for your own value types.

``"latest"`` (``restore``, ``RUN@latest``, ``Vault.checkpoint``, ``hold``,
``mgr.latest_step``) means the newest *full* checkpoint of the run: the one a plain
``restore`` resumes from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import MODULE, lazy_surface
from ._version import __version__ as __version__

# The one list of public names (name -> module, relative to this package, that defines
# it); __all__, __getattr__ and __dir__ are derived from it. Names are imported on first
# use (PEP 562): ``import stepvault`` stays cheap, so that commands which only read JSON
# (``stepvault ls``) start without torch (importing torch took ~2.5 s of the 3.7 s that
# ``stepvault ls`` took in a new process).
_PUBLIC: dict[str, str] = {
    # save, restore, read
    "save": ".api",
    "restore": ".api",
    "open": ".api",
    # the manager
    "CheckpointManager": ".manager",
    "SaveHandle": ".manager",
    "LightOptions": ".core.light",
    # what they return
    "SaveInfo": ".api",
    "RestoreInfo": ".api",
    "SkippedCheckpoint": ".api",
    "Vault": ".catalog.vault",
    "Checkpoint": ".catalog.vault",
    # state that is not a module or an optimizer
    "RNGState": ".state",
    "ResumableLoader": ".state.dataloader",
    # when to save
    "Every": ".policy",
    "OnSignal": ".policy",
    "LastStep": ".policy",
    "YoungDaly": ".policy",
    # what to keep
    "KeepLast": ".policy",
    "KeepBest": ".policy",
    "KeepEvery": ".policy",
    "KeepWithin": ".policy",
    "ThinAfter": ".policy",
    # where to keep it
    "HotLast": ".policy",
    "CopyEvery": ".policy",
    # namespaces
    "errors": MODULE,
    "ops": MODULE,
    "policy": MODULE,
    "registry": MODULE,
    "signing": MODULE,
    "planning": MODULE,
    "state": MODULE,
}

__all__, __getattr__, __dir__ = lazy_surface(__name__, _PUBLIC, globals())

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    # ("X as X" marks a re-export for checkers that cannot read the generated __all__)
    from . import errors as errors
    from . import ops as ops
    from . import planning as planning
    from . import policy as policy
    from . import registry as registry
    from . import signing as signing
    from . import state as state
    from .api import RestoreInfo as RestoreInfo
    from .api import SaveInfo as SaveInfo
    from .api import SkippedCheckpoint as SkippedCheckpoint
    from .api import open as open
    from .api import restore as restore
    from .api import save as save
    from .catalog.vault import Checkpoint as Checkpoint
    from .catalog.vault import Vault as Vault
    from .core.light import LightOptions as LightOptions
    from .manager import CheckpointManager as CheckpointManager
    from .manager import SaveHandle as SaveHandle
    from .policy import CopyEvery as CopyEvery
    from .policy import Every as Every
    from .policy import HotLast as HotLast
    from .policy import KeepBest as KeepBest
    from .policy import KeepEvery as KeepEvery
    from .policy import KeepLast as KeepLast
    from .policy import KeepWithin as KeepWithin
    from .policy import LastStep as LastStep
    from .policy import OnSignal as OnSignal
    from .policy import ThinAfter as ThinAfter
    from .policy import YoungDaly as YoungDaly
    from .state import RNGState as RNGState
    from .state.dataloader import ResumableLoader as ResumableLoader
