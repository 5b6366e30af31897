"""A sharded Lightning job for tests/test_sharded_lightning.py: 2 CPU processes (gloo)
started by Lightning's own launcher, the model sharded by ``ModelParallelStrategy``
(FSDP2 ``fully_shard`` over a 1-D mesh) or by ``FSDPStrategy`` (FSDP1, through the
test-only CPU subclass below), saving through ``StepvaultCheckpoint``.

    python lightning_sharded_train.py --root DIR --strategy model_parallel --max-steps 20

Rank 0 prints ``RESUMED <step>`` / ``FRESH`` and ``FINAL <digest>``: a hash of the full
(gathered) weights and optimizer state, so a test compares interrupted and uninterrupted
jobs. ``--native DIR`` saves with Lightning's own sharded checkpointing instead (a
``ModelCheckpoint`` every ``--save-every`` steps into DIR; ``--resume-native PATH``
resumes from one of its folders): the reference the stepvault job is held to.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from stepvault import Every, KeepLast, OnSignal
from stepvault.integrations.lightning import StepvaultCheckpoint


class CPUFSDPStrategy(FSDPStrategy):
    """TEST-ONLY: Lightning's FSDPStrategy (FSDP1) on CPU processes over gloo.

    Lightning accepts FSDPStrategy only with a CUDA accelerator and picks NCCL; torch's
    FSDP1 itself runs on CPU. Nothing of this belongs in the package: on GPUs the plain
    FSDPStrategy is what users run.
    """

    strategy_name = "cpu_fsdp_test_only"

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    def _get_process_group_backend(self) -> str:
        return "gloo"

    def setup_environment(self) -> None:
        # Lightning builds a tuple device_mesh on "cuda"; the same mesh on CPU here.
        shape = self.kwargs.pop("device_mesh", None)
        super().setup_environment()
        if shape is None:
            return  # no mesh (--no-mesh): FSDP1 over the default group
        from torch.distributed.device_mesh import init_device_mesh

        self.kwargs["device_mesh"] = init_device_mesh("cpu", shape)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # Lightning passes device_id=root_device.index (None on CPU), and FSDP1 then looks
        # for an accelerator; an explicit CPU device lets it run here.
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


class Sharded(pl.LightningModule):
    def __init__(self, width: int = 64, lr: float = 0.01, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width),
            torch.nn.Tanh(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(width, width),
            torch.nn.Tanh(),
            torch.nn.Linear(width, 1),
        )

    def configure_model(self) -> None:
        mesh = (
            self.device_mesh if isinstance(self.trainer.strategy, ModelParallelStrategy) else None
        )
        if mesh is None:
            return  # FSDPStrategy wraps the module itself
        from torch.distributed.fsdp import fully_shard

        dp = mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=dp)
        fully_shard(self.net, mesh=dp)

    def setup(self, stage: str) -> None:
        torch.manual_seed(1000 + self.global_rank)  # each rank its own dropout stream

    def training_step(self, batch, batch_idx):
        if self.hparams.step_sleep:
            time.sleep(self.hparams.step_sleep)  # lets a test kill the job mid-run
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Data(pl.LightningDataModule):
    """8 batches per rank and epoch, shuffled by our own DistributedSampler (see
    examples/lightning_train.py for why it is ours and why set_epoch is called here)."""

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


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A hash of the full weights and optimizer state (a collective call)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(model, optimizer, options=options)
    h = hashlib.sha256()
    for name in sorted(msd):
        h.update(name.encode())
        h.update(msd[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    for name in sorted(osd["state"]):
        for key in sorted(osd["state"][name]):
            value = osd["state"][name][key]
            h.update(f"{name}.{key}".encode())
            h.update(
                torch.as_tensor(value).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            )
    return h.hexdigest()[:16]


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of the full weights by name (a collective call under a process group); the
    same function of a plain module's state_dict in one process."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    msd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    h = hashlib.sha256()
    for name in sorted(msd):
        h.update(name.encode())
        h.update(msd[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="ckpts")
    p.add_argument("--run", default="sharded")
    p.add_argument("--strategy", choices=["model_parallel", "fsdp"], default="model_parallel")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--sync-saves", action="store_true", help="async_save=False")
    p.add_argument("--native", help="save with Lightning's own sharded checkpoints here")
    p.add_argument("--resume-native", help="resume from this Lightning checkpoint folder")
    p.add_argument("--no-mesh", action="store_true", help="fsdp: FSDPStrategy without device_mesh")
    p.add_argument("--sharding-strategy", default="FULL_SHARD", help="fsdp: FSDP1's strategy")
    args = p.parse_args()

    pl.seed_everything(0, verbose=False)
    if args.strategy == "model_parallel":
        strategy: pl.strategies.Strategy = ModelParallelStrategy(
            data_parallel_size=args.devices, tensor_parallel_size=1, timeout=timedelta(seconds=120)
        )
    else:
        strategy = CPUFSDPStrategy(
            state_dict_type="sharded",
            sharding_strategy=args.sharding_strategy,
            auto_wrap_policy={torch.nn.Linear},
            device_mesh=None if args.no_mesh else (args.devices,),
            timeout=timedelta(seconds=120),
        )
    callbacks: list[pl.Callback] = []
    ckpt = None
    if args.native:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.native, every_n_train_steps=args.save_every, save_top_k=-1
            )
        )
    else:
        ckpt = StepvaultCheckpoint(
            args.root,
            run=args.run,
            save=Every(steps=args.save_every) | OnSignal(),  # SIGTERM: save, exit 143
            keep=KeepLast(3),
            async_save=not args.sync_saves,
        )
        callbacks.append(ckpt)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    model = Sharded(step_sleep=args.step_sleep)
    resume = args.resume_native if args.native or args.resume_native else ckpt.resume_path
    trainer.fit(model, datamodule=Data(), ckpt_path=resume)
    final = digest(trainer.strategy.model, trainer.optimizers[0])
    weights = weights_digest(trainer.strategy.model)
    if trainer.is_global_zero:
        print(f"WEIGHTS {weights}", flush=True)
        restored = ckpt.last_restore if ckpt is not None else None
        print(f"RESUMED {restored.step}" if restored else "FRESH", flush=True)
        print(f"FINAL {final}", flush=True)


if __name__ == "__main__":
    main()
