"""A Lightning ``DeepSpeedStrategy`` job (ZeRO-2/3) for tests/test_sharded_lightning.py: 2 CPU
processes (gloo) started by Lightning's own launcher, the model and data of
``lightning_sharded_train.py``, saving through ``StepvaultCheckpoint``.

    python lightning_deepspeed_train.py --root DIR --stage 2 --max-steps 12

Rank 0 prints ``RESUMED <step>`` / ``FRESH`` and ``FINAL <digest>``: a hash of the full fp32
weights and both AdamW moments of every parameter (gathered from the ZeRO partitions), so
a test compares interrupted and uninterrupted jobs. ``--native DIR`` saves with Lightning's
own DeepSpeed checkpoints instead (a ``ModelCheckpoint`` every ``--save-every`` steps;
``--resume-native PATH`` resumes from one of its folders). ``--out PATH``: rank 0 also writes
the full fp32 weights by parameter name there (``torch.save``), for an export to compare.

TEST-ONLY PATCH: ``CPUDeepSpeedStrategy`` below. Lightning accepts DeepSpeedStrategy only with
a CUDA accelerator; DeepSpeed itself runs on CPU (``DS_ACCELERATOR=cpu``, gloo). Nothing of
it belongs in the package: on GPUs the plain DeepSpeedStrategy is what users run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from datetime import timedelta

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning.pytorch as pl
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning_sharded_train import Data, Sharded

from stepvault import Every, KeepLast, OnSignal
from stepvault.integrations.lightning import StepvaultCheckpoint


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """TEST-ONLY: Lightning's DeepSpeedStrategy on CPU processes over gloo."""

    strategy_name = "cpu_deepspeed_test_only"

    def setup_environment(self) -> None:
        # DeepSpeedStrategy refuses any accelerator but CUDA here; the rest is DDP's.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        # Lightning checks that CUDA device indices match the local ranks (CPU has none).
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _get_process_group_backend(self) -> str:
        return "gloo"

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        # Lightning passes device_rank=root_device.index (None on CPU); DeepSpeed needs the
        # local rank. Otherwise the same call as Lightning's.
        import argparse

        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer


def digest(engine: torch.nn.Module) -> str:
    """A hash of the full fp32 weights and AdamW moments (a collective call)."""
    h = hashlib.sha256()
    for name, param in sorted(engine.module.named_parameters()):
        for key, value in (
            ("w", safe_get_full_fp32_param(param)),
            ("m", safe_get_full_optimizer_state(param, "exp_avg")),
            ("v", safe_get_full_optimizer_state(param, "exp_avg_sq")),
        ):
            h.update(f"{name}.{key}".encode())
            h.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="ckpts")
    p.add_argument("--run", default="ds")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--native", help="save with Lightning's own DeepSpeed checkpoints here")
    p.add_argument("--resume-native", help="resume from this Lightning checkpoint folder")
    p.add_argument("--out", help="rank 0 writes the full fp32 weights here (torch.save)")
    args = p.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    strategy = CPUDeepSpeedStrategy(
        stage=args.stage,
        config={
            "zero_optimization": {"stage": args.stage},
            "zero_allow_untested_optimizer": True,
            "train_micro_batch_size_per_gpu": 16,
            "steps_per_print": 10_000,
        },
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
        )
        callbacks.append(ckpt)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
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
    final = digest(trainer.strategy.model)
    # the full fp32 weights by name (gathering them is a collective call: every rank)
    weights = {
        name: safe_get_full_fp32_param(param).detach().clone()
        for name, param in trainer.strategy.model.module.named_parameters()
    }
    if trainer.is_global_zero and args.out:
        torch.save(weights, args.out)
    if trainer.is_global_zero:
        restored = ckpt.last_restore if ckpt is not None else None
        print(f"RESUMED {restored.step}" if restored else "FRESH", flush=True)
        print(f"FINAL {final}", flush=True)


if __name__ == "__main__":
    main()
