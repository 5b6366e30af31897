"""A sharded Lightning job holding a transformers model, for tests/test_export_frameworks.py:
2 CPU processes (gloo) started by Lightning's own launcher, a tiny GPT-2 inside a
LightningModule (``self.model``), sharded by ``ModelParallelStrategy`` (FSDP2
``fully_shard`` per block and over the whole model), saving through ``StepvaultCheckpoint``.

    python lightning_hf_export_job.py --root DIR --out LOGITS.pt

At the end every rank computes the logits of :func:`tokens` with the sharded model (eval
mode) and rank 0 writes them to ``--out``: what ``from_pretrained`` of the export must give.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from stepvault import Every
from stepvault.integrations.lightning import StepvaultCheckpoint

CONFIG = dict(
    vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
)  # fmt: skip


def tokens() -> torch.Tensor:
    """The fixed input whose logits the test compares."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=g)


class LanguageModel(pl.LightningModule):
    """What users write: a LightningModule holding a transformers model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(**CONFIG))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        dp = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=dp)
        fully_shard(self.model, mesh=dp)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run", default="lm")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, CONFIG["vocab_size"], (64, 12), generator=g))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=120)
        ),
        max_steps=args.steps,
        callbacks=[StepvaultCheckpoint(args.root, run=args.run, save=Every(steps=args.steps))],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = LanguageModel()
    trainer.fit(module, DataLoader(data, batch_size=4))
    module.eval()
    with torch.no_grad():
        logits = module.model(input_ids=tokens()).logits
    if trainer.is_global_zero:
        torch.save(logits.detach().clone(), args.out)
        print("DONE", flush=True)


if __name__ == "__main__":
    main()
