"""Train a small regression model with PyTorch Lightning, checkpointing through stepvault.

    python examples/lightning_train.py --root ckpts --run lit-demo --max-steps 200

Kill it (Ctrl-C, ``kill -9``, a preemption) and run the same command again: it resumes from
the newest checkpoint that verifies and ends with the same weights, bit for bit, as a run
that was never interrupted (the last line prints their digest). Exact mid-epoch resume
needs a data loader that can save its position: torchdata's ``StatefulDataLoader``.

``--devices 2`` trains with DDP on two CPU processes (Lightning starts the second one):
rank 0 writes the checkpoints, every rank resumes from the same one, each with its own RNG.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from stepvault import Every, KeepLast, OnSignal
from stepvault.integrations.lightning import StepvaultCheckpoint


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.01, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(hidden, 1),
        )

    def setup(self, stage: str) -> None:
        # Each rank draws its own dropout masks (as it would its own augmentations): the
        # ranks' RNGs differ, and the checkpoint keeps every rank's.
        torch.manual_seed(1000 + self.global_rank)

    def training_step(self, batch, batch_idx):
        if self.hparams.step_sleep:
            time.sleep(self.hparams.step_sleep)  # lets a test kill us mid-run
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Data(pl.LightningDataModule):
    """The data, shuffled by a ``DistributedSampler`` (one replica in a single process).

    Its order in an epoch is a function of (seed, epoch) on every rank; the
    ``StatefulDataLoader`` saves how far into the epoch it is. Two details make a mid-epoch
    resume exact under DDP:

    - the sampler is ours: left to itself, Lightning wraps a shuffling loader's sampler in
      a ``DistributedSamplerWrapper`` that draws each epoch's order from the global torch
      RNG when the epoch starts, which a resumed run cannot reproduce;
    - ``set_epoch(trainer.current_epoch)`` here: when resuming mid-epoch Lightning builds
      the restored iterator before it calls ``set_epoch``, so the sampler must already
      know the epoch (the checkpoint is loaded before this hook runs).
    """

    def train_dataloader(self) -> StatefulDataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(256, 1, generator=g)
        ds = TensorDataset(x, y)
        sampler = DistributedSampler(
            ds,
            num_replicas=self.trainer.world_size,
            rank=self.trainer.global_rank,
            shuffle=True,
            seed=0,
        )
        sampler.set_epoch(self.trainer.current_epoch)
        return StatefulDataLoader(ds, batch_size=16, sampler=sampler)


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="ckpts")
    p.add_argument("--run", default="lit-demo")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--devices", type=int, default=1, help="CPU processes (DDP when > 1)")
    args = p.parse_args()

    pl.seed_everything(0, verbose=False)

    ckpt = StepvaultCheckpoint(
        args.root,
        run=args.run,
        save=Every(steps=args.save_every) | OnSignal(),  # SIGTERM: save, then exit 143
        keep=KeepLast(args.keep),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",  # gloo; rank 0 saves
        max_steps=args.max_steps,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    model = Regressor(step_sleep=args.step_sleep)
    trainer.fit(model, datamodule=Data(), ckpt_path=ckpt.resume_path)
    if trainer.is_global_zero:
        restored = ckpt.last_restore
        print(f"RESUMED {restored.step}" if restored else "FRESH", flush=True)
        print(f"FINAL {digest(model)}", flush=True)
    end_process_group()


def end_process_group() -> None:
    """Destroy the process group before exit (Lightning's DDP leaves it alive): a gloo
    group left to the interpreter's exit can abort the process after the job finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
