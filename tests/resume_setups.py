"""Training setups for ``stepvault.testing.check_exact_resume`` (module level, so that the
check's fresh process can import them).

Every setup: an MLP with dropout, AdamW, a per-epoch StepLR, 64 samples in batches of 8
(8 batches per epoch) shuffled with ``generator=torch.Generator().manual_seed(5)``; the
checks resume mid-epoch 0 and train across at least two epoch boundaries.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import stepvault
from stepvault import CheckpointManager
from stepvault.state.dataloader import ResumableLoader

BATCHES_PER_EPOCH = 8
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11


def _seed() -> None:
    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )


def _loader(kind: str) -> DataLoader:
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader as cls
    else:
        cls = DataLoader
    return cls(_data(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))


# ------------------------------------------------------------------------ plain loop
def _plain(ctx, kind: str, *, wrap: bool = True, rng: bool = True) -> None:
    _seed()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = ResumableLoader(_loader(kind)) if wrap else _loader(kind)
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "loader": loader,
        "progress": {"epoch": 0, "step": 0},
    }
    if rng:
        state["rng"] = stepvault.RNGState()
    with CheckpointManager(ctx.root, ctx.run, save=ctx.save) as mgr:
        mgr.restore(state)
        progress = state["progress"]
        while progress["step"] < ctx.steps:
            for x, y in loader:
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                progress["step"] += 1
                ctx.step_done(progress["step"], (x, y))
                mgr.save(progress["step"], state, epoch=progress["epoch"])
                if progress["step"] >= ctx.steps:
                    break
            else:
                sched.step()  # per epoch
                progress["epoch"] += 1


def plain_stateful(ctx) -> None:
    _plain(ctx, "stateful")


def plain_dataloader(ctx) -> None:
    _plain(ctx, "plain")


def plain_stateful_unwrapped(ctx) -> None:
    """Broken on purpose: a bare StatefulDataLoader (torchdata reshuffles later epochs)."""
    _plain(ctx, "stateful", wrap=False)


def plain_without_rng(ctx) -> None:
    """Broken on purpose: the RNG is not in the checkpoint (dropout masks differ)."""
    _plain(ctx, "plain", rng=False)


# ------------------------------------------------------------------------- Lightning
def _lightning(ctx, kind: str, **ckpt_options) -> None:
    import lightning.pytorch as pl

    from stepvault.integrations.lightning import StepvaultCheckpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    _seed()
    pl.seed_everything(0, verbose=False)
    ckpt = StepvaultCheckpoint(ctx.root, run=ctx.run, save=ctx.save, **ckpt_options)
    trainer = pl.Trainer(
        max_steps=ctx.steps,
        deterministic=True,
        callbacks=[ckpt, ctx.lightning_callback()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), _loader(kind), ckpt_path=ckpt.resume_path)


def lightning_stateful(ctx) -> None:
    _lightning(ctx, "stateful")


def lightning_dataloader(ctx) -> None:
    _lightning(ctx, "plain")


def lightning_stateful_as_before(ctx) -> None:
    """The issue's setup without the fix (loaders not wrapped): epoch 2 reshuffled."""
    _lightning(ctx, "stateful", resumable_loaders=False)


# ------------------------------------------------------------------- HF Trainer
class _Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = _data().tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class _Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


def transformers_dataloader(ctx) -> None:
    """The Trainer builds its own shuffled DataLoader (a seeded RandomSampler) and skips
    the consumed batches on resume."""
    from transformers import TrainingArguments

    from stepvault.integrations.transformers import StepvaultCallback, StepvaultTrainer

    _seed()
    model = _Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Stepped per optimizer step by the Trainer: halves the rate at every epoch boundary.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=BATCHES_PER_EPOCH, gamma=0.5)
    ckpt = StepvaultCallback(ctx.root, run=ctx.run, save=ctx.save)
    args = TrainingArguments(
        output_dir=ctx.root + "-out",
        max_steps=ctx.steps,
        per_device_train_batch_size=8,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        logging_steps=10_000,
        disable_tqdm=True,
        seed=0,
    )
    trainer = StepvaultTrainer(
        model=model,
        args=args,
        train_dataset=_Rows(),
        optimizers=(opt, sched),
        callbacks=[ckpt, ctx.transformers_callback()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=ckpt.has_checkpoint)


# ------------------------------------------------------------------------ Accelerate
def _accelerate(ctx, kind: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from stepvault.integrations.accelerate import AcceleratorCheckpointer

    _seed()
    acc = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=kind == "stateful", use_seedable_sampler=True
        ),
    )
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, loader = acc.prepare(model, opt, _loader("plain"))
    if kind == "plain":
        # An ordinary prepared loader has no position of its own: the wrapper records it.
        loader = ResumableLoader(loader)
        acc.register_for_checkpointing(loader)
    acc.register_for_checkpointing(sched)  # stepped per epoch, outside accelerate's wrapper
    progress = {"epoch": 0, "step": 0}
    with AcceleratorCheckpointer(acc, ctx.root, run=ctx.run, save=ctx.save, extra=progress) as ckpt:
        ckpt.restore()
        while progress["step"] < ctx.steps:
            loader.set_epoch(progress["epoch"])
            for x, y in loader:
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                acc.backward(loss)
                opt.step()
                progress["step"] += 1
                ctx.step_done(progress["step"], (x, y))
                ckpt.save(progress["step"])
                if progress["step"] >= ctx.steps:
                    break
            else:
                sched.step()
                progress["epoch"] += 1


def accelerate_stateful(ctx) -> None:
    _accelerate(ctx, "stateful")


def accelerate_dataloader(ctx) -> None:
    _accelerate(ctx, "plain")
