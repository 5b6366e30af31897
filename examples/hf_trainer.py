"""Train a tiny GPT-2 (built from a config, no download) with the Hugging Face Trainer,
checkpointing through stepvault.

    python examples/hf_trainer.py --root ckpts --run gpt2-tiny --max-steps 100

Kill it and run the same command again: the Trainer resumes from the newest checkpoint
that verifies (model, optimizer, scheduler, RNGs, TrainerState, data position) and ends
with the same weights, bit for bit, as an uninterrupted run (the last line prints their
digest). Nothing is written to ``checkpoint-N`` folders and nothing is pickled.

With DDP on two CPU processes (gloo):

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/hf_trainer.py ...

process zero writes the checkpoints (with every rank's RNG state), every rank resumes from
the same one.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from stepvault import Every, KeepLast, OnSignal
from stepvault.integrations.transformers import StepvaultCallback, StepvaultTrainer


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, length: int = 32, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Sleep(TrainerCallback):
    """Slows each step down so that a test can kill the run in the middle."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


class SeedPerRank(TrainerCallback):
    """Each rank its own dropout masks (as it would draw its own augmentations): the
    Trainer seeds every rank alike. Before any step, so a resume restores over it."""

    def on_train_begin(self, args, state, control, **kwargs):
        torch.manual_seed(1000 + args.process_index)


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="ckpts")
    p.add_argument("--run", "--run-name", default="gpt2-tiny")  # torchrun rejects "--run"
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=128,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    ckpt = StepvaultCallback(
        args.root,
        run=args.run,
        save=Every(steps=args.save_every) | OnSignal(),  # replaces save_strategy/save_steps
        keep=KeepLast(args.keep),  # replaces save_total_limit
    )
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-trainer-"),  # logs only: no checkpoint-N folders
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        warmup_steps=5,
        logging_steps=5,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    callbacks = [ckpt, SeedPerRank()] + ([Sleep(args.step_sleep)] if args.step_sleep else [])
    trainer = StepvaultTrainer(
        model=model, args=training_args, train_dataset=RandomTokens(), callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=ckpt.has_checkpoint)  # newest valid, or fresh
    if trainer.is_world_process_zero():
        restored = ckpt.last_restore
        print(f"RESUMED {restored.step}" if restored else "FRESH", flush=True)
        print(f"FINAL {digest(model)}", flush=True)
    end_process_group()


def end_process_group() -> None:
    """Destroy the process group before exit: a gloo group left to the interpreter's
    exit can abort the process after the job finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
