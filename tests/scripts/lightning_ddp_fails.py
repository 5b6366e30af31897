"""A 2-process Lightning DDP job whose first save fails on rank 0 (a hyperparameter the safe
encoding refuses): every rank must stop with the error, none may wait in a collective.

    python tests/scripts/lightning_ddp_fails.py ROOT
"""

from __future__ import annotations

import pathlib
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from stepvault import Every
from stepvault.integrations.lightning import StepvaultCheckpoint


class Model(pl.LightningModule):
    def __init__(self, data_dir: pathlib.Path) -> None:
        super().__init__()
        self.save_hyperparameters()  # a Path: refused by the safe encoding at save time
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    pl.seed_everything(0, verbose=False)
    ds = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepvaultCheckpoint(sys.argv[1], run="bad", save=Every(steps=2))],
    )
    trainer.fit(Model(pathlib.Path("/data")), DataLoader(ds, batch_size=4))
    print("FINISHED", flush=True)
