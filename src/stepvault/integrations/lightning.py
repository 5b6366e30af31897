"""PyTorch Lightning: a ``Trainer`` that saves through stepvault and resumes from the newest
checkpoint that verifies.

::

    import lightning.pytorch as pl
    from stepvault import Every, KeepLast, OnSignal
    from stepvault.integrations.lightning import StepvaultCheckpoint

    ckpt = StepvaultCheckpoint("ckpts", run="exp1",
                               save=Every(steps=500) | OnSignal(), keep=KeepLast(3))
    trainer = pl.Trainer(callbacks=[ckpt], max_steps=10_000)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt.resume_path)   # None on a fresh start

``StepvaultCheckpoint`` is a Lightning ``Checkpoint`` callback (so Lightning adds no
``ModelCheckpoint`` of its own). At every optimizer-step boundary it asks its
:class:`~stepvault.CheckpointManager` whether a save is due; when one is, it calls
``trainer.save_checkpoint("stepvault:<step>")``, so Lightning builds its usual checkpoint
dict (model, optimizers, schedulers, loops, callbacks, hyperparameters, precision plugin,
datamodule, ``on_save_checkpoint`` extras) and hands it to :class:`StepvaultCheckpointIO`,
which the callback installs on the strategy at ``setup`` (wrapping the strategy's own
``CheckpointIO``, so ordinary file paths keep working). The dict is stored pickle-free:
the model's ``state_dict`` as the checkpoint's module (``stepvault export`` finds it),
everything else under ``lightning`` in stepvault's typed encoding.

Checkpoint paths understood by the plugin: ``"stepvault:latest"`` (the newest full
checkpoint that verifies, falling back past damaged ones), ``"stepvault:best"`` (by the
manager's metric) and ``"stepvault:<step>"`` (exactly that step).
"""

from __future__ import annotations

from ._common import missing_framework

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Checkpoint
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError:  # the standalone package of older installs
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
        from pytorch_lightning.callbacks import Checkpoint  # type: ignore[assignment]
        from pytorch_lightning.plugins.io import CheckpointIO  # type: ignore[assignment]
    except ImportError as exc:
        raise ImportError(missing_framework("lightning", "PyTorch Lightning", "lightning")) from exc

from ._lightning_impl import LIGHTNING_KEY, MODEL_KEY, PREFIX, CheckpointIOMixin, CheckpointMixin

__all__ = ["LIGHTNING_KEY", "MODEL_KEY", "PREFIX", "StepvaultCheckpoint", "StepvaultCheckpointIO"]


class StepvaultCheckpointIO(CheckpointIOMixin, CheckpointIO):
    __doc__ = CheckpointIOMixin.__doc__


class StepvaultCheckpoint(CheckpointMixin, Checkpoint):
    __doc__ = CheckpointMixin.__doc__
    _pl = pl
    _io_class = StepvaultCheckpointIO
