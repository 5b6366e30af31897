"""The job of ``lightning_sharded_train.py`` under ``ModelParallelStrategy`` (FSDP2) or
``DDPStrategy``, for tests/test_sharded_reshard.py: a checkpoint written by the sharded job
resumed by the same job under DDP (the layout change a user makes to fine-tune or evaluate a
model that fits one device).

    python lightning_fsdp_to_ddp.py --root DIR --strategy ddp --max-steps 12

Rank 0 prints ``RESTORED <digest> at <step>`` at the start of training (a hash of the full
weights and AdamW state as the job starts from them), ``RESUMED <step>`` / ``FRESH``,
``FINAL <digest>`` and ``LOSS <value>`` of the last step; ``REFUSED <message>`` when the
resume is refused.
"""

from __future__ import annotations

import argparse
import math
import sys
from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning_sharded_train import Data, Sharded, digest

from stepvault import Every, KeepLast
from stepvault.errors import StepvaultError
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
            assert math.isfinite(float(loss))
            print(f"LOSS {float(loss)}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run", default="layout")
    p.add_argument("--strategy", choices=["model_parallel", "ddp"], required=True)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=4)
    args = p.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    if args.strategy == "model_parallel":
        strategy: pl.strategies.Strategy = ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=180)
        )
    else:
        strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=180))
    ckpt = StepvaultCheckpoint(
        args.root, run=args.run, save=Every(steps=args.save_every), keep=KeepLast(3)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=[ckpt, Report()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    try:
        trainer.fit(Sharded(), datamodule=Data(), ckpt_path=ckpt.resume_path)
    except StepvaultError as exc:
        if trainer.is_global_zero:
            print(f"REFUSED {exc}", flush=True)
        return 0
    final = digest(trainer.strategy.model, trainer.optimizers[0])
    if trainer.is_global_zero:
        restored = ckpt.last_restore
        print(f"RESUMED {restored.step}" if restored else "FRESH", flush=True)
        print(f"FINAL {final}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
