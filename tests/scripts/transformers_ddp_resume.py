"""The Hugging Face Trainer job of ``transformers_sharded_train.py`` under plain DDP (2
processes, torchrun, gloo), resuming the store the FSDP2 job of that script wrote: the layout
change FSDP -> DDP, for tests/test_sharded_reshard.py.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        transformers_ddp_resume.py --root DIR --max-steps 16 --restored FILE

At the start of training rank 0 writes ``--restored`` (``torch.save``): the full weights,
the AdamW moments by parameter name and the scheduler's last LR, as the job starts from
them; at the end ``--final``: the same and every rank's next RNG draw. It prints
``RESUMED <step> skipped=<n>`` and ``LOSS <value>`` of the last logged step, or
``REFUSED <message>`` when the resume is refused.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainingArguments
from transformers_sharded_train import Tokens, _model

from stepvault import Every, KeepLast
from stepvault.errors import StepvaultError
from stepvault.integrations.transformers import StepvaultCallback, StepvaultTrainer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: list[float]) -> dict:
    """The full weights, AdamW moments by parameter name and LR (as the FSDP2 job's
    ``--final`` holds them)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=False)
    out = {f"w.{k}": t.clone() for k, t in get_model_state_dict(model, options=full).items()}
    osd = get_optimizer_state_dict(model, optimizer, options=full)
    for name, s in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}.{name}"] = s[key].clone()
    out["lr"] = torch.tensor(lr)
    return out


class Restored(TrainerCallback):
    """At the start of training (after the resume): rank 0 writes the state to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.trainer: StepvaultTrainer | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        assert trainer is not None
        got = _state(trainer.model, trainer.optimizer, trainer.lr_scheduler.get_last_lr())
        if dist.get_rank() == 0:
            torch.save(got, self.path)


class LastLoss(TrainerCallback):
    def __init__(self) -> None:
        self.loss: float | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.loss = float(logs["loss"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--restored", required=True)
    p.add_argument("--final", default="", help="the state at the end (rank 0 writes it)")
    args = p.parse_args()

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    training_args = TrainingArguments(
        output_dir=os.path.join(args.root, "out"),
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=2,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        ddp_backend="gloo",
        save_strategy="no",
    )
    ckpt = StepvaultCallback(
        args.root, run="gpt", save=Every(steps=args.save_every), keep=KeepLast(3)
    )
    restored, last = Restored(args.restored), LastLoss()
    trainer = StepvaultTrainer(
        model=_model(),
        args=training_args,
        train_dataset=Tokens(),
        callbacks=[ckpt, restored, last],
    )
    restored.trainer = trainer
    try:
        trainer.train(resume_from_checkpoint=ckpt.has_checkpoint)
    except StepvaultError as exc:
        if rank == 0:
            print(f"REFUSED {exc}", flush=True)
        return 0
    info = ckpt.last_restore
    final = _state(trainer.model, trainer.optimizer, trainer.lr_scheduler.get_last_lr())
    draws = [torch.zeros(3) for _ in range(dist.get_world_size())]
    dist.all_gather(draws, torch.rand(3))  # every rank's next draw, as the FSDP2 job's --final
    for r, d in enumerate(draws):
        final[f"rng.rank{r}"] = d
    if args.final and rank == 0:
        torch.save(final, args.final)
    if rank == 0:
        if info is not None:
            print(f"RESUMED {info.step} skipped={len(info.skipped)}", flush=True)
        assert last.loss is not None and math.isfinite(last.loss)
        print(f"LOSS {last.loss}", flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown (see tests/scripts/accelerate_ddp_state.py)
