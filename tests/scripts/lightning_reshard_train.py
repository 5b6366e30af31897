"""The ``ModelParallelStrategy`` (FSDP2) job of ``lightning_sharded_train.py`` on any number of
CPU processes, for the resharding test in tests/test_sharded_lightning.py: a checkpoint
written by 2 ranks resumed by 4 (torch.distributed.checkpoint reshards on restore).

    python lightning_reshard_train.py --root DIR --devices 4 --max-steps 10

Rank 0 prints ``RESTORED <digest>`` at the start of training (after a resume: a hash of the
full, gathered weights and AdamW state as restored), ``RESUMED <step>`` / ``FRESH``,
``FINAL <digest>`` and ``WEIGHTS <digest>`` at the end, and ``LOSS <value>`` of the last
step.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_sharded_train import Data, Sharded, digest, weights_digest

from stepvault import Every, KeepLast
from stepvault.integrations.lightning import StepvaultCheckpoint


class Report(pl.Callback):
    """Rank 0 prints the digest of the state training starts from, and the last loss."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = digest(trainer.strategy.model, trainer.optimizers[0])  # collective
        if trainer.is_global_zero:
            print(f"RESTORED {state} at {trainer.global_step}", flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if trainer.is_global_zero and loss is not None:
            print(f"LOSS {float(loss)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run", default="reshard")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=4)
    args = p.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    strategy = ModelParallelStrategy(
        data_parallel_size=args.devices, tensor_parallel_size=1, timeout=timedelta(seconds=180)
    )
    ckpt = StepvaultCheckpoint(
        args.root, run=args.run, save=Every(steps=args.save_every), keep=KeepLast(3)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=[ckpt, Report()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(Sharded(), datamodule=Data(), ckpt_path=ckpt.resume_path)
    final = digest(trainer.strategy.model, trainer.optimizers[0])
    weights = weights_digest(trainer.strategy.model)
    if trainer.is_global_zero:
        restored = ckpt.last_restore
        print(f"RESUMED {restored.step}" if restored else "FRESH", flush=True)
        print(f"FINAL {final}", flush=True)
        print(f"WEIGHTS {weights}", flush=True)


if __name__ == "__main__":
    main()
