"""The PyTorch Lightning integration for the standalone ``pytorch_lightning`` package.

Same classes and behaviour as :mod:`stepvault.integrations.lightning` (read its docs), built
on ``pytorch_lightning``'s ``Checkpoint`` and ``CheckpointIO`` so that a
``pytorch_lightning.Trainer`` accepts them::

    import pytorch_lightning as pl
    from stepvault.integrations.pytorch_lightning import StepvaultCheckpoint
"""

from __future__ import annotations

from ._common import missing_framework

try:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Checkpoint
    from pytorch_lightning.plugins.io import CheckpointIO
except ImportError as exc:
    raise ImportError(
        missing_framework("pytorch_lightning", "the pytorch_lightning package", "lightning")
        + " (or pip install pytorch-lightning)"
    ) from exc

from ._lightning_impl import LIGHTNING_KEY, MODEL_KEY, PREFIX, CheckpointIOMixin, CheckpointMixin

__all__ = ["LIGHTNING_KEY", "MODEL_KEY", "PREFIX", "StepvaultCheckpoint", "StepvaultCheckpointIO"]


class StepvaultCheckpointIO(CheckpointIOMixin, CheckpointIO):
    __doc__ = CheckpointIOMixin.__doc__


# CheckpointMixin's hooks are annotated with lightning.pytorch's classes; pytorch_lightning
# ships the same classes under its own name, so the checker sees other types.
class StepvaultCheckpoint(CheckpointMixin, Checkpoint):  # type: ignore[misc]
    __doc__ = CheckpointMixin.__doc__
    _pl = pl
    _io_class = StepvaultCheckpointIO
